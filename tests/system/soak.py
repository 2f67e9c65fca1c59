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

# Runs inside the container; prints one JSON object.
CYCLES = """\
import json, socket, subprocess, sys, time
cycles, port, slug, pace = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
units = [f"provider@{slug}.service", f"provider-worker@{slug}.service"]

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
    r = subprocess.run(["systemctl", "is-active", *units], capture_output=True, text=True)
    return all(s in ("inactive", "failed") for s in r.stdout.split())

failed, slow, took = [], 0, []
t_all = time.monotonic()
for i in range(cycles):
    t0 = time.monotonic()
    status = request()
    if status != "HTTP/1.1 200 OK":
        failed.append(f"cycle {i + 1}: {status}")
    subprocess.run(["providerctl", "stop", slug], capture_output=True)
    deadline = time.monotonic() + 30
    while not released():
        if time.monotonic() > deadline:
            failed.append(f"cycle {i + 1}: not released within 30 s")
            break
        time.sleep(0.01)
    took.append(time.monotonic() - t0)
    time.sleep(max(0.0, t0 + pace - time.monotonic()))
took.sort()
print(json.dumps({
    "cycles": cycles, "failed": failed, "seconds": round(time.monotonic() - t_all, 1),
    "cycle_p50_s": round(took[len(took) // 2], 3), "cycle_max_s": round(took[-1], 3),
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
    journal: list[str]  # the provider's error lines, when something failed

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


def run(ct: Container, cycles: int, pace_s: float = PACE_S) -> Soak:
    install(ct)
    ct.sh(f"python3 {LIB}/cycles.py 1 {PORT} {SLUG} {PACE_S}", timeout=120)  # warm-up
    before = _probe(ct)
    cmd = f"python3 {LIB}/cycles.py {cycles} {PORT} {SLUG} {pace_s}"
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
    journal = []
    if result["failed"]:
        journal = ct.sh(
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
