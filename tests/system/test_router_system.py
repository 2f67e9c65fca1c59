"""The router under a real systemd: the address from providerd.toml, two demo providers
installed from the .deb, requests for both through providerd-router.socket."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from .conftest import Provider
from .nspawn import Container

ROUTER_PORT = 18100
IDLE_S = 3


def demo(port: int, name: str, models: str) -> str:
    return f"""\
description = "demo model {name} behind the router"
enabled = true
[listen]
address = "127.0.0.1:{port}"
[runtime]
command = ["{{python}}", "-m", "agent.demo", "--port", "{{port}}", "--name", "{name}", "--load-delay", "0"]
ready = "http:/health"
start_timeout_s = 60
idle_timeout_s = 30
[models]
{models}
"""


def post(ct: Container, path: str, body: dict[str, object]) -> tuple[int, str]:
    data = json.dumps(body).replace("'", "'\\''")
    r = ct.sh(
        f"curl -sS --max-time 60 -o /root/out -w '%{{http_code}}' "
        f"-H 'Content-Type: application/json' -d '{data}' http://127.0.0.1:{ROUTER_PORT}{path}; "
        "echo; cat /root/out"
    )
    code, _, text = r.out.partition("\n")
    return int(code), text


@pytest.fixture
def routed(ct: Container, provider: Provider) -> Iterator[None]:
    ct.write(
        "/etc/providerd/providerd.toml",
        f'[router]\nenabled = true\naddress = "127.0.0.1:{ROUTER_PORT}"\nidle_timeout_s = {IDLE_S}\nlog_requests = true\n',
    )
    provider.add("ralpha", demo(18101, "alpha", 'names = ["alpha-1b"]'), reload=False)
    provider.add("rbeta", demo(18102, "beta", 'patterns = ["beta-.*"]'))
    ct.sh("systemctl restart providerd-router.socket")
    yield
    ct.sh("rm -f /etc/providerd/providerd.toml", check=False)
    ct.sh("systemctl stop providerd-router.socket providerd-router.service", check=False)
    ct.sh("systemctl daemon-reload; systemctl reset-failed 'providerd-router.*'", check=False)


def test_the_router_takes_its_address_from_providerd_toml(ct: Container, routed: None) -> None:
    assert f"127.0.0.1:{ROUTER_PORT}" in ct.prop("providerd-router.socket", "Listen")
    assert ct.listening(ROUTER_PORT)
    assert ct.active("providerd-router.service") == "inactive"
    wants = ct.sh("ls /run/systemd/generator/sockets.target.wants/", check=False).out
    assert "providerd-router.socket" in wants


def test_requests_for_two_models_through_the_router(ct: Container, routed: None) -> None:
    listing = json.loads(
        ct.sh(f"curl -sS --max-time 30 http://127.0.0.1:{ROUTER_PORT}/v1/models").out
    )
    assert [(m["id"], m["owned_by"]) for m in listing["data"]] == [("alpha-1b", "ralpha")]
    assert ct.active("provider-worker@ralpha.service") == "inactive", "listing started a worker"

    code, text = post(ct, "/v1/completions", {"model": "alpha-1b", "prompt": "hi", "max_tokens": 2})
    assert code == 200, text
    assert json.loads(text)["model"] == "alpha"
    code, text = post(ct, "/v1/embeddings", {"model": "beta-7b", "input": "hello"})
    assert code == 200, text
    assert json.loads(text)["model"] == "beta"
    pid = ct.prop("providerd-router.service", "MainPID")
    assert ct.sh(f"grep -c /uvloop/loop /proc/{pid}/maps", check=False).rc == 0, (
        f"uvloop is not loaded in the router (pid {pid})"
    )
    assert ct.active("provider-worker@ralpha.service") == "active"
    assert ct.active("provider-worker@rbeta.service") == "active"

    code, text = post(ct, "/v1/chat/completions", {"model": "nobody\nhere"})
    assert code == 404 and json.loads(text)["error"]["code"] == "model_not_found"

    log = ct.journal("-u providerd-router.service")
    assert 'for model "alpha-1b" to ralpha' in log, log
    assert 'for model "beta-7b" to rbeta' in log, log
    assert 'The model "nobody\\nhere" does not exist' in log, log

    # It idles out like a front; the socket stays and activates it again.
    ct.wait_for("! systemctl is-active -q providerd-router.service", timeout=IDLE_S + 20)
    assert ct.active("providerd-router.socket") == "active"
    code, _ = post(ct, "/v1/embeddings", {"model": "beta-1", "input": "again"})
    assert code == 200
