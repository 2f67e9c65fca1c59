"""The front's request gate, state by state: API keys, can_start, and the model list
answered from the manifest while the worker is not ready."""

from __future__ import annotations

import json

import pytest

from agent.front.gate import Gate
from agent.front.state import State
from agent.net.http import RequestHead, parse_request_head
from agent.spec.apikeys import parse
from tests.unit.test_apikeys import ALICE, BOB, GOOD
from tests.unit.test_front import provider

KEYS = parse(GOOD, "/k.toml")


def head(method: str, target: str, *fields: str) -> RequestHead:
    raw = f"{method} {target} HTTP/1.1\r\nHost: x\r\n" + "".join(f + "\r\n" for f in fields)
    return parse_request_head((raw + "\r\n").encode())


def gate(state: State, keys: object = KEYS, **kw: object) -> Gate:
    p = provider(slug="esm", model_names=("esm-2", "esm-3"), model_patterns=("esm-.*",), **kw)
    return Gate(p, keys, lambda: state)  # type: ignore[arg-type]


@pytest.mark.parametrize("state", [State.IDLE, State.STARTING, State.STOPPING, State.BACKOFF])
def test_the_model_list_comes_from_the_manifest_until_the_worker_is_ready(state: State) -> None:
    g = gate(state, keys=None)
    for path in ("/v1/models", "/models", "/v1/models?limit=3"):
        a = g(head("GET", path))
        assert a is not None and a.status == 200 and a.doc is not None
        assert g.cause == ""  # no refusal
        assert [m["id"] for m in a.doc["data"]] == ["esm-2", "esm-3"]  # type: ignore[attr-defined]
        assert json.dumps(a.doc)  # the router's shape, as JSON
    one = g(head("GET", "/v1/models/esm-x"))  # a pattern answers for a name asked by itself
    assert one is not None and one.status == 200 and one.doc is not None
    assert one.doc["owned_by"] == "esm"
    missing = g(head("GET", "/v1/models/other"))
    assert missing is not None and missing.status == 404
    assert g(head("POST", "/v1/models")) is None  # not a listing: the worker's
    assert g(head("GET", "/v1/embeddings")) is None


def test_a_ready_worker_answers_the_model_list_itself() -> None:
    assert gate(State.READY, keys=None)(head("GET", "/v1/models")) is None


def test_keys_are_checked_before_anything_else() -> None:
    g = gate(State.IDLE)
    a = g(head("GET", "/v1/models"))
    assert a is not None and (a.status, a.code, g.cause) == (
        401,
        "missing_api_key",
        "unauthorized",
    )
    assert a.headers == (("WWW-Authenticate", 'Bearer realm="providerd"'),)
    listing = g(head("GET", "/v1/models", f"Authorization: Bearer {ALICE}"))
    assert listing is not None and listing.status == 200
    assert g(head("POST", "/v1/embeddings", f"x-api-key: {ALICE}")) is None  # may start it


@pytest.mark.parametrize(
    ("state", "refused"),
    [
        (State.IDLE, True),
        (State.STOPPING, True),
        (State.BACKOFF, True),
        (State.STARTING, False),
        (State.READY, False),
    ],
)
def test_a_key_without_can_start_is_served_only_while_the_model_runs_or_starts(
    state: State, refused: bool
) -> None:
    g = gate(state)
    a = g(head("POST", "/v1/embeddings", f"x-api-key: {BOB}"))
    if refused:
        assert a is not None and (a.status, a.code, g.cause) == (
            403,
            "cold_start_not_allowed",
            "forbidden",
        )
    else:
        assert a is None and g.cause == ""
    # Listing models never starts anything: allowed in every state.
    listing = gate(state)(head("GET", "/v1/models", f"x-api-key: {BOB}"))
    assert listing is None if state is State.READY else listing is not None


def test_a_key_out_of_scope_is_403_whatever_the_state() -> None:
    p = provider(slug="whisper")
    for state in State:
        g = Gate(p, KEYS, lambda s=state: s)
        a = g(head("GET", "/v1/models", f"x-api-key: {BOB}"))
        assert a is not None and (a.status, a.code, g.cause) == (
            403,
            "key_out_of_scope",
            "forbidden",
        )
        assert g(head("GET", "/v1/models")) is not None and g.cause == "unauthorized"
        g(head("GET", "/v1/models", f"x-api-key: {ALICE}"))  # the list, here or the worker's
        assert g.cause == ""  # a refusal before does not linger


