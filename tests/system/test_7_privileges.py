"""Least privilege under a real systemd 252, with polkitd 122 and the installed .deb.

The front runs as the package's user providerd: polkit lets it start, stop and set
properties of its own worker and refuses everything else; the router reaches no bus;
secrets reach a worker as systemd credentials that no other provider (and no
`systemctl show`) sees; workers see no other provider's manifest or drop-in.
"""

from __future__ import annotations

import json
import re
import shlex
import urllib.parse
from collections.abc import Iterator

import pytest

from .conftest import FIGURES, Provider, probe_manifest
from .nspawn import Container

A, B = "priva", "privb"
PORT_A, PORT_B = 18071, 18072
ROUTER_PORT = 18170
SECRET_A, SECRET_B = "s3cret-of-a", "s3cret-of-b"
ENV_B = "b-environment-value"
MANAGER = "org.freedesktop.systemd1 /org/freedesktop/systemd1 org.freedesktop.systemd1.Manager"


def manifest(slug: str, port: int, secret_name: str, environment: str = "") -> str:
    return probe_manifest(
        port,
        idle=300,
        environment=environment,
        extra=f'[runtime.credentials]\n{secret_name} = "/etc/providerd/credentials/{slug}"\n',
    )


@pytest.fixture(scope="module")
def two(ct: Container) -> Iterator[None]:
    ct.write(f"/etc/providerd/credentials/{A}", SECRET_A + "\n", mode=0o600)
    ct.write(f"/etc/providerd/credentials/{B}", SECRET_B + "\n", mode=0o600)
    ct.sh("chmod 0700 /etc/providerd/credentials")  # as the package made it
    made = Provider(ct)
    made.add(A, manifest(A, PORT_A, "A_TOKEN"), reload=False)
    made.add(B, manifest(B, PORT_B, "B_TOKEN", environment=f'B_ONLY = "{ENV_B}"'))
    for port in (PORT_A, PORT_B):
        r = ct.sh(f"curl -sS --max-time 60 http://127.0.0.1:{port}/", check=False)
        assert '"argv"' in r.out, f"{r}\n{ct.journal('-u provider@priva -u provider-worker@priva')}"
    yield
    made.cleanup()
    ct.sh(f"rm -f /etc/providerd/credentials/{A} /etc/providerd/credentials/{B}", check=False)


def probe(ct: Container, port: int, what: str, path: str) -> str:
    q = urllib.parse.quote(path, safe="")
    out = ct.sh(f"curl -sS --max-time 20 'http://127.0.0.1:{port}/{what}?path={q}'").out
    return str(json.loads(out)["outcome"])


def report(ct: Container, port: int) -> dict[str, object]:
    doc = json.loads(ct.sh(f"curl -sS --max-time 20 http://127.0.0.1:{port}/").out)
    assert isinstance(doc, dict)
    return doc


def as_front(ct: Container, slug: str, call: str) -> tuple[int, str]:
    """`busctl call <call>` as user providerd, from inside provider@SLUG.service's cgroup
    (what polkit's rule looks at), the way the front itself would ask."""
    pid = ct.prop(f"provider@{slug}.service", "MainPID")
    assert pid not in ("", "0"), f"provider@{slug}.service is not running"
    script = (
        "set -e; mnt=$(awk '$3 == \"cgroup2\" {print $2; exit}' /proc/mounts); "
        f"cg=$(sed -n 's/^0:://p' /proc/{pid}/cgroup); "
        'echo $$ > "$mnt$cg/cgroup.procs"; '
        "exec setpriv --reuid=providerd --regid=providerd --init-groups "
        f"busctl call --timeout=20 {MANAGER} {call}"
    )
    r = ct.sh(f"sh -c {shlex.quote(script)}", check=False)
    return r.rc, (r.out + r.err).strip()


