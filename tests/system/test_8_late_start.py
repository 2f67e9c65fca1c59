"""A start the front asked PID 1 for never undoes a stop, under a real systemd 252.

PID 1 takes a StartUnit from the front (user providerd) only once polkit allows it. A
polkit rule installed here holds that check for DELAY_S, so a stop lands inside it every
time: the operator's stop must win, the units staying inactive after the start's answer.
And the start systemd made beside the front, still under way when the front asks, is
followed by its job's real JobType (read on PID 1, not on the unit tier's fake).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest

from .conftest import Provider, probe_manifest
from .nspawn import Container

KEY = "pd-late-start-0123456789"
DELAY_S = 3.0
RULE = "/etc/polkit-1/rules.d/10-providerd-late-start.rules"


def delay_rule(slug: str) -> str:
    """Every start of the slug's worker the front asks for is decided as the package's own
    rule decides it (the caller's provider, from its cgroup), and answered DELAY_S later;
    every other check falls through to the package's rule."""
    return f"""polkit.addRule(function (action, subject) {{
    if (subject.user != "providerd" || action.id != "org.freedesktop.systemd1.manage-units"
        || action.lookup("unit") != "provider-worker@{slug}.service"
        || action.lookup("verb") != "start") {{
        return polkit.Result.NOT_HANDLED;
    }}
    var caller = "";
    try {{
        caller = polkit.spawn(["/usr/libexec/providerd/providerd-polkit-slug", String(subject.pid)]);
    }} catch (error) {{
        return polkit.Result.NO;
    }}
    var end = Date.now() + {int(DELAY_S * 1000)};
    while (Date.now() < end) {{}}
    return caller.trim() == "{slug}" ? polkit.Result.YES : polkit.Result.NO;
}});
"""


@pytest.fixture
def keys(ct: Container) -> Iterator[None]:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    ct.write("/etc/providerd/keys.toml", f'[keys.ci]\nsha256 = "{digest}"\n', mode=0o600)
    yield
    ct.sh("rm -f /etc/providerd/keys.toml", check=False)


def hold_starts(ct: Container, slug: str) -> None:
    ct.sh(f"cat > {RULE} && chmod 0644 {RULE} && systemctl restart polkit", input=delay_rule(slug))


@pytest.fixture
def polkit_rule(ct: Container) -> Iterator[None]:
    yield
    ct.sh(f"rm -f {RULE} && systemctl restart polkit", check=False)


def request_in_background(ct: Container, port: int, name: str) -> None:
    ct.sh(
        f"systemd-run --collect --unit={name} -p StandardOutput=file:/tmp/{name}.out "
        f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 60 "
        f"-H 'Authorization: Bearer {KEY}' http://127.0.0.1:{port}/"
    )


def asked_for_start(ct: Container, slug: str, since: str) -> float:
    """Wait for the front's own StartUnit to go out; the monotonic time it did."""
    ct.wait_for(
        f"journalctl -q -o cat -u provider@{slug}.service --after-cursor='{since}'"
        " | grep -q 'Starting worker on request'",
        timeout=30,
        interval=0.05,
    )
    return time.monotonic()


def assert_stays_inactive(ct: Container, slug: str, since: str, until: float) -> None:
    units = f"provider@{slug}.service provider-worker@{slug}.service"
    while True:
        states = ct.sh(f"systemctl is-active {units}", check=False).out.split()
        if states != ["inactive", "inactive"]:
            log = ct.journal("-o short-monotonic", since=since)
            raise AssertionError(f"after the stop: {states}\n{log}")
        if time.monotonic() > until:
            return
        time.sleep(0.3)


@pytest.mark.parametrize("how", ["systemctl", "providerctl"])
def test_a_stop_inside_the_fronts_start_stays_a_stop(
    ct: Container, provider: Provider, keys: None, polkit_rule: None, how: str
) -> None:
    """The API-keys provider's first permitted request makes the front send StartUnit (its
    worker was skipped by its condition); the stop comes while polkit holds that start."""
    port, slug = 18096 if how == "systemctl" else 18097, f"late{how[:4]}"
    # stop_timeout_s = 1: the front's stop does not wait out the held start for the request.
    provider.add(slug, probe_manifest(port, idle=300, extra="stop_timeout_s = 1"))
    hold_starts(ct, slug)
    ct.sh(f"systemctl start provider@{slug}.socket")
    since = ct.cursor()
    request_in_background(ct, port, f"late-{slug}")
    asked = asked_for_start(ct, slug, since)
    assert time.monotonic() - asked < DELAY_S - 1.5, "too late to stop inside polkit's hold"
    if how == "systemctl":
        ct.sh(f"timeout 60 systemctl stop provider@{slug}.service")
    else:
        ct.sh(f"timeout 60 providerctl stop {slug} --grace 1")
    # The start's answer comes DELAY_S after it was asked for; a start it made would show
    # within a few seconds after.
    ct.wait_for(f"systemctl is-active -q provider@{slug}.service; test $? -ne 0", timeout=30)
    assert_stays_inactive(ct, slug, since, until=asked + DELAY_S + 4.0)
    out = ct.sh(f"cat /tmp/late-{slug}.out", check=False).out
    # Cut after the grace period (the connection closed, curl's 000), never served.
    assert out in ("000", "503"), out
    assert ct.sh(f"test -e /run/providerd/{slug}.backoff", check=False).rc != 0
    front_log = ct.journal(f"-u provider@{slug}.service", since=since)
    assert "Traceback" not in front_log, front_log


def test_a_start_under_way_beside_the_front_is_followed_by_its_job_type(
    ct: Container, provider: Provider
) -> None:
    """The worker's start job, made by PID 1 on the front's activation, still runs (a slow
    ExecStartPre=) when the front asks: the front reads the job's JobType over D-Bus,
    finds "start" and follows it, and the request is served by that one start."""
    port, slug = 18098, "slowpre"
    manifest = probe_manifest(port, "--notify", idle=300).replace(
        'ready = "tcp"', 'ready = "notify"'
    )
    provider.add(slug, manifest, reload=False)
    ct.write(
        f"/etc/systemd/system/provider-worker@{slug}.service.d/50-slow.conf",
        "[Service]\nExecStartPre=/bin/sleep 2\n",
    )
    try:
        ct.sh("providerctl reload")
        ct.sh(f"systemctl start provider@{slug}.socket")
        since = ct.cursor()
        r = ct.sh(
            f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 60 http://127.0.0.1:{port}/"
        )
        log = ct.journal(
            f"-u provider@{slug}.service -u provider-worker@{slug}.service", since=since
        )
        assert r.out == "200", log
        assert log.count("probe worker: started (pid ") == 1, log
        assert "was stopped while it started" not in log, log
    finally:
        ct.sh(
            f"rm -rf /etc/systemd/system/provider-worker@{slug}.service.d && systemctl daemon-reload",
            check=False,
        )
