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
        assert a is not None and a.status == 200 and a.cause == ""
        assert [m["id"] for m in a.body["data"]] == ["esm-2", "esm-3"]  # type: ignore[attr-defined]
        assert json.dumps(a.body)  # the router's shape, as JSON
    one = g(head("GET", "/v1/models/esm-x"))  # a pattern answers for a name asked by itself
    assert one is not None and one.status == 200 and one.body["owned_by"] == "esm"
    missing = g(head("GET", "/v1/models/other"))
    assert missing is not None and missing.status == 404
    assert g(head("POST", "/v1/models")) is None  # not a listing: the worker's
    assert g(head("GET", "/v1/embeddings")) is None


def test_a_ready_worker_answers_the_model_list_itself() -> None:
    assert gate(State.READY, keys=None)(head("GET", "/v1/models")) is None


def test_keys_are_checked_before_anything_else() -> None:
    g = gate(State.IDLE)
    a = g(head("GET", "/v1/models"))
    assert a is not None and (a.status, a.body["error"], a.cause) == (
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
    a = gate(state)(head("POST", "/v1/embeddings", f"x-api-key: {BOB}"))
    if refused:
        assert a is not None and (a.status, a.body["error"]) == (403, "cold_start_not_allowed")
    else:
        assert a is None
    # Listing models never starts anything: allowed in every state.
    listing = gate(state)(head("GET", "/v1/models", f"x-api-key: {BOB}"))
    assert listing is None if state is State.READY else listing is not None


def test_a_key_out_of_scope_is_403_whatever_the_state() -> None:
    p = provider(slug="whisper")
    for state in State:
        a = Gate(p, KEYS, lambda s=state: s)(head("GET", "/v1/models", f"x-api-key: {BOB}"))
        assert a is not None and (a.status, a.body["error"]) == (403, "key_out_of_scope")


def test_idle_ignore_paths_are_open_only_when_the_manifest_says_so() -> None:
    closed = gate(State.IDLE, idle_ignore_paths=("/health",))
    a = closed(head("GET", "/health"))
    assert a is not None and a.status == 401
    opened = gate(State.IDLE, idle_ignore_paths=("/health",), keyless_idle_ignore_paths=True)
    assert opened(head("GET", "/health")) is None
    b = opened(head("GET", "/healthz"))
    assert b is not None and b.status == 401
