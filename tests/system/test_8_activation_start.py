"""The worker that systemd starts on the front's own activation (a CPU provider), under a
real systemd: it starts beside the front, and a broken model is not started again by the
next activation while the front's backoff runs."""

from __future__ import annotations

import re
import time

from .conftest import Provider, probe_manifest
from .nspawn import Container


def model_starts(ct: Container, slug: str, since: str) -> int:
    log = ct.journal(f"-u provider-worker@{slug}.service", since=since)
    return log.count("probe worker: started (pid ")


def get(ct: Container, port: int) -> tuple[int, str]:
    r = ct.sh(f"curl -s -o /dev/stderr -w '%{{http_code}}' http://127.0.0.1:{port}/", check=False)
    return int(r.out or 0), r.err


def test_the_worker_starts_with_the_front_not_after_it(ct: Container, provider: Provider) -> None:
    port = 18060
    provider.add("beside", probe_manifest(port, idle=300))
    ct.sh("systemctl start provider@beside.socket")
    since = ct.cursor()
    assert get(ct, port)[0] == 200
    lines = ct.journal(
        "-o short-monotonic -u provider@beside.service -u provider-worker@beside.service",
        since=since,
    ).splitlines()

    def first(pattern: str) -> float:
        for line in lines:
            if re.search(pattern, line):
                return float(line.split("]")[0].strip("[ "))
        raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(lines))

    front_started = first(r"Started provider@beside\.service")
    model_started = first(r"probe worker: started \(pid ")
    # systemd ran the worker's start job with the front's: the model started before the
    # front was even ready, instead of after the front's own start (~100-200 ms).
    assert model_started < front_started, "\n".join(lines)
    assert model_starts(ct, "beside", since) == 1


def test_a_broken_model_waits_out_the_backoff_across_activations(
    ct: Container, provider: Provider
) -> None:
    port, slug = 18061, "broken"
    provider.add(slug, probe_manifest(port, "--exit", "3", idle=300))
    ct.sh(f"systemctl start provider@{slug}.socket")
    since = ct.cursor()
    code, body = get(ct, port)
    assert code == 503 and "status 3" in body, body
    assert model_starts(ct, slug, since) == 1
    assert ct.sh(f"test -s /run/providerd/{slug}.backoff", check=False).rc == 0
    # A fresh front (the old one released at once) inside the 1 s backoff: refused with
    # the same cause, and the activation did not start the model.
    ct.sh(f"providerctl stop {slug}", timeout=60)
    ct.wait_for(f"! systemctl is-active -q provider@{slug}.service", timeout=30)
    code, body = get(ct, port)
    assert code == 503 and "status 3" in body, body
    assert model_starts(ct, slug, since) == 1, ct.journal(
        f"-u provider@{slug}.service -u provider-worker@{slug}.service", since=since
    )
    skipped = ct.journal(f"-u provider-worker@{slug}.service", since=since)
    assert "ConditionPathExists=!/run/providerd/broken.backoff" in skipped, skipped
    # Once it runs out, one request starts the model once more, and the backoff grows.
    time.sleep(1.2)
    code, body = get(ct, port)
    assert code == 503 and "status 3" in body, body
    assert model_starts(ct, slug, since) == 2
    front = ct.journal(f"-u provider@{slug}.service", since=since)
    assert "refusing requests for 2 s" in front, front


def test_a_model_program_that_does_not_exist_is_named_in_the_answer(
    ct: Container, provider: Provider
) -> None:
    port, slug = 18062, "noprogram"
    text = probe_manifest(port, idle=300).replace("/usr/bin/python3", "/usr/bin/no-such-model")
    assert "/usr/bin/no-such-model" in text
    provider.add(slug, text)
    ct.sh(f"systemctl start provider@{slug}.socket")
    code, body = get(ct, port)
    assert code == 503 and "203/EXEC" in body and "does the program exist" in body, body


def test_a_notify_model_says_ready_to_systemd_itself(ct: Container, provider: Provider) -> None:
    """ready = "notify": the model is the worker unit's main process and its own READY=1
    ends the start job; nothing probes it."""
    port, slug = 18063, "notifies"
    text = probe_manifest(port, "--notify", idle=300).replace('ready = "tcp"', 'ready = "notify"')
    provider.add(slug, text)
    ct.sh(f"systemctl start provider@{slug}.socket")
    code, body = get(ct, port)
    assert code == 200, body
    unit = f"provider-worker@{slug}.service"
    assert ct.prop(unit, "Type") == "notify"
    assert ct.prop(unit, "StatusText") == "probe worker ready"
    assert ct.prop(unit, "ExecMainPID") == ct.prop(unit, "MainPID")
    assert "probe_worker.py" in ct.sh(f"cat /proc/{ct.prop(unit, 'MainPID')}/cmdline").out


def test_systemctl_stop_of_the_front_stops_both_at_once(ct: Container, provider: Provider) -> None:
    """The front is ordered after a worker it was activated with: PID 1 stops the worker
    after the front, so the front must not wait for that stop (it would until its stop
    timeout, 60 s and more)."""
    port, slug = 18064, "stopped"
    provider.add(slug, probe_manifest(port, idle=300))
    ct.sh(f"systemctl start provider@{slug}.socket")
    assert get(ct, port)[0] == 200
    assert ct.prop(f"provider@{slug}.service", "After").count(f"provider-worker@{slug}.service")
    t0 = time.monotonic()
    ct.sh(f"systemctl stop provider@{slug}.service", timeout=60)
    took = time.monotonic() - t0
    assert ct.active(f"provider-worker@{slug}.service") in ("inactive", "failed")
    assert took < 15, took
    assert get(ct, port)[0] == 200  # the socket activates both again
