"""The metrics service for real: `python3 -m agent.metrics --listen` over `providerctl serve`,
scraped with prometheus_client's parser across an idle release and a restart of the agent."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import ROOT, Served, free_port, manifest, request

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
SERVED = ("providerd_requests_served_total", (("provider", "m"),))
STARTS = ("providerd_cold_starts_total", (("provider", "m"),))
IDLE = ("providerd_idle_releases_total", (("provider", "m"),))
READY = ("providerd_provider_state", (("provider", "m"), ("state", "ready")))


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@contextlib.contextmanager
def metrics_service(served: Served, state: Path, manifests: Path) -> Iterator[int]:
    """`python3 -m agent.metrics --listen` over what `served` runs; yields its port."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PROVIDERD_RUNTIME_DIR": str(served.runtime),
        "PROVIDERD_STATE_DIR": str(state),
        "PROVIDERD_MANIFEST_DIRS": str(manifests),
        "PROVIDERD_TRUSTED_UID": str(os.getuid()),
    }
    argv = [sys.executable, "-m", "agent.metrics", "--listen", f"127.0.0.1:{port}"]
    proc = subprocess.Popen([*argv, "--idle-timeout", "60"], env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                scrape(port)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_counters_never_go_back_across_idle_releases_and_restarts(
    serve: Any, tmp_path: Path
) -> None:
    port = free_port()
    text = manifest(port, idle=1)
    state = tmp_path / "state"  # the serve fixture's: shared by both agents below
    seen: list[Samples] = []

    first: Served = serve(("m", text))
    with metrics_service(first, state, tmp_path / "m0") as mport:
        seen.append(scrape(mport))
        assert seen[-1][SERVED] == 0 and seen[-1][READY] == 0
        assert first.count("Starting worker") == 0, "a scrape must not start a worker"
        for _ in range(3):
            assert request(port, "/")[0] == 200
        seen.append(scrape(mport))
        assert seen[-1][SERVED] == 3 and seen[-1][STARTS] == 1 and seen[-1][READY] == 1
        first.wait_log("Worker stopped", timeout=15)  # the idle release, after 1 s
        seen.append(scrape(mport))
        assert seen[-1][SERVED] == 3 and seen[-1][IDLE] == 1 and seen[-1][READY] == 0
        first.proc.terminate()  # the agent exits: its front saves the counters
        first.proc.wait(20)
        seen.append(scrape(mport))  # nothing runs now: the saved counters answer
        assert seen[-1][SERVED] == 3 and seen[-1][READY] == 0

    second: Served = serve(("m", text))  # a new front carries on where the last one stopped
    with metrics_service(second, state, tmp_path / "m1") as mport:
        assert request(port, "/")[0] == 200
        seen.append(scrape(mport))
        assert seen[-1][SERVED] == 4 and seen[-1][STARTS] == 2

    for a, b in itertools.pairwise(seen):
        for key in (SERVED, STARTS, IDLE):
            assert b[key] >= a[key], (key, a[key], b[key])


def test_the_routers_requests_by_model_and_status(
    serve: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rport = free_port()
    settings = tmp_path / "providerd.toml"
    settings.write_text(f'[router]\nenabled = true\naddress = "127.0.0.1:{rport}"\n')
    monkeypatch.setenv("PROVIDERD_CONFIG", str(settings))
    text = manifest(free_port()) + '[models]\nnames = ["m-1"]\npatterns = ["m-.*"]\n'
    served: Served = serve(("m", text))
    served.wait_log("Routing requests by model on 127.0.0.1:")

    def post(model: str) -> int:
        req = urllib.request.Request(
            f"http://127.0.0.1:{rport}/v1/embeddings",
            data=json.dumps({"model": model}).encode(),
            headers={"Content-Type": "application/json"},  # the router refuses form bodies
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)

    assert [post("m-1"), post("m-1"), post("m-by-pattern"), post("nobody")] == [200, 200, 200, 404]
    served.proc.terminate()  # the router saves its counters as it exits
    served.proc.wait(20)
    with metrics_service(served, tmp_path / "state", tmp_path / "m0") as mport:
        got = scrape(mport)
    name = "providerd_router_requests_total"
    assert got[(name, (("code", "200"), ("model", "m-1"), ("provider", "m")))] == 2
    assert got[(name, (("code", "200"), ("model", ""), ("provider", "m")))] == 1  # a pattern
    assert got[(name, (("code", "404"), ("model", ""), ("provider", "")))] == 1  # never its name
