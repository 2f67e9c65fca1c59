"""The demo provider under a real systemd: cold burst, status, journal, idle release, kill -9.

The tests of this module follow one provider through its life, in order.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import pytest

from .conftest import demo_manifest
from .nspawn import Container

PORT = 18008
IDLE_S = 5
SLUG = "demo"
# Any process of this provider's worker: the wrapper or the model it runs.
LEFTOVERS = f"pgrep -f 'agent[.]worker --slug {SLUG} |agent[.]demo '"

BURST = r"""
import json, sys, threading, urllib.request
n, url = int(sys.argv[1]), sys.argv[2]
codes = [None] * n
go = threading.Barrier(n)
def one(i):
    go.wait()
    req = urllib.request.Request(url, data=b'{"input": "hello"}', headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            codes[i] = r.status
    except urllib.error.HTTPError as e:
        codes[i] = e.code
    except Exception as e:
        codes[i] = repr(e)
threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(codes))
"""


def burst(ct: Container, n: int, path: str = "/v1/embeddings") -> list[object]:
    ct.write("/root/burst.py", BURST)
    out = ct.sh(f"python3 /root/burst.py {n} http://127.0.0.1:{PORT}{path}", timeout=180).out
    return list(json.loads(out))


def worker_starts(ct: Container, since: str) -> int:
    return sum(
        1
        for line in ct.journal("_PID=1", since=since).splitlines()
        if line.startswith(f"Started provider-worker@{SLUG}.service")
    )


@pytest.fixture(scope="module")
def demo(ct: Container) -> Iterator[None]:
    manifest = demo_manifest(PORT, IDLE_S).replace("enabled = true", "enabled = false")
    ct.write(f"/etc/providerd/providers/{SLUG}.toml", manifest)
    ct.sh("providerctl reload")
    yield
    ct.sh(f"rm -f /etc/providerd/providers/{SLUG}.toml && providerctl reload", check=False)
    ct.sh(f"systemctl stop provider@{SLUG}.socket", check=False)


def test_socket_starts_and_listens_with_no_process(ct: Container, demo: None) -> None:
    ct.sh(f"systemctl start provider@{SLUG}.socket")
    assert ct.active(f"provider@{SLUG}.socket") == "active"
    assert ct.listening(PORT)
    assert ct.active(f"provider@{SLUG}.service") == "inactive"
    assert ct.active(f"provider-worker@{SLUG}.service") == "inactive"


def test_fifty_cold_requests_one_worker_start_all_answered(ct: Container, demo: None) -> None:
    since = ct.cursor()
    codes = burst(ct, 50)
    assert codes == [200] * 50, f"not every request was answered 200: {codes}"
    assert worker_starts(ct, since) == 1, ct.journal(
        f"-u provider-worker@{SLUG}.service", since=since
    )


def test_the_front_serves_on_uvloop(ct: Container, demo: None) -> None:
    # Still up after the burst: the installed front's loop is the one the package depends on.
    pid = ct.prop(f"provider@{SLUG}.service", "MainPID")
    assert pid not in ("", "0"), "the front is not running"
    r = ct.sh(f"grep -c /uvloop/loop /proc/{pid}/maps", check=False)
    assert r.rc == 0, f"uvloop is not loaded in the front (pid {pid})"


def test_systemctl_status_has_a_status_line(ct: Container, demo: None) -> None:
    # The worker is still up (idle timeout not reached): the front says what it does.
    r = ct.sh(f"systemctl status --no-pager provider@{SLUG}.service", check=False)
    status = [line.strip() for line in r.out.splitlines() if line.strip().startswith("Status:")]
    assert status, r.out
    print(status[0])


def test_providerctl_status_while_serving(ct: Container, demo: None) -> None:
    r = ct.sh(f"providerctl status {SLUG}", check=False)
    assert r.rc == 0, str(r)
    assert SLUG in r.out
    j = ct.sh(f"providerctl status {SLUG} --json", check=False)
    assert j.rc == 0, str(j)
    json.loads(j.out)


def test_idle_releases_front_and_worker_socket_stays(ct: Container, demo: None) -> None:
    ct.wait_for(
        f"! systemctl is-active -q provider@{SLUG}.service && ! systemctl is-active -q provider-worker@{SLUG}.service",
        timeout=IDLE_S + 30,
    )
    assert ct.active(f"provider@{SLUG}.socket") == "active"
    assert ct.listening(PORT)
    # A unit is inactive once its main process is gone; the model it passed SIGTERM to may
    # still be exiting for a few milliseconds (seen under load). A leak is a process that stays.
    deadline = time.monotonic() + 5
    while (left := ct.sh(LEFTOVERS, check=False)).rc != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    if left.rc != 1:
        pids = left.out.split()
        detail = ct.sh(
            "ps -o pid,ppid,pgid,etimes,stat,cmd -p "
            + ",".join(pids)
            + "; "
            + "; ".join(f"echo {p}: $(cat /proc/{p}/cgroup | tr '\\n' ' ')" for p in pids)
            + f"; systemctl status --no-pager provider-worker@{SLUG} provider@{SLUG}; "
            + f"journalctl -q --no-pager -n 40 -u provider-worker@{SLUG} -u provider@{SLUG}",
            check=False,
        )
        raise AssertionError(f"a demo process outlived its worker unit:\n{detail.out}{detail.err}")


def test_journal_shows_the_lifecycle(ct: Container, demo: None) -> None:
    front = ct.journal(f"-u provider@{SLUG}.service")
    assert re.search(r"ready after [0-9.]+ ?s", front, re.I), front
    assert re.search(r"idle for [0-9.]+ ?s", front, re.I), front
    assert re.search(r"releas", front, re.I), front


def test_next_request_after_idle_is_served(ct: Container, demo: None) -> None:
    since = ct.cursor()
    assert burst(ct, 1) == [200]
    assert worker_starts(ct, since) == 1


def test_kill9_of_the_front_stops_the_worker_and_leaves_no_process(
    ct: Container, demo: None
) -> None:
    ct.wait_for(f"systemctl is-active -q provider-worker@{SLUG}.service", timeout=30)
    front_pid = ct.prop(f"provider@{SLUG}.service", "MainPID")
    worker_pid = ct.prop(f"provider-worker@{SLUG}.service", "MainPID")
    assert front_pid not in ("", "0") and worker_pid not in ("", "0")
    ct.sh(f"kill -9 {front_pid}")
    ct.wait_for(f"! systemctl is-active -q provider-worker@{SLUG}.service", timeout=30)
    deadline = time.monotonic() + 15
    while ct.sh(f"kill -0 {worker_pid} 2>/dev/null || {LEFTOVERS}", check=False).rc == 0:
        assert time.monotonic() < deadline, ct.sh("ps -ef", check=False).out
        time.sleep(0.2)
    # The port still belongs to PID 1, and the next request is served again.
    assert ct.listening(PORT)
    ct.sh(f"systemctl reset-failed provider@{SLUG}.service", check=False)
    assert burst(ct, 1) == [200]
