"""Foreground mode for real: `providerctl serve` with real worker processes on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.net import free_port, request
from support.paths import MISBEHAVE, ROOT
from support.serve import Served, serve_env, write_manifests

__all__ = ["MISBEHAVE", "ROOT", "Served", "free_port", "request"]  # what the tests import


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[object]:
    procs: list[Served] = []

    def start(
        *manifests: tuple[str, str], wait: bool = True, prefix: tuple[str, ...] = ()
    ) -> Served:
        mdir = write_manifests(tmp_path / f"m{len(procs)}", dict(manifests))
        env = serve_env(tmp_path) | {"PROVIDERD_RUNTIME_DIR": str(tmp_path / f"run{len(procs)}")}
        served = Served([mdir], env, prefix=prefix)
        procs.append(served)
        if wait:
            served.wait_log("Serving ")
        return served

    yield start
    for served in procs:
        served.stop()


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
