"""The worker wrapper for real: `python3 -m agent.worker` with real models and signals.

Each test binds the NOTIFY_SOCKET the wrapper reports to, as systemd (or the front in
foreground mode) would, and records every datagram.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.net import accepts, free_port, get
from support.paths import MISBEHAVE as MISBEHAVE_PATH
from support.paths import ROOT

from tests.integration.conftest import alive

MISBEHAVE = str(MISBEHAVE_PATH)
PY = sys.executable


def wait_until(what: str, check: Callable[[], object], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.01)
    raise AssertionError(f"{what}: not within {timeout} s")


class Notifications:
    """A NOTIFY_SOCKET: every datagram, and what held when READY=1 arrived."""

    def __init__(self, path: Path, on_ready: Callable[[], object] | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.path = str(path)
        self.messages: list[str] = []
        self.on_ready = on_ready
        self.at_ready: object = None
        self.ready = threading.Event()
        self.closed = False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.closed:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            text = data.decode()
            if "READY=1" in text.split("\n") and not self.ready.is_set():
                # What the model does at this very moment: called before anything else.
                if self.on_ready is not None:
                    self.at_ready = self.on_ready()
                self.ready.set()
            self.messages.append(text)

    def lines(self) -> list[str]:
        return [line for m in list(self.messages) for line in m.split("\n")]

    def close(self) -> None:
        self.closed = True
        self.thread.join()
        self.sock.close()


class Run:
    def __init__(self, proc: subprocess.Popen[str], notes: Notifications, port: int) -> None:
        self.proc = proc
        self.notes = notes
        self.port = port

    def wait(self, timeout: float = 15) -> int:
        return self.proc.wait(timeout)

    def stderr(self) -> str:
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


Start = Callable[..., Run]


@pytest.fixture
def wrapper(tmp_path: Path) -> Iterator[Start]:
    runs: list[Run] = []

    def start(
        *args: str,
        port: int | None = None,
        on_ready: Callable[[], object] | None = None,
        env: dict[str, str] | None = None,
    ) -> Run:
        port = port or free_port()
        notes = Notifications(tmp_path / f"notify{len(runs)}", on_ready)
        full_env = {
            **os.environ,
            "NOTIFY_SOCKET": notes.path,
            "PROVIDERD_WORKER_PORT": str(port),
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        proc = subprocess.Popen(
            [PY, "-m", "agent.worker", *args],
            env=full_env,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )
        run = Run(proc, notes, port)
        runs.append(run)
        return run

    yield start
    for run in runs:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        if run.proc.stderr is not None:
            run.proc.stderr.close()
        run.notes.close()


def misbehave(*args: str) -> list[str]:
    return ["--", "{python}", MISBEHAVE, "--port", "{port}", *args]


def read_pid(path: Path) -> int:
    wait_until("pid file", lambda: path.exists() and path.read_text().endswith("\n"))
    return int(path.read_text())


# -- readiness ----------------------------------------------------------------------------


def test_tcp_ready_only_when_the_port_accepts(wrapper: Start) -> None:
    port = free_port()
    run = wrapper(
        "--slug", "t", "--ready", "tcp", *misbehave("--start-delay", "0.5"),
        port=port, on_ready=lambda: accepts(port),
    )  # fmt: skip
    assert run.notes.ready.wait(15)
    assert run.notes.at_ready is True
    lines = run.notes.lines()
    assert "STATUS=Loading (probe: connection refused)" in lines
    assert lines.index("READY=1") > lines.index("STATUS=Loading (probe: connection refused)")
    assert f"STATUS=Serving on 127.0.0.1:{port}" in lines


def test_http_ready_only_after_2xx_503_is_loading(wrapper: Start) -> None:
    port = free_port()
    run = wrapper(
        "--slug", "h", "--ready", "http:/health", *misbehave("--ready-after", "0.8"),
        port=port, on_ready=lambda: get(port, "/health")[0],
    )  # fmt: skip
    assert run.notes.ready.wait(15)
    assert run.notes.at_ready == 200
    lines = run.notes.lines()
    assert "STATUS=Loading (probe: GET /health: 503)" in lines
    assert lines.index("READY=1") > lines.index("STATUS=Loading (probe: GET /health: 503)")
    run.proc.terminate()
    assert run.wait() == 0
    assert "ready after" in run.stderr()


def test_http_never_ready_never_says_ready(wrapper: Start) -> None:
    port = free_port()
    run = wrapper("--slug", "n", "--ready", "http:/health", *misbehave("--never-ready"), port=port)
    wait_until("model listening", lambda: accepts(port))
    wait_until(
        "a 503 status",
        lambda: "STATUS=Loading (probe: GET /health: 503)" in run.notes.lines(),
    )
    time.sleep(0.3)
    assert not run.notes.ready.is_set()
    assert run.proc.poll() is None  # it keeps probing: the timeout is not its business


def test_notify_ready_is_the_models_own(wrapper: Start) -> None:
    port = free_port()
    run = wrapper(
        "--slug", "m", "--ready", "notify",
        *misbehave("--notify", "--ready-after", "0.5", "--echo-env", "NOTIFY_SOCKET"),
        port=port, on_ready=lambda: get(port, "/health")[0],
    )  # fmt: skip
    assert run.notes.ready.wait(15)
    assert run.notes.at_ready == 200  # the model said READY=1 only once /health was 200
    lines = run.notes.lines()
    assert "STATUS=misbehave loading" in lines  # relayed before ready
    assert lines.index("READY=1") > lines.index("STATUS=misbehave loading")
    assert f"STATUS=misbehave serving on 127.0.0.1:{port}" in lines  # relayed
    # The model got the wrapper's own socket (abstract), not the manager's.
    env = json.loads(get(port, "/env")[1])
    assert env["NOTIFY_SOCKET"].startswith("@providerd/worker/")


def test_notify_listening_is_not_ready(wrapper: Start) -> None:
    port = free_port()
    run = wrapper("--slug", "q", "--ready", "notify", *misbehave(), port=port)
    wait_until("model listening", lambda: accepts(port))
    wait_until(
        "the loading status",
        lambda: "STATUS=Loading (probe: waiting for READY=1)" in run.notes.lines(),
    )
    time.sleep(0.3)  # listening, and a while after: still no READY=1
    assert not run.notes.ready.is_set()


def test_tcp_model_gets_no_notify_socket(wrapper: Start) -> None:
    run = wrapper("--slug", "e", *misbehave("--echo-env", "NOTIFY_SOCKET,PROVIDERD_WORKER_PORT"))
    assert run.notes.ready.wait(15)
    env = json.loads(get(run.port, "/env")[1])
    assert env == {"NOTIFY_SOCKET": None, "PROVIDERD_WORKER_PORT": str(run.port)}


# -- exits before ready ---------------------------------------------------------------------


def test_model_exits_before_ready(wrapper: Start) -> None:
    run = wrapper("--slug", "x", *misbehave("--start-delay", "0.2", "--exit-at-start", "5"))
    assert run.wait() == 5
    err = run.stderr()
    assert "Failed to start the model for x:" in err
    assert "exited with status 5" in err
    assert "before it was ready (probe: connection refused)" in err
    assert "Traceback" not in err
    lines = run.notes.lines()
    assert "READY=1" not in lines
    assert any(line.startswith("STATUS=Model exited with status 5") for line in lines)


def test_model_killed_before_ready_is_128_plus_n(wrapper: Start) -> None:
    run = wrapper("--slug", "k", "--", "{python}", "-c", "import os; os.kill(os.getpid(), 9)")
    assert run.wait() == 128 + 9
    assert "was killed by SIGKILL" in run.stderr()
    assert "READY=1" not in run.notes.lines()


def test_program_not_found(wrapper: Start) -> None:
    run = wrapper("--slug", "p", "--", "/nonexistent/model-server", "--port", "{port}")
    assert run.wait() == 127
    err = run.stderr()
    assert err.strip() == (
        "Failed to start the model for p: /nonexistent/model-server: No such file or directory"
    )


# -- signals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sig", "expected"),
    [(signal.SIGTERM, 7), (signal.SIGINT, 7), (signal.SIGHUP, 128 + signal.SIGHUP)],
)
def test_signal_is_passed_on_and_status_is_the_models(
    wrapper: Start, sig: signal.Signals, expected: int
) -> None:
    # misbehave exits 7 on SIGTERM/SIGINT and dies of SIGHUP (no handler).
    run = wrapper("--slug", "s", *misbehave("--term-exit", "7"))
    assert run.notes.ready.wait(15)
    run.proc.send_signal(sig)
    assert run.wait() == expected
    err = run.stderr()
    assert f"Passing {sig.name} on to the model" in err


def test_sigterm_before_ready_is_passed_on(wrapper: Start, tmp_path: Path) -> None:
    pidfile = tmp_path / "model.pid"
    run = wrapper(
        "--slug", "b",
        *misbehave("--never-listen", "--term-exit", "9", "--pid-file", str(pidfile)),
    )  # fmt: skip
    model = read_pid(pidfile)
    run.proc.terminate()
    assert run.wait() == 9
    assert not alive(model)
    assert "READY=1" not in run.notes.lines()


def test_ignored_sigterm_then_sigkill_of_the_wrapper_leaves_nothing(
    wrapper: Start, tmp_path: Path
) -> None:
    pidfile = tmp_path / "model.pid"
    run = wrapper("--slug", "i", *misbehave("--ignore-sigterm", "--pid-file", str(pidfile)))
    assert run.notes.ready.wait(15)
    model = read_pid(pidfile)
    run.proc.terminate()
    time.sleep(0.3)
    # The wrapper passed it on and waits; the model ignored it.
    assert run.proc.poll() is None
    assert alive(model)
    run.proc.kill()
    assert run.wait() == -signal.SIGKILL
    wait_until("the model to die with its wrapper (PR_SET_PDEATHSIG)", lambda: not alive(model))
    assert "Passing SIGTERM on to the model" in run.stderr()


def test_sigkill_of_the_wrapper_while_loading_kills_the_model(
    wrapper: Start, tmp_path: Path
) -> None:
    pidfile = tmp_path / "model.pid"
    run = wrapper("--slug", "l", *misbehave("--start-delay", "30", "--pid-file", str(pidfile)))
    model = read_pid(pidfile)
    run.proc.kill()
    run.wait()
    wait_until("the model to die with its wrapper", lambda: not alive(model))


# -- the model's command line ---------------------------------------------------------------


def test_arguments_reach_the_model_unchanged(wrapper: Start) -> None:
    odd = ["100%", "$HOME", "${{X}}", "a b", "'q'", '"d"', "{{x}}", "}}{{", "%i %%", "\\n", ""]
    run = wrapper(
        "--slug", "quo-ting",
        *misbehave("--echo-argv", "--", *odd, "{slug}@{host}:{port}", "{{{port}}}"),
        env={"PROVIDERD_WORKER_HOST": "127.0.0.1"},
    )  # fmt: skip
    assert run.notes.ready.wait(15)
    argv = json.loads(get(run.port, "/argv")[1])
    literal = ["100%", "$HOME", "${X}", "a b", "'q'", '"d"', "{x}", "}{", "%i %%", "\\n", ""]
    assert argv[-len(odd) - 2 :] == [*literal, f"quo-ting@127.0.0.1:{run.port}", f"{{{run.port}}}"]
    assert argv[0] == MISBEHAVE


def test_launch_callable(wrapper: Start, tmp_path: Path) -> None:
    (tmp_path / "launchers.py").write_text(
        "import os\n"
        f"MODEL = {MISBEHAVE!r}\n"
        "def good():\n"
        "    assert os.environ['PROVIDERD_WORKER_PORT']\n"
        "    return ['{python}', MODEL, '--port', '{port}', '--echo-argv', '--', 'a b', '{slug}']\n"
    )
    run = wrapper(
        "--slug", "la", "--ready", "http:/health", "--launch", "launchers:good",
        env={"PYTHONPATH": f"{ROOT}:{tmp_path}"},
    )  # fmt: skip
    assert run.notes.ready.wait(15)
    argv = json.loads(get(run.port, "/argv")[1])
    assert argv[1:] == ["--port", str(run.port), "--echo-argv", "--", "a b", "la"]


LAUNCHERS = """
def raises():
    raise ValueError("no model configured\\nat all")
