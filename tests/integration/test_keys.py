"""API keys for real: `providerctl serve` with a keys file, the router in front, and the
official `openai` client on both the router and a provider's own port."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.conftest import Served, free_port
from tests.integration.test_router import call, demo

FULL = "pd-full-0123456789"
ALPHA = "pd-alpha-only-0123456789"
NOSTART = "pd-no-start-0123456789"


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


KEYS = f"""
[keys.full]
sha256 = "{sha(FULL)}"

[keys.alpha_only]
sha256 = "{sha(ALPHA)}"
providers = ["alpha"]

[keys.no_start]
sha256 = "{sha(NOSTART)}"
can_start = false
"""


@pytest.fixture
def keyed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """A keys file (0600) and a router; returns the router's port."""
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    keys.chmod(0o600)
    monkeypatch.setenv("PROVIDERD_KEYS", str(keys))
    port = free_port()
    settings = tmp_path / "providerd.toml"
    settings.write_text(f'[router]\nenabled = true\naddress = "127.0.0.1:{port}"\n')
    monkeypatch.setenv("PROVIDERD_CONFIG", str(settings))
    return port


OPEN: dict[tuple[int, str], openai.OpenAI] = {}


def client(port: int, key: str) -> openai.OpenAI:
    """One client per port and key, closed after each test (no connection left open)."""
    if (port, key) not in OPEN:
        OPEN[port, key] = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0
        )
    return OPEN[port, key]


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    for c in OPEN.values():
        c.close()
    OPEN.clear()


NO_KEY: dict[str, Any] = {"extra_headers": {"Authorization": openai.Omit()}}  # no header at all


def code(body: dict[str, Any]) -> str:
    """The refusal's code: the router answers in OpenAI's shape (`error.code`), a
    provider's own port flat (`error`)."""
    error = body["error"]
    return str(error["code"] if isinstance(error, dict) else error)


def message(body: dict[str, Any]) -> str:
    error = body["error"]
    return str(error["message"] if isinstance(error, dict) else body["message"])


def state(served: Served, slug: str) -> str:
    r = served.ctl("status", "--json", slug)
    return str(json.loads(r.stdout)["providers"][0]["state"])


def test_the_openai_client_needs_a_key_on_the_router_and_the_own_port(
    serve: Any, keyed: int
) -> None:
    alpha_port = free_port()
    served: Served = serve(("alpha", demo(alpha_port, "alpha", 'names = ["alpha-1b"]')))
    served.wait_log("Routing requests by model on 127.0.0.1:")
    served.wait_log("API keys are on: 3 key(s)")
    for port in (keyed, alpha_port):
        with pytest.raises(openai.AuthenticationError) as e:
            client(port, "x").embeddings.create(model="alpha-1b", input=["x"], **NO_KEY)
        body = e.value.response.json()
        assert e.value.status_code == 401 and code(body) == "missing_api_key"
        assert message(body).startswith("This endpoint needs an API key")
        assert e.value.response.headers["www-authenticate"] == 'Bearer realm="providerd"'
        with pytest.raises(openai.AuthenticationError) as e:
            client(port, "pd-wrong").embeddings.create(model="alpha-1b", input=["x"])
        assert code(e.value.response.json()) == "invalid_api_key"
        assert "invalid_token" in e.value.response.headers["www-authenticate"]
    # Refused requests started nothing.
    assert served.count("Starting worker") == 0 and state(served, "alpha") == "idle"

    # The model list answers without a start, on both ports, with a key.
    assert [m.id for m in client(keyed, FULL).models.list()] == ["alpha-1b"]
    assert [m.id for m in client(alpha_port, FULL).models.list()] == ["alpha-1b"]
    assert client(alpha_port, FULL).models.retrieve("alpha-1b").owned_by == "alpha"
    with pytest.raises(openai.NotFoundError):
        client(alpha_port, FULL).models.retrieve("gamma")
    with pytest.raises(openai.AuthenticationError):
        client(alpha_port, "x").models.list(**NO_KEY)
    assert served.count("Starting worker") == 0

    # The right key: a cold start, through the router, then on the own port.
    r = client(keyed, FULL).embeddings.create(model="alpha-1b", input=["x"])
    assert r.model == "alpha" and len(r.data[0].embedding) > 0
    assert served.count("Starting worker on request") == 1
    again = client(alpha_port, FULL).embeddings.create(model="alpha-1b", input=["x"])
    assert again.data[0].embedding == r.data[0].embedding
    # Warm: the list now comes from the worker itself.
    assert [m.id for m in client(alpha_port, FULL).models.list()] == ["alpha"]
    # Keys never reach the log.
    assert all(k not in served.log for k in (FULL, ALPHA, NOSTART, "pd-wrong", sha(FULL)))


