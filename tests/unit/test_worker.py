"""The worker wrapper's parts in-process: command line, placeholders, launch, probes, notify."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.net import free_port

from agent.systemd.notify import notify
from agent.worker import wrapper as worker
from agent.worker.wrapper import Failure, Options, Wrapper


def test_parse_command() -> None:
    o = worker.parse_args(["--slug", "esm", "--ready", "http:/health", "--", "m", "--x", "--"])
    assert (o.slug, o.ready, o.launch, o.argv) == (
        "esm",
        ("http", "/health"),
        None,
        ["m", "--x", "--"],
    )


def test_parse_launch_and_equals_form() -> None:
    o = worker.parse_args(["--slug=a", "--ready=notify", "--launch=pkg.mod:fn"])
    assert (o.slug, o.ready, o.launch, o.argv) == ("a", ("notify", ""), "pkg.mod:fn", [])


def test_ready_defaults_to_tcp() -> None:
    assert worker.parse_args(["--slug", "a", "--", "m"]).ready == ("tcp", "")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--", "m"], "--slug is required"),
        (["--slug", "a"], "give either --launch PACKAGE.MODULE:FUNCTION or -- ARGV..."),
        (["--slug", "a", "--launch", "m:f", "--", "m"], "give either"),
        (["--slug", "a", "--"], "the model's command after -- is empty"),
        (["--slug", "a", "--ready"], "--ready needs a value"),
        (
            ["--slug", "a", "--ready", "http", "--", "m"],
            "--ready: expected tcp, http:/PATH or notify",
        ),
        (["--slug", "a", "--ready", "http:health", "--", "m"], "got 'http:health'"),
        (["--slug", "a", "--port", "1", "--", "m"], "unknown argument '--port'"),
    ],
)
def test_parse_errors(args: list[str], message: str) -> None:
    with pytest.raises(Failure) as e:
        worker.parse_args(args)
    assert message in str(e.value)
    assert e.value.exit_status == 2


VALUES = {"port": "8123", "host": "127.0.0.1", "slug": "esm", "python": "/usr/bin/python3"}


def test_fill_leaves_everything_but_placeholders_alone() -> None:
    argv = ["{python}", "-m", "srv", "--port={port}", "100%", "$HOME", "a b", "{{json}}", "}}", ""]
    assert worker.fill_argv(argv, VALUES) == [
        "/usr/bin/python3", "-m", "srv", "--port=8123", "100%", "$HOME", "a b", "{json}", "}", "",
    ]  # fmt: skip


def test_fill_unknown_and_unbalanced() -> None:
    with pytest.raises(Failure, match=r"argument 1 '\{gpu\}': unknown placeholder \{gpu\}"):
        worker.fill_argv(["m", "{gpu}"], VALUES)
    with pytest.raises(Failure, match=r"argument 2 'a}': unbalanced '}'"):
        worker.fill_argv(["m", "x", "a}"], VALUES)


def test_placeholder_values_from_the_environment() -> None:
    env = {"PROVIDERD_WORKER_PORT": "8123", "PROVIDERD_WORKER_HOST": "::1"}
    values = worker.placeholder_values("esm", env)
    assert values == {"port": "8123", "host": "::1", "slug": "esm", "python": sys.executable}
    assert worker.placeholder_values("esm", {"PROVIDERD_WORKER_PORT": "1"})["host"] == "127.0.0.1"
    for bad in ("", "0", "65536", "80a"):
        with pytest.raises(Failure, match="PROVIDERD_WORKER_PORT"):
            worker.placeholder_values("esm", {"PROVIDERD_WORKER_PORT": bad})


def test_exit_codes() -> None:
    assert worker.exit_code(0) == 0
    assert worker.exit_code(3 << 8) == 3
    assert worker.exit_code(9) == 137  # killed by SIGKILL
    assert worker.describe_exit(3) == "exited with status 3"
    assert worker.describe_exit(143) == "was killed by SIGTERM"
    assert worker.describe_exit(128 + 10) == "was killed by signal 10"


def test_probe_address_for_wildcards() -> None:
    assert worker.probe_address("0.0.0.0") == (socket.AF_INET, "127.0.0.1")
    assert worker.probe_address("::") == (socket.AF_INET6, "::1")
    assert worker.probe_address("[::1]") == (socket.AF_INET6, "::1")
    assert worker.probe_address("10.0.0.2") == (socket.AF_INET, "10.0.0.2")


# -- launch, in-process ----------------------------------------------------------------------


@pytest.fixture
def launchers(tmp_path: Path) -> Iterator[str]:
    name = f"launchers_{os.getpid()}_{id(tmp_path)}"
    (tmp_path / f"{name}.py").write_text(
        "def good():\n    return ('{python}', '-m', 'x', '--port', '{port}')\n"
        "def boom():\n    raise RuntimeError('disk\\nfull')\n"
        "def none():\n    return None\n"
        "value = 'text'\n"
    )
    sys.path.insert(0, str(tmp_path))
    yield name
    sys.path.remove(str(tmp_path))
    sys.modules.pop(name, None)


def test_launch_returns_argv(launchers: str) -> None:
    assert worker.resolve_launch(f"{launchers}:good") == ["{python}", "-m", "x", "--port", "{port}"]


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("boom", "Failed to run launch '{m}:boom': RuntimeError: disk full"),
        ("none", "expected a non-empty list of strings (the argv), got NoneType None"),
        ("value", "'value' is a str, not a function"),
        ("nothing", "module '{m}' has no attribute 'nothing'"),
    ],
)
def test_launch_errors_are_one_line(launchers: str, function: str, message: str) -> None:
    with pytest.raises(Failure) as e:
        worker.resolve_launch(f"{launchers}:{function}")
    assert message.format(m=launchers) in str(e.value)
    assert "\n" not in str(e.value)
    assert e.value.exit_status == 2


def test_launch_form() -> None:
    for spec in ("mod", ":f", "mod:"):
        with pytest.raises(Failure, match=r"expected 'package\.module:function'"):
            worker.resolve_launch(spec)


# -- probes on real sockets ------------------------------------------------------------------


def make_wrapper(kind: str, port: int, path: str = "/health") -> Wrapper:
    options = Options("t", (kind, path if kind == "http" else ""), None, ["m"])
    return Wrapper(options, ["m"], {**VALUES, "port": str(port)})


def serve_once(listener: socket.socket, answer: bytes) -> threading.Thread:
    def run() -> None:
        conn, _ = listener.accept()
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(4096)
            assert request.startswith(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:")
            if answer:
                conn.sendall(answer)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s


def test_tcp_probe(listener: socket.socket) -> None:
    assert make_wrapper("tcp", listener.getsockname()[1]).probe() is None
    assert make_wrapper("tcp", free_port()).probe() == "connection refused"


@pytest.mark.parametrize(
    ("answer", "seen"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", None),
        (b"HTTP/1.0 204 No Content\r\n\r\n", None),
        (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n", "GET /health: 503"),
        (b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", "GET /health: 404"),
        (b"SSH-2.0-OpenSSH\r\n", "GET /health: no HTTP answer"),
        (b"", "GET /health: connection closed without an answer"),
    ],
)
def test_http_probe(listener: socket.socket, answer: bytes, seen: str | None) -> None:
    thread = serve_once(listener, answer)
    assert make_wrapper("http", listener.getsockname()[1]).probe() == seen
    thread.join(5)


def test_http_probe_refused() -> None:
    assert make_wrapper("http", free_port()).probe() == "GET /health: connection refused"


# -- notify ----------------------------------------------------------------------------------


def test_notify_to_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(tmp_path / "n"))
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n"))
        assert notify("READY=1\nSTATUS=ok") is True
        assert s.recv(100) == b"READY=1\nSTATUS=ok"


def test_notify_to_an_abstract_address() -> None:
    name = f"providerd-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        assert notify("STATUS=x", socket_path="@" + name) is True
        assert s.recv(100) == b"STATUS=x"


def test_notify_without_a_socket(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    assert notify("READY=1", socket_path=str(tmp_path / "nobody")) is False
    assert notify("READY=1", socket_path="vsock:2:1") is False


def test_quote_for_the_log() -> None:
    assert worker._quote(["/usr/bin/m", "--port", "80", "a b", "it's", ""]) == (
        "/usr/bin/m --port 80 'a b' 'it'\"'\"'s' ''"
    )


def test_wrapper_imports_nothing_heavy() -> None:
    """The start path stays cheap: no enum (signal, socket), asyncio, typing or dataclasses."""
    code = (
        "import sys; before = set(sys.modules); import agent.worker.wrapper; "
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "agent.worker.wrapper" in out
    for heavy in (
        "enum",
        "asyncio",
        "typing",
        "dataclasses",
        "socket",
        "signal",
        "agent.spec.provider",
    ):
        assert heavy not in out, heavy


def test_credentials_on_the_command_line() -> None:
    o = worker.parse_args(["--slug", "s", "--credential", "HF_TOKEN", "--credential=B", "--", "m"])
    assert o.credentials == ("HF_TOKEN", "B") and o.argv == ["m"]
    with pytest.raises(Failure, match="not a variable name"):
        worker.parse_args(["--slug", "s", "--credential", "1X", "--", "m"])


def test_credentials_become_the_models_variables(tmp_path: Path) -> None:
    (tmp_path / "TOKEN").write_bytes(b"hf_abc\n")
    (tmp_path / "TWO_LINES").write_bytes(b"a\nb\n\n")
    (tmp_path / "BINARY").write_bytes(b"\xff\x00key")
    env = {"CREDENTIALS_DIRECTORY": str(tmp_path)}
    got = worker.credential_environment(("TOKEN", "TWO_LINES", "BINARY"), env)
    # One trailing newline is dropped; a credential that is not text stays a file only.
    assert got == {"TOKEN": "hf_abc", "TWO_LINES": "a\nb\n"}
    assert worker.credential_environment((), {}) == {}


def test_a_missing_credential_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(Failure, match=r"^Failed to read credential GONE: No such file"):
        worker.credential_environment(("GONE",), {"CREDENTIALS_DIRECTORY": str(tmp_path)})
    with pytest.raises(Failure, match=r"CREDENTIALS_DIRECTORY is not set"):
        worker.credential_environment(("X",), {})


def test_a_probe_that_reaches_itself_is_no_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host-network worker's probe binds its loopback address, port 0: the kernel may give
    it the model's own port while nothing listens there yet, and the connect then reaches
    the probe itself. Made certain here by binding that port, as the kernel may; the probe
    leaves nothing on that port that would refuse the model's bind (a TIME_WAIT)."""
    port = free_port()

    class OwnPort(socket.socket):
        def bind(self, address: Any) -> None:
            super().bind((address[0], port))

    ns = types.SimpleNamespace(**vars(worker._socket))
    ns.socket = OwnPort
    monkeypatch.setattr(worker, "_socket", ns)
    w = make_wrapper("tcp", port)
    w.probe_host = "127.0.0.2"
    assert w.probe() == "connection refused"
    assert not w.connected
    with socket.socket() as model:  # nothing left on the port to refuse the model's bind
        model.bind(("127.0.0.2", port))


def test_a_peer_gone_before_the_check_is_not_the_probe_itself() -> None:
    """A model that accepted the probe and reset it at once leaves no peer to compare
    with: that is the model (it accepted), never a connection to itself."""

    class Reset:
        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.2", 1234)

        def getpeername(self) -> tuple[str, int]:
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    assert worker.reaches_itself(Reset()) is False  # type: ignore[arg-type]
