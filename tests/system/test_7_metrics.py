"""The metrics service under systemd 252: socket-activated by a scrape, never waking a
model, exiting when not scraped; scraped with prometheus_client's own parser across an
idle release of the provider (its front exits), and counters never go back."""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import FIGURES, Provider, probe_manifest
from .nspawn import Container

PORT = 18075
SLUG = "scraped"
METRICS = 9470
IDLE_S = 2
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return (name, tuple(sorted({"provider": SLUG, **labels}.items())))


SERVED = key("providerd_requests_served_total")
STARTS = key("providerd_cold_starts_total")
RELEASES = key("providerd_idle_releases_total")
READY = key("providerd_provider_state", state="ready")
INACTIVE = key("providerd_provider_state", state="inactive")


def scrape(ct: Container) -> Samples:
    text = ct.sh(f"curl -sSf --max-time 30 http://127.0.0.1:{METRICS}/metrics").out
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def metrics(ct: Container) -> Iterator[None]:
    ct.write(
        "/etc/systemd/system/providerd-metrics.service.d/test.conf",
        "[Service]\nExecStart=\nExecStart=/usr/bin/python3 -m agent.metrics --idle-timeout 3\n",
    )
    ct.sh("systemctl daemon-reload && systemctl enable --now providerd-metrics.socket")
    yield
    ct.sh(
        "systemctl disable --now providerd-metrics.socket; systemctl stop providerd-metrics.service;"
        " rm -rf /etc/systemd/system/providerd-metrics.service.d; systemctl daemon-reload",
        check=False,
    )


def test_scrapes_across_an_idle_release(ct: Container, provider: Provider, metrics: None) -> None:
    provider.add(SLUG, probe_manifest(PORT, idle=IDLE_S))
    assert ct.active("providerd-metrics.service") == "inactive"  # nothing runs until scraped
    seen = [scrape(ct)]
    assert ct.active("providerd-metrics.service") == "active"
    assert seen[-1][INACTIVE] == 1 and seen[-1][SERVED] == 0
    assert ct.active(f"provider@{SLUG}.service") == "inactive", "a scrape woke the provider"

    for _ in range(3):
        ct.sh(f"curl -sf http://127.0.0.1:{PORT}/ >/dev/null")
    seen.append(scrape(ct))  # the front runs: it answers for itself
    assert seen[-1][READY] == 1 and seen[-1][SERVED] == 3 and seen[-1][STARTS] == 1

    ct.wait_for(f"! systemctl is-active -q provider@{SLUG}.service", timeout=30)  # idle exit
    seen.append(scrape(ct))  # no front: its saved counters answer
    assert seen[-1][INACTIVE] == 1 and seen[-1][SERVED] == 3 and seen[-1][RELEASES] == 1
    assert ct.active(f"provider@{SLUG}.service") == "inactive"

    ct.sh(f"curl -sf http://127.0.0.1:{PORT}/ >/dev/null")  # a new front, from the saved counters
    seen.append(scrape(ct))
    assert seen[-1][SERVED] == 4 and seen[-1][STARTS] == 2
    for a, b in itertools.pairwise(seen):
        for k in (SERVED, STARTS, RELEASES):
            assert b[k] >= a[k], (k, a[k], b[k])

    # Not scraped for its idle timeout: the service exits; the socket stays.
    t0 = time.monotonic()
    ct.wait_for("! systemctl is-active -q providerd-metrics.service", timeout=30)
    print(f"metrics: the service exited {time.monotonic() - t0:.1f} s after the last scrape")
    assert ct.active("providerd-metrics.socket") == "active"
    assert ct.sh("systemctl show -P Result providerd-metrics.service").out.strip() == "success"


def test_the_metrics_service_is_sandboxed(ct: Container) -> None:
    r = ct.sh("systemd-analyze security --no-pager providerd-metrics.service", check=False)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", r.out)
    assert m, str(r)
    FIGURES.append(f"systemd-analyze security providerd-metrics.service: {m.group(1)} {m.group(2)}")
    assert float(m.group(1)) <= 2.5, r.out
    verify = ct.sh(
        "systemd-analyze verify --man=no providerd-metrics.socket providerd-metrics.service"
    )
    assert not verify.out.strip() and not verify.err.strip(), str(verify)