def test_idle_ignore_paths_are_open_only_when_the_manifest_says_so() -> None:
    closed = gate(State.IDLE, idle_ignore_paths=("/health",))
    a = closed(head("GET", "/health"))
    assert a is not None and a.status == 401
    opened = gate(State.IDLE, idle_ignore_paths=("/health",), keyless_idle_ignore_paths=True)
    assert opened(head("GET", "/health")) is None
    b = opened(head("GET", "/healthz"))
    assert b is not None and b.status == 401


# -- keys handed to a running front (providerctl reload) --------------------------------


def test_the_wire_form_round_trips_and_fails_closed() -> None:
    from agent.spec import apikeys

    wire = apikeys.to_wire(KEYS)
    assert wire is not None and all(
        set(w) == {"name", "sha256", "providers", "can_start"} for w in wire
    )
    back = apikeys.from_wire(wire, "/k.toml")

    def shape(ks: apikeys.KeySet) -> list[tuple[object, ...]]:
        return [(k.name, k.digest, k.providers, k.can_start) for k in ks.keys]

    assert back is not None and shape(back) == shape(KEYS)  # descriptions stay home
    assert apikeys.from_wire(None, "/k.toml") is None  # keys off
    hostile = apikeys.from_wire([{"name": "x", "sha256": "short"}, 7, {"name": "Y"}], "/k.toml")
    assert hostile is not None and hostile.keys == () and hostile.problems
    assert apikeys.from_wire("nonsense", "/k.toml") == apikeys.KeySet((), (), "/k.toml")


def test_a_running_front_takes_new_keys_from_root_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio
    import os

    from agent.front.front import Front
    from agent.spec import apikeys
    from tests.unit.test_front import InProcessWorker, listener

    monkeypatch.setenv("PROVIDERD_TRUSTED_UID", str(os.getuid()))

    async def go() -> None:
        sock = listener()
        front = Front(provider(), InProcessWorker(), [sock], exit_on_idle=False, keys=KEYS)
        req = head("POST", "/v1/x", f"x-api-key: {ALICE}")
        assert front.request_gate(req) is None
        only_bob = apikeys.to_wire(parse(GOOD, "/k.toml"))
        assert only_bob is not None
        only_bob = [w for w in only_bob if w["name"] == "bob"]
        refused = await front.handle({"op": "keys", "keys": only_bob, "peer_uid": 4242})
        assert refused == {"error": "only root may change the API keys"}
        assert front.request_gate(req) is None  # unchanged
        done = await front.handle({"op": "keys", "keys": only_bob, "peer_uid": os.getuid()})
        assert done == {"keys": 1}
        answer = front.request_gate(req)
        assert answer is not None and answer.status == 401  # alice is revoked, at once
        assert await front.handle({"op": "keys", "keys": None, "peer_uid": 0}) == {"keys": None}
        assert front.request_gate(req) is None  # keys off
        sock.close()

    asyncio.run(go())


def test_the_control_socket_tells_who_connects(tmp_path: object) -> None:
    import asyncio
    import os
    from pathlib import Path

    from agent.net import rpc

    seen: list[object] = []

    async def handler(request: dict[str, object]) -> dict[str, object]:
        seen.append(request.get("peer_uid"))
        return {}

    async def go() -> None:
        path = Path(str(tmp_path)) / "c.sock"
        server = await rpc.serve(path, handler)
        await rpc.acall(path, {"op": "status", "peer_uid": 0}, 5)  # a client cannot claim one
        server.close()

    asyncio.run(go())
    assert seen == [os.getuid()]


def test_the_gate_tells_the_lease_whether_the_key_may_start_the_model() -> None:
    g = gate(State.READY)
    assert g(head("POST", "/v1/embeddings", f"x-api-key: {BOB}")) is None
    assert g.may_start is False  # served while it runs, but must never cause a start
    assert g(head("POST", "/v1/embeddings", f"x-api-key: {ALICE}")) is None
    assert g.may_start is True