def wrong():
    return {"argv": ["x"]}
def empty():
    return []
def holds_int():
    return ["model", 8000]
not_callable = 42
"""


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nomodule_here:f", "Failed to import 'nomodule_here' for launch 'nomodule_here:f': "
         "ModuleNotFoundError: No module named 'nomodule_here'"),
        ("launchers2", "Failed to resolve launch 'launchers2': expected 'package.module:function'"),
        ("launchers2:missing", "Failed to resolve launch 'launchers2:missing': "
         "module 'launchers2' has no attribute 'missing'"),
        ("launchers2:not_callable", "Failed to resolve launch 'launchers2:not_callable': "
         "'not_callable' is a int, not a function"),
        ("launchers2:raises", "Failed to run launch 'launchers2:raises': "
         "ValueError: no model configured at all"),
        ("launchers2:wrong", "Failed to use launch 'launchers2:wrong': expected a non-empty "
         "list of strings (the argv), got dict {'argv': ['x']}"),
        ("launchers2:empty", "Failed to use launch 'launchers2:empty': expected a non-empty "
         "list of strings (the argv), got list []"),
        ("launchers2:holds_int", "Failed to use launch 'launchers2:holds_int': expected a "
         "non-empty list of strings (the argv), got a list holding a int (8000)"),
    ],
)  # fmt: skip
def test_launch_failures(wrapper: Start, tmp_path: Path, spec: str, message: str) -> None:
    (tmp_path / "launchers2.py").write_text(LAUNCHERS)
    run = wrapper("--slug", "lf", "--launch", spec, env={"PYTHONPATH": f"{ROOT}:{tmp_path}"})
    assert run.wait() == 2
    assert run.stderr() == message + "\n"
    assert f"STATUS={message}" in run.notes.lines()


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--slug", "u", "--", "m", "{model}"], {},
         "Failed to fill argument 1 '{model}': unknown placeholder {model} "
         "(known: {port}, {host}, {slug}, {python}; write {{ and }} for literal braces)"),
        (["--slug", "u", "--", "m", "{port"], {},
         "Failed to fill argument 1 '{port': unbalanced '{' (write '{{' for a literal brace)"),
        (["--slug", "u", "--", "m"], {"PROVIDERD_WORKER_PORT": ""},
         "Failed to start the worker for u: PROVIDERD_WORKER_PORT is not set "
         "(the front writes it into /run/providerd/u/worker.env before each start)"),
        (["--slug", "u", "--", "m"], {"PROVIDERD_WORKER_PORT": "http"},
         "Failed to start the worker for u: PROVIDERD_WORKER_PORT is 'http', not a port number "
         "(the front writes it into /run/providerd/u/worker.env before each start)"),
    ],
)  # fmt: skip
def test_bad_placeholders_and_port(
    wrapper: Start, args: list[str], env: dict[str, str], message: str
) -> None:
    run = wrapper(*args, env=env)
    assert run.wait() == 2
    assert run.stderr() == message + "\n"


def test_bad_command_line_is_usage(wrapper: Start) -> None:
    run = wrapper("--slug", "u", "--ready", "http", "--", "m")
    assert run.wait() == 2
    err = run.stderr()
    assert err.startswith("agent.worker: --ready: expected tcp, http:/PATH or notify, got 'http'\n")
    assert "usage: python3 -m agent.worker" in err


# -- the test worker's own switches (used by the front's tests and the other tiers) ----------


@pytest.fixture
def worker() -> Iterator[Callable[..., tuple[subprocess.Popen[str], int]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> tuple[subprocess.Popen[str], int]:
        port = free_port()
        proc = subprocess.Popen(
            [PY, MISBEHAVE, "--port", str(port), *args], stderr=subprocess.PIPE, text=True
        )
        procs.append(proc)
        if "--unix" in args:
            # The path appears at bind(), a moment before listen(): wait for a connection.
            path = args[args.index("--unix") + 1]
            wait_until("misbehave listening", lambda: unix_accepts(path) or proc.poll() is not None)
        else:
            wait_until("misbehave listening", lambda: accepts(port) or proc.poll() is not None)
        return proc, port

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


Worker = Callable[..., tuple[subprocess.Popen[str], int]]


def unix_accepts(path: str) -> bool:
    """Something accepts connections on the unix socket `path`."""
    with socket.socket(socket.AF_UNIX) as s:
        return s.connect_ex(path) == 0


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_misbehave_crash_after_n_requests(worker: Worker) -> None:
    proc, port = worker("--crash-after", "2")
    assert get(port, "/health")[0] == 200  # not counted
    assert get(port, "/pid")[0] == 200  # not counted
    assert get(port, "/a")[0] == 200
    assert get(port, "/b")[0] == 200  # answered, then the worker exits
    assert proc.wait(10) == 3
    assert proc.stderr is not None
    assert "misbehave: crashing after 2 requests (exit status 3)" in proc.stderr.read()


def test_misbehave_slow_body_and_stream(worker: Worker) -> None:
    _, port = worker("--slow-body", "0.5", "--body-chunks", "5")
    t0 = time.monotonic()
    status, body = get(port, "/x")
    assert status == 200
    assert json.loads(body)["path"] == "/x"
    assert time.monotonic() - t0 >= 0.5
    t0 = time.monotonic()
    status, body = get(port, "/stream")
    assert body.decode().splitlines() == [f"chunk {i}" for i in range(5)]
    assert time.monotonic() - t0 >= 0.5
    assert get(port, "/stream?chunks=3&delay=0")[1] == b"chunk 0\nchunk 1\nchunk 2\n"


def test_misbehave_slow_read(worker: Worker) -> None:
    _, port = worker("--slow-read", "--read-rate", "200000")
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        t0 = time.monotonic()
        c.request("POST", "/upload", body=b"x" * 100_000)
        r = c.getresponse()
        assert json.loads(r.read())["body_length"] == 100_000
        assert time.monotonic() - t0 >= 0.4  # 100 kB at 200 kB/s
    finally:
        c.close()


def test_misbehave_memory(worker: Worker) -> None:
    proc, _ = worker("--memory-mb", "20", "--grow-mb-per-s", "50")
    first = rss_kb(proc.pid)
    assert first >= 20 * 1024
    wait_until("memory growing", lambda: rss_kb(proc.pid) >= first + 10 * 1024)


def test_misbehave_on_a_unix_socket(worker: Worker, tmp_path: Path) -> None:
    path = tmp_path / "w.sock"
    worker("--unix", str(path))  # returns once the socket accepts
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(path))
        s.sendall(b"GET /pid HTTP/1.1\r\nHost: x\r\n\r\n")
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 200 ")
