"""The front under a real systemd: the idle-exit race, warm and stop as an operator uses them."""

from __future__ import annotations

import json

from .conftest import Provider, probe_manifest
from .nspawn import Container

# Requests sent around the moment the front exits on idle, many times over: each one
# must be answered, by the exiting front or by the next activation.
RACE = r"""
import json, random, sys, time, urllib.request
url, idle, rounds = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
results = []
for i in range(rounds):
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            results.append(r.status)
    except urllib.error.HTTPError as e:
        results.append(f"{e.code} {e.read().decode(errors='replace')}")
    except Exception as e:
        results.append(repr(e))
    # Sleep until just before, at, or just after the idle deadline.
    time.sleep(idle + random.uniform(-0.05, 0.15))
print(json.dumps(results))
"""


def test_connections_at_the_moment_of_idle_exit_are_all_answered(
    ct: Container, provider: Provider
) -> None:
    port, idle = 18050, 1
    provider.add("racy", probe_manifest(port, idle=idle))
    since = ct.cursor()
    ct.write("/root/race.py", RACE)
    out = ct.sh(f"python3 /root/race.py http://127.0.0.1:{port}/ {idle} 30", timeout=600).out
    results = json.loads(out)
    log = ct.journal("-u provider@racy.service -u provider-worker@racy.service", since=since)
    assert results == [200] * 30, f"{results}\n{log}"
    exits = log.count("releasing the worker")
    assert exits >= 10, f"only {exits} idle exits: the race was not exercised"
    assert ct.sh("systemctl is-failed -q provider@racy.socket", check=False).rc != 0


def test_warm_loads_without_a_request_and_stop_releases(ct: Container, provider: Provider) -> None:
    port = 18051
    provider.add("warmed", probe_manifest(port, idle=300))
    ct.sh("providerctl warm warmed", timeout=120)
    assert ct.active("provider-worker@warmed.service") == "active"
    status = json.loads(ct.sh("providerctl status --json warmed").out)
    (p,) = status["providers"]
    assert p["state"] == "ready" and p["served"] == 0, p
    ct.sh("providerctl stop warmed", timeout=120)
    ct.wait_for("! systemctl is-active -q provider-worker@warmed.service", timeout=30)
    ct.wait_for("! systemctl is-active -q provider@warmed.service", timeout=30)
    assert ct.listening(port)
    # The next request activates it again.
    assert ct.sh(f"curl -sf http://127.0.0.1:{port}/ -o /dev/null", check=False).rc == 0


def test_status_of_an_idle_provider_says_inactive(ct: Container, provider: Provider) -> None:
    provider.add("sleepy", probe_manifest(18052))
    r = ct.sh("providerctl status sleepy", check=False)
    assert r.rc == 3, r  # systemctl's "inactive"
    assert "inactive" in r.out and "socket active" in r.out, r.out