def timed_calls(ct: Container, slug: str, call: str, n: int, as_providerd: bool) -> float:
    """Seconds per `busctl call` over n calls, from provider@SLUG.service's cgroup, as
    providerd (through polkit and its rule) or as root (no polkit)."""
    pid = ct.prop(f"provider@{slug}.service", "MainPID")
    who = "setpriv --reuid=providerd --regid=providerd --init-groups " if as_providerd else ""
    loop = f"for i in $(seq {n}); do {who}busctl call {MANAGER} {call} >/dev/null || exit 1; done"
    script = (
        "set -e; mnt=$(awk '$3 == \"cgroup2\" {print $2; exit}' /proc/mounts); "
        f"cg=$(sed -n 's/^0:://p' /proc/{pid}/cgroup); "
        'echo $$ > "$mnt$cg/cgroup.procs"; '
        f"t0=$(date +%s%N); {loop}; t1=$(date +%s%N); echo $(( (t1 - t0) / {n} ))"
    )
    r = ct.sh(f"sh -c {shlex.quote(script)}")
    return int(r.out.split()[-1]) / 1e9


REFUSED = re.compile(r"Access denied|not authorized|Interactive authentication required|denied")


def test_the_front_runs_as_providerd_with_no_private_bus(ct: Container, two: None) -> None:
    pid = ct.prop(f"provider@{A}.service", "MainPID")
    status = ct.sh(f"grep -E '^(Uid|Gid|CapEff):' /proc/{pid}/status").out
    uid = ct.sh("id -u providerd").out.strip()
    assert re.search(rf"^Uid:\s+{uid}\s+{uid}\s+{uid}\s+{uid}$", status, re.M), status
    assert re.search(r"^CapEff:\s+0+$", status, re.M), status
    # PID 1's private bus is not there for it (root or not, nothing answers).
    r = ct.sh(
        f"nsenter -t {pid} -m python3 -c "
        "\"import socket; s = socket.socket(socket.AF_UNIX); s.connect('/run/systemd/private')\"",
        check=False,
    )
    assert r.rc != 0 and re.search(r"ConnectionRefused|PermissionError|FileNotFound", r.err), r
    # Its runtime directory and the state directory are its own.
    owners = ct.sh(f"stat -c '%U %n' /run/providerd /run/providerd/{A} /var/lib/providerd").out
    assert owners.splitlines() == [
        "providerd /run/providerd",
        f"providerd /run/providerd/{A}",
        "providerd /var/lib/providerd",
    ], owners


def test_polkit_lets_a_front_manage_its_own_worker_and_nothing_else(
    ct: Container, two: None
) -> None:
    worker = f"provider-worker@{A}.service"
    # Its own worker: set a property, start (it runs: a no-op job, still authorised), stop.
    rc, out = as_front(ct, A, f"SetUnitProperties sba\\(sv\\) {worker} true 1 CPUWeight t 50")
    assert rc == 0, out
    assert ct.prop(worker, "CPUWeight") == "50"
    rc, out = as_front(ct, A, f"StartUnit ss {worker} replace")
    assert rc == 0, out
    rc, out = as_front(ct, A, f"StopUnit ss {worker} replace")
    assert rc == 0, out
    ct.wait_for(f"! systemctl is-active -q {worker}", timeout=30)
    # What the rule costs (polkitd runs providerd-polkit-slug for each call).
    call = f"SetUnitProperties sba\\(sv\\) {worker} true 1 CPUWeight t 50"
    polkit_s = timed_calls(ct, A, call, 10, as_providerd=True)
    root_s = timed_calls(ct, A, call, 10, as_providerd=False)
    FIGURES.append(
        f"SetUnitProperties on its own worker: {polkit_s * 1000:.1f} ms as providerd (polkit "
        f"rule + slug helper), {root_s * 1000:.1f} ms as root, per call (10 calls)"
    )
    # Everything else is refused: another provider's worker, any other unit, a transient
    # unit with a command of its choosing, power-off.
    refused = {
        "StartUnit other worker": f"StartUnit ss provider-worker@{B}.service replace",
        "StopUnit other worker": f"StopUnit ss provider-worker@{B}.service replace",
        "SetUnitProperties other worker": (
            f"SetUnitProperties sba\\(sv\\) provider-worker@{B}.service true 1 CPUWeight t 60"
        ),
        "RestartUnit another front": f"RestartUnit ss provider@{B}.service replace",
        "StartUnit a system unit": "StartUnit ss systemd-hostnamed.service replace",
        "StartTransientUnit": (
            "StartTransientUnit ssa\\(sv\\)a\\(sa\\(sv\\)\\) pwned.service fail "
            "1 ExecStart a\\(sasb\\) 1 /bin/touch 2 /bin/touch /root/pwned false 0"
        ),
        "PowerOff": "PowerOff",
    }
    for what, call in refused.items():
        rc, out = as_front(ct, A, call)
        assert rc != 0 and REFUSED.search(out), f"{what} was not refused: rc={rc} {out}"
    assert ct.sh("test -e /root/pwned", check=False).rc != 0
    assert ct.prop(f"provider-worker@{B}.service", "CPUWeight") != "60"
    assert ct.active(f"provider-worker@{B}.service") == "active"
    assert ct.active("systemd-hostnamed.service") != "active"
    # And the front still serves (once its backoff after the stop above has passed).
    ct.wait_for(f"curl -sS --max-time 60 http://127.0.0.1:{PORT_A}/ | grep -q argv", timeout=60)