def test_scopes_and_can_start(serve: Any, keyed: int, tmp_path: Path) -> None:
    alpha_port, beta_port = free_port(), free_port()
    served: Served = serve(
        ("alpha", demo(alpha_port, "alpha", 'names = ["alpha-1b"]')),
        ("beta", demo(beta_port, "beta", 'names = ["beta-7b"]')),
    )
    served.wait_log("Routing requests by model on 127.0.0.1:")

    # A key scoped to alpha: 403 for beta, on the router and on beta's port.
    with pytest.raises(openai.PermissionDeniedError) as e:
        client(keyed, ALPHA).embeddings.create(model="beta-7b", input=["x"])
    assert code(e.value.response.json()) == "key_out_of_scope"
    with pytest.raises(openai.PermissionDeniedError):
        client(beta_port, ALPHA).embeddings.create(model="beta-7b", input=["x"])
    # It lists only what it reaches.
    assert [m.id for m in client(keyed, ALPHA).models.list()] == ["alpha-1b"]
    assert {m.id for m in client(keyed, FULL).models.list()} == {"alpha-1b", "beta-7b"}

    # A key that may not start a model: refused while beta is idle, nothing starts ...
    for port in (keyed, beta_port):
        with pytest.raises(openai.PermissionDeniedError) as e:
            client(port, NOSTART).embeddings.create(model="beta-7b", input=["x"])
        assert code(e.value.response.json()) == "cold_start_not_allowed"
    assert served.count("Starting worker") == 0 and state(served, "beta") == "idle"
    # ... and served once another key started it.
    client(keyed, FULL).embeddings.create(model="beta-7b", input=["x"])
    assert client(keyed, NOSTART).embeddings.create(model="beta-7b", input=["x"]).model == "beta"
    assert (
        client(beta_port, NOSTART).embeddings.create(model="beta-7b", input=["x"]).model == "beta"
    )
    assert served.count("Starting worker") == 1

    # Refusals are counted by cause.
    counters = json.loads(served.ctl("status", "--json", "beta").stdout)["providers"][0]["counters"]
    assert counters["refused"]["forbidden"] >= 2


def test_idle_ignore_paths_may_stay_open(serve: Any, keyed: int) -> None:
    port = free_port()
    text = demo(port, "alpha", 'names = ["alpha-1b"]').replace(
        "[runtime]", '[runtime]\nidle_ignore_paths = ["/health"]\nkeyless_idle_ignore_paths = true'
    )
    served: Served = serve(("alpha", text))
    status, _, _ = call(port, "GET", "/health")
    assert status == 200
    status, headers, body = call(port, "GET", "/v1/models/alpha-1b")
    assert status == 401 and code(json.loads(body)) == "missing_api_key"
    assert headers["www-authenticate"].startswith("Bearer")
    assert served.count("Starting worker") == 1  # the open /health, by the operator's choice


def test_a_revoked_key_stops_at_once_and_the_model_keeps_running(
    serve: Any, keyed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `providerctl reload` does after the keys file changed: the running fronts get
    the new keys over their control sockets; the model is not restarted."""
    import io
    import os

    from agent.cli.keys import push

    port = free_port()
    served: Served = serve(("alpha", demo(port, "alpha", 'names = ["alpha-1b"]')))
    assert client(port, ALPHA).embeddings.create(model="alpha-1b", input=["x"]).model == "alpha"
    (tmp_path / "keys.toml").write_text(KEYS.replace("[keys.alpha_only]", "[keys.renamed]"))
    monkeypatch.setenv("PROVIDERD_RUNTIME_DIR", str(served.runtime))
    monkeypatch.setenv("PROVIDERD_TRUSTED_UID", str(os.getuid()))
    out, err = io.StringIO(), io.StringIO()
    assert push(out, err) == 0, err.getvalue()
    assert out.getvalue() == "API keys: 3 key(s) in force in 1 running front(s)\n"
    assert client(port, ALPHA).embeddings.create(model="alpha-1b", input=["x"]).model == "alpha"

    (tmp_path / "keys.toml").write_text(KEYS.split("[keys.alpha_only]")[0])  # alpha_only gone
    assert push(io.StringIO(), err) == 0
    with pytest.raises(openai.AuthenticationError):
        client(port, ALPHA).embeddings.create(model="alpha-1b", input=["x"])
    assert client(port, FULL).embeddings.create(model="alpha-1b", input=["x"]).model == "alpha"
    assert served.count("Starting worker") == 1  # the same worker all along
    assert ALPHA not in served.log and sha(ALPHA) not in served.log
