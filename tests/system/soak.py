"""Activation → request → release, many times over, against the installed package.

Shared by `bench/soak.py` (`make soak`, 1,000 cycles) and the container tier's
`test_7_soak.py` (100 cycles). One cycle: a request to the provider's socket (which
activates the front and its worker), its answer, then `providerctl stop` and a wait until
both units are inactive; a cycle lasts at least PACE_S. Before and after: PID 1's and journald's open file descriptors,
PID 1's resident memory; after: processes and units of the provider left behind.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass

from .nspawn import Container

SLUG = "soak"
PORT = 18310
LIB = "/usr/local/lib/providerd-soak"

# The model both the soak and the cold-start bench run: `model.py PORT [LOAD_S [HOST]]`
# waits LOAD_S (its load), then answers every request with 200 and closes.
MODEL = """\
import socket, sys, time
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1", int(sys.argv[1])))
s.listen(1024)
while True:
    c, _ = s.accept()
    c.recv(65536)
    c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok")
    c.close()
"""

# Runs inside the container; prints one JSON object. A cycle whose units are not released
# in time captures, at that moment, what holds them ("held"): `providerctl stop`'s exit and
# output, each unit's state, job and main process, systemd's jobs, the processes in the
# provider's cgroups, and the journal of the units (PID 1's lines about them included) from
# the cycle's start to just after the stop.
CYCLES = """\
import json, os, re, socket, subprocess, sys, time
cycles, port, slug, pace = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
units = [f"provider@{slug}.service", f"provider-worker@{slug}.service"]
RELEASE_S, AFTER_S = 30, 30

def request():
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
            c.sendall(b"GET / HTTP/1.1\\r\\nHost: soak\\r\\nConnection: close\\r\\n\\r\\n")
            data = b""
            while chunk := c.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\\r\\n\\r\\n")
        status = head.split(b"\\r\\n", 1)[0].decode(errors="replace")
        return status if status.endswith(" 200 OK") else f"{status} {body[:300]!r}"
    except OSError as e:
        return repr(e)