def test_a_worker_gets_its_credential_and_nothing_of_another_provider(
    ct: Container, two: None
) -> None:
    doc = report(ct, PORT_A)
    env = doc["env"]
    assert isinstance(env, dict)
    assert env.get("A_TOKEN") == SECRET_A, "the wrapper exports the credential to the model"
    assert "B_TOKEN" not in env and "B_ONLY" not in env
    own = f"{env['CREDENTIALS_DIRECTORY']}/A_TOKEN"
    assert probe(ct, PORT_A, "read", own) == f"ok: {SECRET_A}\n"
    # Another provider's credential, manifest, drop-ins and runtime files, as A's worker.
    dropin = f"/run/systemd/generator/provider-worker@{B}.service.d/50-manifest.conf"
    ct.sh(f"grep -qx 'LoadCredential=B_TOKEN:/etc/providerd/credentials/{B}' {dropin}")
    theirs = {
        f"/run/credentials/provider-worker@{B}.service/B_TOKEN": ("EACCES", "ENOENT"),
        f"/etc/providerd/credentials/{B}": ("ENOENT",),
        f"/etc/providerd/providers/{B}.toml": ("ENOENT",),
        # /run is an empty tmpfs in every worker (units/provider-worker@.service)
        f"/run/systemd/generator/provider-worker@{B}.service.d/50-manifest.conf": ("ENOENT",),
        f"/run/providerd/{B}/worker.env": ("ENOENT",),
        # B's model process and its environment (the exported B_TOKEN among it)
        f"/proc/{ct.prop(f'provider-worker@{B}.service', 'MainPID')}/environ": ("ENOENT", "EACCES"),
    }
    for path, expected in theirs.items():
        outcome = probe(ct, PORT_A, "read", path)
        assert outcome in expected, f"worker {A} read {path}: {outcome}"
    for sock in (
        "/run/dbus/system_bus_socket",
        "/run/systemd/private",
        f"/run/providerd/{B}/control.sock",
    ):
        outcome = probe(ct, PORT_A, "connect", sock)
        assert not outcome.startswith("ok"), f"worker {A} connected to {sock}"
    # The secret is nowhere an unprivileged user or another provider can look.
    for cmd in (
        f"systemctl show provider-worker@{B}.service",
        f"setpriv --reuid=nobody --regid=nogroup --clear-groups systemctl show provider-worker@{B}.service",
        f"systemctl cat provider-worker@{B}.service",
        "grep -r . /run/systemd/generator/",
    ):
        out = ct.sh(cmd, check=False).out
        assert out and SECRET_B not in out and SECRET_A not in out, cmd


