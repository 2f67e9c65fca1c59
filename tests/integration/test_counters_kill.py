"""Counters survive a front killed outright: `kill -9` of `providerctl serve` (fronts, router
and workers at once), scraped by the real metrics service before and after a restart."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Served, free_port
from tests.integration.test_metrics import Samples, metrics_service, scrape
from tests.integration.test_router import call, demo

SERVED = ("providerd_requests_served_total", (("provider", "m"),))
ROUTED = (
    "providerd_router_requests_total",
    (("code", "200"), ("model", "m-1"), ("provider", "m")),
)


def test_counters_survive_kill_9(
    serve: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    router_port, port = free_port(), free_port()
    settings = tmp_path / "providerd.toml"
    settings.write_text(f'[router]\nenabled = true\naddress = "127.0.0.1:{router_port}"\n')
    monkeypatch.setenv("PROVIDERD_CONFIG", str(settings))
    run = tmp_path / "run"  # one runtime directory for both agents, as /run/providerd is
    same_run = ("env", f"PROVIDERD_RUNTIME_DIR={run}")
    text = demo(port, "m", 'names = ["m-1"]')

    first: Served = serve(("m", text), prefix=same_run)
    first.runtime = run
    first.wait_log("Routing requests by model on 127.0.0.1:")
    with metrics_service(first, tmp_path / "state", tmp_path / "m0") as mport:
        for _ in range(4):
            assert call(port, "POST", "/v1/embeddings", {"model": "m-1", "input": "x"})[0] == 200
        for _ in range(3):
            assert (
                call(router_port, "POST", "/v1/embeddings", {"model": "m-1", "input": "x"})[0]
                == 200
            )
        before = until(mport, lambda s: s.get(SERVED, 0) >= 7 and s.get(ROUTED, 0) >= 3)
        # Within the JSON files' flush intervals (10 s, 5 s): only the live files hold these.
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        after_kill = scrape(mport)
        for k in (SERVED, ROUTED):
            assert after_kill[k] >= before[k], (k, before[k], after_kill[k])

        second: Served = serve(("m", text), prefix=same_run)
        second.wait_log("Routing requests by model on 127.0.0.1:")
        assert call(router_port, "POST", "/v1/embeddings", {"model": "m-1", "input": "x"})[0] == 200
        restarted = until(mport, lambda s: s.get(ROUTED, 0) > after_kill[ROUTED])
        assert restarted[SERVED] == after_kill[SERVED] + 1
        assert restarted[ROUTED] == after_kill[ROUTED] + 1


def until(port: int, ok: Callable[[Samples], bool], timeout: float = 10) -> Samples:
    """Scrape until `ok` holds (a request is counted once its response has gone out)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(port)
        if ok(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)
