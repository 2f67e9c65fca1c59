"""The router for real: `providerctl serve` with two demo models behind one port, and
`python3 -m agent.router` started the way providerd-router.socket starts it."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import ROOT, Served, free_port


def demo(port: int, name: str, models: str) -> str:
    argv = ["{python}", "-m", "agent.demo", "--port", "{port}", "--name", name]
    return f"""
[listen]
address = "127.0.0.1:{port}"
[runtime]
command = {json.dumps([*argv, "--load-delay", "0"])}
ready = "http:/health"
start_timeout_s = 30
request_timeout_s = 30
idle_timeout_s = 60
[models]
{models}
"""


def call(
    port: int, method: str, path: str, body: dict[str, Any] | None = None
) -> tuple[int, dict[str, str], bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        data = None if body is None else json.dumps(body).encode()
        c.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, Path]:
    port = free_port()
    path = tmp_path / "providerd.toml"
    path.write_text(f'[router]\nenabled = true\naddress = "127.0.0.1:{port}"\nidle_timeout_s = 1\n')
    monkeypatch.setenv("PROVIDERD_CONFIG", str(path))
    return port, path


def test_two_models_through_one_port(serve: Any, settings: tuple[int, Path]) -> None:
    router_port, _ = settings
    served: Served = serve(
        ("alpha", demo(free_port(), "alpha", 'names = ["alpha-1b"]')),
        ("beta", demo(free_port(), "beta", 'patterns = ["beta-.*"]')),
    )
    served.wait_log("Routing requests by model on 127.0.0.1:")

    # The list comes from the manifests: no worker starts for it.
    status, _, body = call(router_port, "GET", "/v1/models")
    assert status == 200
    assert json.loads(body)["data"] == [
        {
            "id": "alpha-1b",
            "object": "model",
            "created": json.loads(body)["data"][0]["created"],
            "owned_by": "alpha",
        }
    ]
    assert served.count("Starting worker") == 0

    # alpha: cold, activated by the routed request.
    status, _, body = call(
        router_port,
        "POST",
        "/v1/completions",
        {"model": "alpha-1b", "prompt": "hi", "max_tokens": 2},
    )
    assert status == 200, body
    assert json.loads(body)["model"] == "alpha"
    assert served.count("providerd.alpha: Starting worker on request") == 1
    assert served.count("providerd.beta: Starting worker") == 0

    # beta: by pattern, cold too, streamed back as server-sent events.
    status, headers, body = call(
        router_port,
        "POST",
        "/v1/completions",
        {"model": "beta-7b", "prompt": "hi", "max_tokens": 3, "stream": True},
    )
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    events = [line for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 4
    assert all(json.loads(e[6:])["model"] == "beta" for e in events[:-1])
    assert served.count("providerd.beta: Starting worker on request") == 1

    # Embeddings to alpha again: its worker is warm, no new start.
    status, _, body = call(
        router_port, "POST", "/v1/embeddings", {"model": "alpha-1b", "input": "x"}
    )
    assert status == 200 and json.loads(body)["model"] == "alpha"
    assert served.count("Starting worker") == 2

    status, _, body = call(router_port, "POST", "/v1/chat/completions", {"model": "gamma"})
    assert status == 404
    assert json.loads(body)["error"]["code"] == "model_not_found"
    served.wait_log('Refused POST "/v1/chat/completions": 404 The model "gamma" does not exist')


def test_serve_refuses_a_bad_settings_file(serve: Any, settings: tuple[int, Path]) -> None:
    _, path = settings
    path.write_text("[router]\nenabled = yes\n")
    served: Served = serve(("alpha", demo(free_port(), "alpha", 'names = ["a"]')), wait=False)
    assert served.proc.wait(20) == 1
    served.wait_log(f"Failed to load settings: {path}: ")


def test_the_socket_activated_router_routes_then_exits_when_idle(
    serve: Any, settings: tuple[int, Path], tmp_path: Path
) -> None:
    _, path = settings
    path.write_text("[router]\nidle_timeout_s = 1\n")  # not enabled: serve runs no router
    served: Served = serve(("alpha", demo(free_port(), "alpha", 'names = ["alpha-1b"]')))
    assert served.count("Routing requests by model") == 0

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(20)
    env = {
        **os.environ,
        "PROVIDERD_MANIFEST_DIRS": str(tmp_path / "m0"),  # where the serve fixture wrote them
        "PROVIDERD_TRUSTED_UID": str(os.getuid()),
        "NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
        "LISTEN_FDS": "1",
        "LISTEN_FDNAMES": "router",
    }
    fd = listener.fileno()
    proc = subprocess.Popen(
        ["/bin/sh", "-c", 'LISTEN_PID=$$ exec "$@"', "sh", sys.executable, "-m", "agent.router"],
        env=env,
        cwd=ROOT,
        close_fds=False,  # fd 3 from dup2 is inheritable; the rest is close-on-exec
        preexec_fn=lambda: os.set_inheritable(3, True) if fd == 3 else os.dup2(fd, 3),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        try:
            ready = notify.recv(4096).decode()
        except TimeoutError:
            proc.kill()
            assert proc.stderr is not None
            raise AssertionError(f"no READY=1 from the router:\n{proc.stderr.read()}") from None
        assert ready.startswith("READY=1")
        status, _, body = call(port, "POST", "/v1/embeddings", {"model": "alpha-1b", "input": "x"})
        assert status == 200 and json.loads(body)["model"] == "alpha"
        status, _, body = call(port, "GET", "/v1/models")
        assert [m["id"] for m in json.loads(body)["data"]] == ["alpha-1b"]
        messages = []
        while not any(m.startswith("STOPPING=1") for m in messages):
            messages.append(notify.recv(4096).decode())
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()
        notify.close()
        listener.close()
