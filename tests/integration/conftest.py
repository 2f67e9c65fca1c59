"""Foreground mode for real: `providerctl serve` with real worker processes on loopback."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MISBEHAVE = ROOT / "tests" / "workers" / "misbehave.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """A running `providerctl serve` and its log."""

    def __init__(self, proc: subprocess.Popen[str], runtime: Path) -> None:
        self.proc = proc
        self.runtime = runtime
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def count(self, text: str) -> int:
        return sum(text in line for line in self.lines)

    def wait_log(self, text: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.count(text):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(f"no log line with {text!r} within {timeout} s:\n{self.log}")

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PROVIDERD_RUNTIME_DIR": str(self.runtime)}
        return subprocess.run(
            [sys.executable, "-m", "agent", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[object]:
    procs: list[Served] = []

    def start(
        *manifests: tuple[str, str], wait: bool = True, prefix: tuple[str, ...] = ()
    ) -> Served:
        mdir = tmp_path / f"m{len(procs)}"
        mdir.mkdir(mode=0o755)
        for slug, text in manifests:
            path = mdir / f"{slug}.toml"
            path.write_text(text)
            path.chmod(0o644)
        runtime = tmp_path / f"run{len(procs)}"
        env = {
            **os.environ,
            "PROVIDERD_RUNTIME_DIR": str(runtime),
            "PROVIDERD_STATE_DIR": str(tmp_path / "state"),
            "PROVIDERD_TRUSTED_UID": str(os.getuid()),
            "PYTHONUNBUFFERED": "1",
        }
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "agent", "serve", str(mdir)],
            env=env,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        served = Served(proc, runtime)
        procs.append(served)
        if wait:
            served.wait_log("Serving ")
        return served

    yield start
    for served in procs:
        if served.proc.poll() is None:
            served.proc.send_signal(signal.SIGTERM)
            try:
                served.proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(served.proc.pid, signal.SIGKILL)
                served.proc.wait()
        served._reader.join(5)
        if served.proc.stderr is not None:
            served.proc.stderr.close()


def manifest(
    port: int,
    *worker_args: str,
    protocol: str = "http",
    ready: str = "http:/health",
    idle: float = 30,
    extra_runtime: str = "",
    extra: str = "",
) -> str:
    argv = ["{python}", str(MISBEHAVE), "--port", "{port}", *worker_args]
    return f"""
[listen]
address = "127.0.0.1:{port}"
protocol = "{protocol}"
{extra}
[runtime]
command = {json.dumps(argv)}
ready = "{ready}"
start_timeout_s = 20
request_timeout_s = 10
idle_timeout_s = {idle}
idle_ignore_paths = ["/health"]
{extra_runtime}
"""


def request(
    port: int,
    path: str = "/",
    method: str = "GET",
    body: bytes | None = None,
    timeout: float = 30,
    conn: http.client.HTTPConnection | None = None,
) -> tuple[int, dict[str, str], bytes]:
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, body=body)
        r = c.getresponse()
        data = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data
    finally:
        if conn is None:
            c.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
            return False
    return True


def wait_gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False
