"""A worker whose start its front decides (here `network = "host"` with no fixed port: a
port chosen per start; a GPU provider takes the same path), under a real systemd: the front
asks for the start before its own start is done, then follows that job (one start, the
model's readiness, its failure and the backoff after it) as it follows any start."""

from __future__ import annotations

import re

from .conftest import Provider, probe_manifest
from .nspawn import Container
from .test_8_activation_start import get, model_starts

HOST = '[isolation]\nnetwork = "host"\n'


def monotonic(lines: list[str], pattern: str) -> float:
    for line in lines:
        if re.search(pattern, line):
            return float(line.split("]")[0].strip("[ "))
    raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(lines))


def test_the_front_asks_for_the_start_first_and_follows_its_job(
    ct: Container, provider: Provider
) -> None:
    port, slug = 18062, "decided"
    provider.add(slug, probe_manifest(port, "--host", "{host}", extra=HOST, idle=300))
    ct.sh(f"systemctl start provider@{slug}.socket")
    since = ct.cursor()
    code, body = get(ct, port)
    assert code == 200, body
    lines = ct.journal(
        f"-o short-monotonic -u provider@{slug}.service -u provider-worker@{slug}.service",
        since=since,
    ).splitlines()
    text = "\n".join(lines)
    assert "Asked for the worker's start first" in text, text
    # StartUnit went out before the front was ready: before this, the front's whole start
    # (asyncio, dbus-next, the bus, its listeners) came first.
    asked = monotonic(lines, rf"Starting provider-worker@{slug}\.service")
    front_ready = monotonic(lines, rf"Started provider@{slug}\.service")
    assert asked < front_ready, text
    # One start, followed to its end: the front saw the model ready and serves it.
    assert model_starts(ct, slug, since) == 1, text
    assert re.search(r"Worker ready after", text), text
    env = ct.sh(f"cat /run/providerd/{slug}/worker.env").out
    assert re.search(r'PROVIDERD_WORKER_PORT="\d+"', env) and "PROVIDERD_WORKER_HOST=" in env
    # The next activation asks again, for a start on a new port of its own.
    ct.sh(f"providerctl stop {slug}", timeout=60)
    ct.wait_for(f"! systemctl is-active -q provider@{slug}.service", timeout=30)
    assert get(ct, port)[0] == 200
    assert model_starts(ct, slug, since) == 2
    fronts = ct.journal(f"-u provider@{slug}.service", since=since)
    assert fronts.count("Asked for the worker's start first") == 2, fronts


def test_a_failed_early_start_is_reported_and_backed_off(ct: Container, provider: Provider) -> None:
    port, slug = 18063, "decidedbad"
    provider.add(
        slug, probe_manifest(port, "--host", "{host}", "--exit", "3", extra=HOST, idle=300)
    )
    ct.sh(f"systemctl start provider@{slug}.socket")
    since = ct.cursor()
    code, body = get(ct, port)
    assert code == 503 and "status 3" in body, body
    front = ct.journal(f"-u provider@{slug}.service", since=since)
    assert "Asked for the worker's start first" in front, front
    assert "Failed to start worker: worker failed to start with status 3" in front, front
    assert model_starts(ct, slug, since) == 1
    assert ct.sh(f"test -s /run/providerd/{slug}.backoff", check=False).rc == 0
    # A fresh front inside the backoff asks for no start at all: refused with the cause.
    ct.sh(f"providerctl stop {slug}", timeout=60)
    ct.wait_for(f"! systemctl is-active -q provider@{slug}.service", timeout=30)
    code, body = get(ct, port)
    assert code == 503 and "status 3" in body, body
    assert model_starts(ct, slug, since) == 1
    front = ct.journal(f"-u provider@{slug}.service", since=since)
    assert front.count("Asked for the worker's start first") == 1, front
