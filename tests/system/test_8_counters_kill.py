"""Counters survive `kill -9` under systemd 252: the front and the router count into
files under /run/providerd mapped into memory; after SIGKILL (and the restart systemd
makes), the metrics service reports at least what it scraped before."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .conftest import Provider, demo_manifest
from .nspawn import Container
from .test_7_metrics import Samples, scrape

PORT = 18093
SLUG = "killed"
ROUTER = 8100
SERVED = ("providerd_requests_served_total", (("provider", SLUG),))
ROUTED = (
    "providerd_router_requests_total",
    (("code", "200"), ("model", "k-1"), ("provider", SLUG)),
)


@pytest.fixture
def metrics(ct: Container) -> Iterator[None]:
    ct.sh("systemctl start providerd-metrics.socket providerd-router.socket")
    yield
    ct.sh(
        "systemctl stop providerd-metrics.socket providerd-metrics.service"
        " providerd-router.socket providerd-router.service;"
        " systemctl reset-failed 'providerd-*'",
        check=False,
    )


def embed(ct: Container, port: int) -> None:
    body = '{"model": "k-1", "input": "x"}'
    ct.sh(
        f"curl -sSf --max-time 60 -H 'Content-Type: application/json' -d '{body}' "
        f"http://127.0.0.1:{port}/v1/embeddings >/dev/null"
    )


def test_counters_survive_kill_9(ct: Container, provider: Provider, metrics: None) -> None:
    provider.add(SLUG, demo_manifest(PORT, idle=60) + '\n[models]\nnames = ["k-1"]\n')
    ct.sh("systemctl try-restart providerd-router.service", check=False)  # re-reads manifests
    for _ in range(3):
        embed(ct, PORT)
    for _ in range(2):
        embed(ct, ROUTER)
    before: Samples = scrape(ct)
    assert before[SERVED] >= 5 and before[ROUTED] >= 2, (before[SERVED], before.get(ROUTED))

    ct.sh(f"systemctl kill -s KILL provider@{SLUG}.service providerd-router.service")
    ct.wait_for(f"! systemctl is-active -q provider@{SLUG}.service", timeout=30)
    after = scrape(ct)
    for k in (SERVED, ROUTED):
        assert after[k] >= before[k], (k, before[k], after[k])

    embed(ct, PORT)  # a new front carries on from there
    again = scrape(ct)
    assert again[SERVED] == after[SERVED] + 1