def test_the_router_runs_as_providerd_and_reaches_no_bus(ct: Container, two: None) -> None:
    ct.write(
        "/etc/providerd/providerd.toml",
        f'[router]\nenabled = true\naddress = "127.0.0.1:{ROUTER_PORT}"\nidle_timeout_s = 60\n',
    )
    try:
        ct.sh("systemctl daemon-reload && systemctl restart providerd-router.socket")
        r = ct.sh(f"curl -sS --max-time 30 http://127.0.0.1:{ROUTER_PORT}/v1/models", check=False)
        assert r.rc == 0, f"{r}\n{ct.journal('-u providerd-router.service')}"
        pid = ct.prop("providerd-router.service", "MainPID")
        assert ct.sh(f"stat -c %U /proc/{pid}").out.strip() == "providerd"
        # PrivateUsers=: only root and its own user exist in its user namespace.
        uid_map = ct.sh(f"cat /proc/{pid}/uid_map").out.splitlines()
        assert len(uid_map) == 2, uid_map
        for sock in ("/run/dbus/system_bus_socket", "/run/systemd/private"):
            script = f"import socket; socket.socket(socket.AF_UNIX).connect({sock!r})"
            r = ct.sh(f"nsenter -t {pid} -m python3 -c {shlex.quote(script)}", check=False)
            assert r.rc != 0, f"the router's namespace reaches {sock}"
    finally:
        ct.sh("rm -f /etc/providerd/providerd.toml", check=False)
        ct.sh("systemctl stop providerd-router.socket providerd-router.service", check=False)
        ct.sh("systemctl daemon-reload; systemctl reset-failed 'providerd-router.*'", check=False)


def test_unix_socket_listeners_get_the_manifests_mode_and_group(
    ct: Container, provider: Provider
) -> None:
    text = probe_manifest(0).replace('address = "127.0.0.1:0"', 'address = "/run/privsock.sock"')
    provider.add("privsock", text)
    assert (
        ct.sh("stat -c '%a %U %G' /run/privsock.sock").out.strip() == "660 root providerd-clients"
    )


LIMIT = 1.0


@pytest.mark.parametrize(
    "unit", [f"provider@{A}.service", f"provider-worker@{A}.service", "providerd-router.service"]
)
def test_systemd_analyze_security_at_most_one(ct: Container, two: None, unit: str) -> None:
    r = ct.sh(f"systemd-analyze security --no-pager {unit}", check=False)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", r.out)
    assert m, str(r)
    exposure = float(m.group(1))
    FIGURES.append(f"systemd-analyze security {unit}: {exposure} {m.group(2)} (limit {LIMIT})")
    assert exposure <= LIMIT, r.out


# -- the ceilings: measured here, under the data path's hostile load -------------------------

LOAD = r"""
import json, socket, sys, threading, time
port, slow, parallel, body_mb, path = (
    int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
)
held = []
for _ in range(slow):  # heads that never end (one byte each)
    s = socket.create_connection(("127.0.0.1", port)); s.sendall(b"G"); held.append(s)
codes, lock = [], threading.Lock()
def one():
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    if body_mb:
        body = b'{"model": "no-such-model", "pad": "' + b"x" * (body_mb << 20) + b'"}'
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        s.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    else:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    data = b""
    while chunk := s.recv(65536):
        data += chunk
        if not body_mb or b"\r\n\r\n" in data: break
    with lock: codes.append(data[9:12].decode(errors="replace"))
    s.close()
threads = [threading.Thread(target=one) for _ in range(parallel)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(sorted(set(codes))), len(codes))
"""


def peak(ct: Container, unit: str) -> tuple[float, int]:
    """The unit's main process's peak resident memory (MiB) and its thread count now."""
    pid = ct.prop(unit, "MainPID")
    status = ct.sh(f"cat /proc/{pid}/status").out
    hwm = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    threads = re.search(r"^Threads:\s+(\d+)", status, re.M)
    assert hwm and threads, status
    return int(hwm.group(1)) / 1024, int(threads.group(1))


def ceiling(ct: Container, unit: str) -> tuple[float, int]:
    mem = int(ct.prop(unit, "MemoryMax"))
    return mem / (1 << 20), int(ct.prop(unit, "TasksMax"))


