"""Shared pieces of the GPU tier: real NVML, real CUDA processes, and the figures file.

The tier runs under pytest (`pytest -m gpu tests/gpu`) or, on a host without pytest,
under `tests/gpu/runner.py`; test functions take no arguments and call `skip()`.
With PROVIDERD_NVML_FAKE set, NVML and the CUDA workers use the fake card of
`agent.gpu.nvml.DirNvml` instead (`tests/integration/test_gpu_fake.py`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.paths import ROOT

WORKER = Path(__file__).resolve().parent / "cuda_worker.py"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agent.gpu.nvml import (  # noqa: E402
    FAKE_ENV,
    GIB,
    MIB,
    Card,
    Nvml,
    NvmlUnavailable,
    open_nvml,
    pid_exists,
)

FIGURES: list[str] = []


class Skip(Exception):
    pass


def skip(reason: str) -> None:
    if "pytest" in sys.modules and not os.environ.get("PROVIDERD_GPU_RUNNER"):
        import pytest

        pytest.skip(reason)
    raise Skip(reason)


def figure(name: str, value: str) -> None:
    """One measured figure; the runner writes them all to $OUT/gpu.txt."""
    line = f"{name}: {value}"
    FIGURES.append(line)
    print(f"    {line}", flush=True)


_nvml: Nvml | None = None


def fake() -> bool:
    """Whether this run uses the fake card rather than a real GPU."""
    return bool(os.environ.get(FAKE_ENV))


def nvml() -> Nvml:
    global _nvml
    if _nvml is None:
        try:
            _nvml = open_nvml()
        except NvmlUnavailable as e:
            skip(str(e))
    assert _nvml is not None
    return _nvml


def card() -> Card:
    """The card with the most free memory, once the memory of processes that have
    exited (an earlier test's) shows as free: NVML takes about 0.1 s for that."""
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and not all(pid_exists(p.pid) for p in nvml().processes()):
        time.sleep(0.01)
    cards = nvml().cards()
    if not cards:
        skip("no GPU")
    return max(cards, key=lambda c: c.free)


def card_by_uuid(uuid: str) -> Card:
    return next(c for c in nvml().cards() if c.uuid == uuid)


class Held:
    """A CUDA process holding memory (`cuda_worker.py hold`)."""

    def __init__(self, nbytes: int, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "hold", str(nbytes)],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(
                f"the CUDA worker failed to allocate {nbytes} bytes: {err.strip()}"
            )
        self.info: dict[str, Any] = json.loads(line)
        self.pid = self.proc.pid

    def kill(self, sig: int = signal.SIGKILL) -> float:
        """Signal it and reap it; the moment it was signalled (monotonic)."""
        at = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        return at


def wait_free(uuid: str, at_least: int, timeout_s: float = 10.0) -> float:
    """Poll NVML every 2 ms until the card shows `at_least` free; the moment it did."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = time.monotonic()
        if card_by_uuid(uuid).free >= at_least:
            return now
        if now > deadline:
            raise AssertionError(
                f"GPU {uuid} did not show {at_least / GIB:.1f} GiB free within {timeout_s} s"
            )
        time.sleep(0.002)


def tests_in(path: Path) -> list[tuple[str, Callable[[], None]]]:
    """The `test_*` functions of a GPU-tier file, in order, as ("file::name", function)."""
    spec = importlib.util.spec_from_file_location(f"gpu_tier_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [
        (f"{path.stem}::{attr}", fn)
        for attr, fn in vars(module).items()
        if attr.startswith("test_") and callable(fn)
    ]


def norm_bus(bus: str) -> str:
    """'00000000:1B:00.0' and '0000:1b:00.0' → '1b:00.0'."""
    return bus.lower().split(":", 1)[1] if bus.count(":") == 2 else bus.lower()


__all__ = ["GIB", "MIB", "Held", "Skip", "card", "fake", "figure", "nvml", "skip", "wait_free"]
