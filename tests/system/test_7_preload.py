"""Preload at boot and pinning under a real systemd 252.

`[runtime] preload = true` makes the generator link the front into
`multi-user.target.wants/`; the front `Requires=` and is `After=` its socket, so
starting multi-user.target (what the boot does) binds the socket first and then
loads the model with no request. A second boot is not needed to see it: the
ordering is read from systemd, and `systemctl start multi-user.target` runs the same
transaction the boot runs for these units.
"""

from __future__ import annotations

import json
import time

from .conftest import Provider, probe_manifest
from .nspawn import Container

PORT = 18070
SLUG = "preloaded"
PINNED_PORT = 18071
PINNED = "kept"


def test_preload_loads_at_multi_user_target_after_the_socket_and_status_shows_it(
    ct: Container, provider: Provider
) -> None:
    provider.add(SLUG, probe_manifest(PORT, idle=3, extra="preload = true"))
    wants = ct.prop("multi-user.target", "Wants").split()
    assert f"provider@{SLUG}.service" in wants
    link = ct.sh(f"readlink /run/systemd/generator/multi-user.target.wants/provider@{SLUG}.service")
    assert link.out.strip() == "/lib/systemd/system/provider@.service"
    assert f"provider@{SLUG}.socket" in ct.prop(f"provider@{SLUG}.service", "After").split()
    assert f"provider@{SLUG}.socket" in ct.prop(f"provider@{SLUG}.service", "Requires").split()
    assert ct.active(f"provider-worker@{SLUG}.service") == "inactive"  # reload loads nothing

    since = ct.cursor()
    ct.sh("rm -f /run/providerd/preloaded.preloaded")  # as /run is at boot
    t0 = time.monotonic()
    ct.sh("systemctl start multi-user.target")
    ct.wait_for(f"systemctl is-active -q provider-worker@{SLUG}.service", timeout=30)
    loaded_s = time.monotonic() - t0
    assert ct.listening(PORT)
    pid1 = ct.journal("_PID=1", since=since)
    socket_at = pid1.find(f"Listening on provider@{SLUG}.socket")
    front_at = pid1.find(f"Started provider@{SLUG}.service")
    assert front_at >= 0, pid1
    assert socket_at == -1 or socket_at < front_at  # already listening, or before the front
    front_log = ct.journal(f"-u provider@{SLUG}.service", since=since)
    assert "Starting worker (preload)" in front_log, front_log

    doc = json.loads(ct.sh(f"providerctl status --json {SLUG}").out)
    (st,) = doc["providers"]
    assert st["state"] == "ready" and st["served"] == 0
    assert st["preloaded"]["result"] == "ready"
    text = ct.sh(f"providerctl status {SLUG}").out
    assert "Preloaded: at boot" in text, text
    print(f"preload: worker active {loaded_s:.2f} s after systemctl start multi-user.target")

    # Not pinned: released when idle like any provider; the record stays until the next boot.
    ct.wait_for(f"! systemctl is-active -q provider@{SLUG}.service", timeout=30)
    assert ct.active(f"provider-worker@{SLUG}.service") == "inactive"
    r = ct.sh(f"providerctl status --json {SLUG}", check=False)
    assert r.rc == 3
    (st,) = json.loads(r.out)["providers"]
    assert st["state"] == "inactive" and st["preloaded"] == doc["providers"][0]["preloaded"]
    # A later activation is an activation, not a second preload.
    since = ct.cursor()
    ct.sh(f"curl -sf http://127.0.0.1:{PORT}/ >/dev/null")
    front_log = ct.journal(f"-u provider@{SLUG}.service", since=since)
    assert "Starting worker on activation" in front_log, front_log
    (st,) = json.loads(ct.sh(f"providerctl status --json {SLUG}").out)["providers"]
    assert st["preloaded"] == doc["providers"][0]["preloaded"]


def test_a_disabled_provider_cannot_preload(ct: Container, provider: Provider) -> None:
    provider.add(
        "nopre", probe_manifest(18072, extra="preload = true").replace(
            'description = "probe worker for the container tier"',
            'description = "probe worker for the container tier"\nenabled = false',
        ), reload=False,
    )  # fmt: skip
    r = ct.sh("providerctl check /etc/providerd/providers/nopre.toml", check=False)
    assert r.rc == 1
    assert "runtime.preload: is true but enabled = false" in r.out + r.err


def test_a_pinned_provider_outlives_its_idle_timeout(ct: Container, provider: Provider) -> None:
    provider.add(PINNED, probe_manifest(PINNED_PORT, idle=2, extra="pinned = true"))
    ct.sh(f"systemctl start provider@{PINNED}.socket")
    ct.sh(f"curl -sf http://127.0.0.1:{PINNED_PORT}/ >/dev/null")
    time.sleep(5)  # past two idle timeouts
    assert ct.active(f"provider-worker@{PINNED}.service") == "active"
    text = ct.sh(f"providerctl status {PINNED}").out
    assert "Pinned: never released when idle" in text, text
    ct.sh(f"providerctl stop {PINNED}")  # still released on request
    ct.wait_for(f"! systemctl is-active -q provider-worker@{PINNED}.service", timeout=30)