def test_front_and_router_stay_well_under_their_ceilings(ct: Container, two: None) -> None:
    ct.write("/root/load.py", LOAD)
    # The front: 600 slow heads held open plus 300 requests at once.
    r = ct.sh(f"python3 /root/load.py {PORT_A} 600 300 0 /", timeout=300)
    assert r.out.split()[-1] == "300", r
    front_mib, front_threads = peak(ct, f"provider@{A}.service")
    ct.write(
        "/etc/providerd/providerd.toml",
        f'[router]\nenabled = true\naddress = "127.0.0.1:{ROUTER_PORT}"\nidle_timeout_s = 60\n',
    )
    try:
        ct.sh("systemctl daemon-reload && systemctl restart providerd-router.socket")
        # The router: 600 slow heads plus 16 bodies of 15 MiB at once (under max_body).
        r = ct.sh(f"python3 /root/load.py {ROUTER_PORT} 600 16 15 /v1/embeddings", timeout=300)
        assert r.out.split()[-1] == "16", r
        router_mib, router_threads = peak(ct, "providerd-router.service")
        router_max = ceiling(ct, "providerd-router.service")
    finally:
        ct.sh("rm -f /etc/providerd/providerd.toml", check=False)
        ct.sh("systemctl stop providerd-router.socket providerd-router.service", check=False)
        ct.sh("systemctl daemon-reload; systemctl reset-failed 'providerd-router.*'", check=False)
    front_max = ceiling(ct, f"provider@{A}.service")
    FIGURES.append(
        f"front under 600 slow heads + 300 requests: peak RSS {front_mib:.0f} MiB, "
        f"{front_threads} threads (MemoryMax {front_max[0]:.0f} MiB, TasksMax {front_max[1]})"
    )
    FIGURES.append(
        f"router under 600 slow heads + 16 x 15 MiB bodies: peak RSS {router_mib:.0f} MiB, "
        f"{router_threads} threads (MemoryMax {router_max[0]:.0f} MiB, TasksMax {router_max[1]})"
    )
    # A ceiling stops a runaway, never this load: at least twice the measured need.
    assert front_mib * 2 <= front_max[0] and front_threads * 4 <= front_max[1]
    assert router_mib * 2 <= router_max[0] and router_threads * 4 <= router_max[1]


def test_the_front_still_reads_why_its_worker_failed(ct: Container, provider: Provider) -> None:
    """Group systemd-journal: the front quotes the worker's last words, read from the journal."""
    port = 18073
    provider.add("privfail", probe_manifest(port, "--exit", "3"))
    r = ct.sh(f"curl -sS --max-time 60 http://127.0.0.1:{port}/", check=False)
    assert '"error"' in r.out, r
    ct.wait_for(
        "journalctl -q -o cat -u provider@privfail.service | "
        "grep -q '^  .*probe worker: exiting with status 3 as asked'",
        timeout=20,
    )


def test_a_host_network_worker_cannot_reach_the_other_fronts_on_loopback(
    ct: Container, two: None, provider: Provider
) -> None:
    port = 18074
    text = probe_manifest(port, "--host", "{host}", extra='[isolation]\nnetwork = "host"\n')
    provider.add("privhost", text)
    doc = report(ct, port)  # served through its front, from the worker's own loopback address
    env = doc["env"]
    assert isinstance(env, dict)
    own = env["PROVIDERD_WORKER_HOST"]
    assert own.startswith("127.") and own != "127.0.0.1", own
    assert ct.sh(f"ss -Hltn 'sport = :{port}'").out.strip(), "the front listens on the host"
    # Reaching 127.0.0.1 is refused by the BPF IP filter, which this container's systemd
    # cannot attach (hybrid cgroups): the VM tier checks it (test_limits.py, "hostnet").
    unit = "provider-worker@privhost.service"
    assert sorted(ct.prop(unit, "IPAddressDeny").split()) == ["127.0.0.0/8", "::1/128"]
    assert ct.prop(unit, "IPAddressAllow").split() == [f"{own}/32"]
    # The model is the unit's main process, started with the port the front picked for
    # this start (ExecStart= takes it from worker.env) and the provider's own address.
    argv = doc["argv"]
    assert isinstance(argv, list)
    assert str(env["PROVIDERD_WORKER_PORT"]).isdigit()
    assert argv[argv.index("--port") + 1] == env["PROVIDERD_WORKER_PORT"], argv
    assert argv[argv.index("--host") + 1] == own, argv
    assert str(doc["pid"]) == ct.prop(unit, "MainPID")