def released():
    try:
        r = subprocess.run(["systemctl", "is-active", *units], capture_output=True, text=True,
                           timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return all(s in ("inactive", "failed") for s in r.stdout.split())

def text(b):
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

def out(*argv):
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired as e:
        return [*(text(e.stdout) + text(e.stderr)).rstrip("\\n").splitlines(), "(timed out after 10 s)"]
    return (r.stdout + r.stderr).rstrip("\\n").splitlines()

class Stop:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr

def stop_provider():
    try:
        return subprocess.run(["providerctl", "stop", slug], capture_output=True, text=True,
                              timeout=RELEASE_S)
    except subprocess.TimeoutExpired as e:
        return Stop(f"nothing: still running after {RELEASE_S} s", text(e.stdout), text(e.stderr))

PROPS = ("Id,ActiveState,SubState,Job,Result,MainPID,ExecMainStatus,NRestarts,"
         "ActiveEnterTimestampMonotonic,InactiveEnterTimestampMonotonic,ControlGroup")

def held(i, stop, since, until):
    lines = [f"cycle {i + 1}: held {RELEASE_S} s after `providerctl stop {slug}`, which exited"
             f" {stop.returncode}: {(stop.stdout + stop.stderr).strip()!r}"]
    show = out("systemctl", "show", "-p", PROPS, *units, f"provider@{slug}.socket")
    lines += ["systemctl show:", *(f"  {l}" for l in show if l)]
    lines += ["systemctl list-jobs:", *(f"  {l}" for l in out("systemctl", "list-jobs", "--no-pager"))]
    lines.append("processes:")
    for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
        try:
            group = open(f"/proc/{pid}/cgroup").read().strip().rsplit(":", 1)[-1]
        except OSError:
            continue
        if any(group.endswith("/" + u) for u in units):
            lines += [f"  {group}: {l}" for l in out("ps", "-o", "pid=,stat=,etime=,args=", "-p", pid)]
    # The units' lines and PID 1's about them; not those of a unit's set-up before its exec
    # (a "(python3)" process), of which PID 1 at debug level logs a hundred per start.
    journal = out("journalctl", "-q", "--no-pager", "-o", "short-monotonic",
                  *(a for u in (*units, f"provider@{slug}.socket") for a in ("-u", u)),
                  f"--since=@{int(since)}", f"--until=@{int(until) + 1}")
    lines.append("journal (monotonic):")
    lines += [f"  {l}" for l in journal if not re.search(r" \\([^)]*\\)\\[[0-9]+\\]: ", l)][:300]
    return lines

failed, captures, took = [], [], []
t_all = time.monotonic()
for i in range(cycles):
    t0, since = time.monotonic(), time.time() - 1
    status = request()
    if status != "HTTP/1.1 200 OK":
        failed.append(f"cycle {i + 1}: {status}")
    asked = time.monotonic()
    stop = stop_provider()
    stopped = time.time()
    timed_out = isinstance(stop, Stop)
    if stop.returncode != 0:
        failed.append(f"cycle {i + 1}: providerctl stop exited {stop.returncode}: {stop.stderr.strip()}")
    deadline = asked + RELEASE_S
    while timed_out or not released():
        if timed_out or time.monotonic() > deadline:
            failed.append(f"cycle {i + 1}: not released within {RELEASE_S} s")
            # The first held cycle alone is captured, and the cycles end with it: a few held
            # cycles must not outlast the caller's own timeout, with what they found.
            lines = held(i, stop, since, stopped + 2)
            late = time.monotonic() + AFTER_S
            while not released() and time.monotonic() < late:
                time.sleep(0.1)
            t = time.monotonic() - asked
            lines.append(f"cycle {i + 1}: " + (f"released {t:.1f} s after the stop" if released()
                         else f"still held {t:.0f} s after the stop"))
            print("\\n".join(lines), file=sys.stderr, flush=True)
            captures += lines
            break
        time.sleep(0.01)
    took.append(time.monotonic() - t0)
    if captures:
        break
    time.sleep(max(0.0, t0 + pace - time.monotonic()))
took.sort()
print(json.dumps({
    "cycles": cycles, "failed": failed, "seconds": round(time.monotonic() - t_all, 1),
    "cycle_p50_s": round(took[len(took) // 2], 3), "cycle_max_s": round(took[-1], 3),
    "held": captures,
}))
"""

# The front's unit allows 120 starts a minute (StartLimitBurst=): a cycle takes at least
# this long, so that the soak measures activations at the highest legitimate rate.
PACE_S = 0.55

PROBE = r"""
fds() { ls "/proc/$1/fd" | wc -l; }
echo "pid1_fds=$(fds 1)"
echo "journald_fds=$(fds "$(pidof systemd-journald)")"
echo "pid1_rss_kb=$(awk '/^VmRSS/ {print $2}' /proc/1/status)"
"""


@dataclass
class Soak:
    cycles: int
    failed: list[str]
    seconds: float
    cycle_p50_s: float
    cycle_max_s: float
    before: dict[str, int]
    after: dict[str, int]
    leftover_processes: list[str]
    leftover_units: list[str]
    journal: list[str]  # what held a cycle not released, and the provider's error lines

    def lines(self) -> list[str]:
        b, a = self.before, self.after
        return [
            f"{self.cycles} cycles (activation → request → release) in {self.seconds:g} s, "
            f"cycle p50 {self.cycle_p50_s * 1000:.0f} ms, max {self.cycle_max_s * 1000:.0f} ms",
            f"failed requests: {len(self.failed)}" + "".join(f"\n  {f}" for f in self.failed[:20]),
            f"leftover processes: {len(self.leftover_processes)}"
            + "".join(f"\n  {p}" for p in self.leftover_processes),
            f"leftover units: {len(self.leftover_units)}"
            + "".join(f"\n  {u}" for u in self.leftover_units),
            *(["journal:", *(f"  {line}" for line in self.journal)] if self.journal else []),
            f"PID 1 fds: {b['pid1_fds']} → {a['pid1_fds']}",
            f"journald fds: {b['journald_fds']} → {a['journald_fds']}",
            f"PID 1 memory (VmRSS): {b['pid1_rss_kb'] / 1024:.1f} MiB → "
            f"{a['pid1_rss_kb'] / 1024:.1f} MiB",
        ]


def manifest() -> str:
    return textwrap.dedent(
        f"""\
        description = "soak"
        enabled = false
        [listen]
        address = "127.0.0.1:{PORT}"
        [runtime]
        command = ["/usr/bin/python3", "{LIB}/model.py", "{{port}}"]
        ready = "tcp"
        start_timeout_s = 30
        idle_timeout_s = 300
        """
    )


def _probe(ct: Container) -> dict[str, int]:
    out = ct.sh(PROBE).out
    return {k: int(v) for k, v in (line.split("=", 1) for line in out.split())}


def install(ct: Container) -> None:
    ct.write(f"{LIB}/model.py", MODEL, mode=0o755)
    ct.write(f"{LIB}/cycles.py", CYCLES, mode=0o755)
    ct.sh(f"chmod 0755 {LIB}")
    ct.write(f"/etc/providerd/providers/{SLUG}.toml", manifest())
    ct.sh(f"providerctl reload && systemctl start provider@{SLUG}.socket")


def remove(ct: Container) -> None:
    ct.sh(f"rm -f /etc/providerd/providers/{SLUG}.toml && providerctl reload", check=False)
    ct.sh(f"systemctl stop provider@{SLUG}.socket", check=False)


def run(ct: Container, cycles: int, pace_s: float = PACE_S, pid1_debug: bool = False) -> Soak:
    """`pid1_debug`: PID 1 logs at debug level during the cycles (its jobs, one by one)."""
    install(ct)
    ct.sh(f"python3 {LIB}/cycles.py 1 {PORT} {SLUG} {PACE_S}", timeout=120)  # warm-up
    before = _probe(ct)
    cmd = f"python3 {LIB}/cycles.py {cycles} {PORT} {SLUG} {pace_s}"
    if pid1_debug:
        cmd = (
            f"systemd-analyze log-level debug && "
            f"{{ {cmd}; rc=$?; systemd-analyze log-level info; exit $rc; }}"
        )
    out = ct.sh(cmd, timeout=60 + cycles * 5).out
    result = json.loads(out.strip().splitlines()[-1])
    after = _probe(ct)
    procs = ct.sh(
        f"pgrep -a -f 'agent[.]worker --slug {SLUG} |agent[.]front {SLUG}$|{LIB}/model[.]py'",
        check=False,
    ).out.split("\n")
    units = ct.sh(
        f"systemctl list-units --all --plain --no-legend 'provider*@{SLUG}.service'"
        " | awk '$3 != \"inactive\"'",
        check=False,
    ).out.split("\n")
    journal = list(result["held"])
    if result["failed"]:
        journal += ct.sh(
            f"journalctl -q --no-pager -o short-monotonic -u provider@{SLUG}.service"
            f" -u provider-worker@{SLUG}.service | grep -iE 'fail|error|refus' | head -n 30",
            check=False,
        ).out.splitlines()
    return Soak(
        cycles=result["cycles"],
        failed=result["failed"],
        seconds=result["seconds"],
        cycle_p50_s=result["cycle_p50_s"],
        cycle_max_s=result["cycle_max_s"],
        before=before,
        after=after,
        leftover_processes=[p for p in procs if p.strip()],
        leftover_units=[u for u in units if u.strip()],
        journal=journal,
    )
