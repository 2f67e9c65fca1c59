"""What providerd adds to a cold start under a real systemd (the container tier's Debian 12).

A model that listens LOAD seconds after it starts (a small Python listener). Each round,
inside the container, interleaved:
  direct: launch the model as a plain process → its port accepts (polled every 0.2 ms) →
          first response byte;
  cold:   the installed package, provider released (front and worker inactive, socket
          listening) → connect and send a request → first response byte.
The added time is cold - direct, per round; the figure is the median (target ≤ 30 ms).
Between rounds `providerctl stop` releases the provider, so every round is a real
activation: socket → front (and worker) units → wrapper → model → readiness → proxy.
Each round is split by PID 1's own stamps of the worker unit and the model's: the way to the
unit's process in its cgroup, the unit's set-up (its sandbox), the interpreter's start, the
model's own load, the front's probe and the relay; the last round's journal follows.

    python3 bench/bench_cold_systemd.py [--deb dist/providerd_0.1.0_all.deb] [--rounds N]
                                        [--load S] [--keep] [--decided | --gpu]
                                        [--worker-dropin TEXT [--ab] | --favordynmods]

Needs root (systemd-nspawn) and the cached base tree of the container tier
(tests/system/base-rootfs.sh builds it). Writes bench/results/cold_systemd.txt
(cold_systemd_decided.txt with --decided, cold_systemd_gpu.txt with --gpu, a
_favordynmods before .txt with --favordynmods).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.systemd.names import worker_unit  # noqa: E402
from tests.system.nspawn import Container, base_tarball, installed  # noqa: E402
from tests.system.soak import MODEL  # noqa: E402

RESULTS = REPO / "bench" / "results" / "cold_systemd.txt"
# The soak's model, saying (on stderr: the worker's journal) when it started and when it
# listens, in CLOCK_MONOTONIC seconds, the clock of the client's own stamps.
STAMP = (
    "import sys as _s, time as _t; print('bench-model {} %.6f %.6f' % (_t.monotonic(), "
    "_t.process_time()), file=_s.stderr, flush=True)\n"
)
# The first connection it accepts is the front's readiness probe (the bench's client comes
# after the front saw the model answer).
ACCEPTED = (
    "    if not globals().get('_accepted'):\n"
    "        _accepted = 1; print('bench-model accepted %.6f' % _t.monotonic(), file=_s.stderr, "
    "flush=True)\n"
)
STAMPED_MODEL = STAMP.format("started") + MODEL.replace(
    "s.listen(1024)\n", "s.listen(1024)\n" + STAMP.format("listens")
).replace("    c, _ = s.accept()\n", "    c, _ = s.accept()\n" + ACCEPTED)
assert STAMPED_MODEL.count("bench-model") == 3
LIB = "/usr/local/lib/providerd-bench"
SLUG = "coldbench"
PORT = 18300

# Runs inside the container: one JSON line per round.
CLIENT = """\
import json, socket, subprocess, sys, time
rounds, port, slug, model, load = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
REQUEST = b"GET / HTTP/1.1\\r\\nHost: bench\\r\\nConnection: close\\r\\n\\r\\n"

def first_byte(p):
    with socket.create_connection(("127.0.0.1", p), timeout=60) as c:
        c.sendall(REQUEST)
        if not c.recv(1):
            raise RuntimeError("closed without an answer")

def cpu_s(unit):
    group = subprocess.run(
        ["systemctl", "show", "-P", "ControlGroup", unit], capture_output=True, text=True
    ).stdout.strip()
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):  # unified, or hybrid
        try:
            with open(f"{root}{group}/cpu.stat") as f:
                return next(int(l.split()[1]) / 1e6 for l in f if l.startswith("usage_usec "))
        except (OSError, StopIteration, ValueError):
            continue
    return None

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def direct():
    p = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, model, str(p), load])
    try:
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", p)) == 0:
                    break
            time.sleep(0.0002)
        first_byte(p)
        return time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait()

def inactive():
    units = [f"provider@{slug}.service", f"provider-worker@{slug}.service"]
    r = subprocess.run(["systemctl", "is-active", *units], capture_output=True, text=True)
    return all(s in ("inactive", "failed") for s in r.stdout.split())

def release():
    subprocess.run(["providerctl", "stop", slug], capture_output=True)
    deadline = time.monotonic() + 30
    while not inactive():
        if time.monotonic() > deadline:
            raise RuntimeError("the provider was not released within 30 s")
        time.sleep(0.02)
    time.sleep(0.2)

release()
for i in range(rounds):
    d = direct()
    t0 = time.perf_counter()  # CLOCK_MONOTONIC, as the model's stamps
    first_byte(port)
    c = time.perf_counter() - t0
    # CPU time the units used (their cgroups' cpu.stat, there without the cpu controller
    # too), the model's own included: read before the release.
    cpu = [cpu_s(f"provider-worker@{slug}.service"), cpu_s(f"provider@{slug}.service")]
    print(json.dumps({"round": i + 1, "direct": d, "cold": c, "t0": t0, "cpu": cpu}), flush=True)
    release()
"""


def manifest(load: float, decided: bool, gpu: bool = False) -> str:
    # network = "host" without worker_port: the front picks a free port at each start, so
    # it decides the start and starts the worker itself, as for a GPU provider.
    isolation = '[isolation]\nnetwork = "host"\n' if decided else ""
    # A GPU provider on the fake card (FAKE_CARDS): the front places it, writes worker.env
    # and DeviceAllow=, then asks for the start.
    isolation += '[gpu]\ndevices = "auto"\nvram_budget_gb = 1\n' if gpu else ""
    return (
        textwrap.dedent(
            f"""\
        description = "cold-start bench"
        enabled = false
        [listen]
        address = "127.0.0.1:{PORT}"
        protocol = "http"
        [runtime]
        command = ["/usr/bin/python3", "{LIB}/model.py", "{{port}}", "{load}", "{{host}}"]
        ready = "tcp"
        start_timeout_s = 60
        idle_timeout_s = 300
        """
        )
        + isolation
    )


# --gpu: one fake card (agent.gpu.nvml.DirNvml), which the front's unit is pointed at.
FAKE_NVML = "/srv/providerd-bench-gpus"
FAKE_CARDS = [{"uuid": "GPU-bench-0", "total": 16 << 30, "name": "Fake GPU"}]


# --favordynmods: the host's cgroup2 superblock remounted with the option for the rounds (the
# container's cgroups live on it), its own options kept, and put back as it was afterwards
# (Linux 6.18 keeps moves fast after that until a reboot: then every later run measures the
# option too). Moving a process into a cgroup (PID 1 does it for each unit's process) first
# waits for an RCU grace period unless the hierarchy favours dynamic changes (Linux >= 6.0).
MS_REMOUNT = 32
# A remount sets the mount's own flags to the ones it is given: these keep them as they are.
MOUNT_FLAGS = {
    "ro": 1,
    "nosuid": 2,
    "nodev": 4,
    "noexec": 8,
    "noatime": 1 << 10,
    "nodiratime": 1 << 11,
    "relatime": 1 << 21,
    "strictatime": 1 << 24,
}


def cgroup2_mount() -> tuple[str, str, str]:
    """The host's cgroup2 mount point, the mount's own options and its superblock's
    (mountinfo's fields 5, 6 and last)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _, options = right.split()[:3]
            if fstype == "cgroup2":
                fields = left.split()
                return fields[4].replace("\\040", " "), fields[5], options
    raise RuntimeError("no cgroup2 mount on this host")


def remount_cgroup2(point: str, flags: str, options: str) -> None:
    """Reconfigure the cgroup2 superblock with exactly `options` (cgroup2 clears what is not
    given: nsdelegate, memory_recursiveprot; rw/ro are not its own), the mount's own `flags`
    kept (nosuid, nodev, noexec, ro, its atime)."""
    import ctypes

    data = ",".join(o for o in options.split(",") if o not in ("rw", "ro"))
    bits = MS_REMOUNT | sum(MOUNT_FLAGS.get(f, 0) for f in set(flags.split(",")))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"cgroup2", point.encode(), b"cgroup2", bits, data.encode()) != 0:
        raise OSError(ctypes.get_errno(), f"remount {point} ({flags}) with {data!r}")


def prepare(c: Container) -> None:
    lib = c.root / LIB.lstrip("/")
    lib.mkdir(parents=True, exist_ok=True)
    (lib / "model.py").write_text(STAMPED_MODEL)
    (lib / "client.py").write_text(CLIENT)
    for f in lib.iterdir():
        f.chmod(0o755)
    lib.chmod(0o755)


def breakdown(ct: Container, since: str) -> list[str]:
    """The last round's journal lines that mark its steps, with monotonic times."""
    marks = (
        f"provider@{SLUG}.service",
        f"provider-worker@{SLUG}.service",
        "Starting worker",
        "Started the model",
        "ready after",
        "Worker ready",
        "Adopting",
        "Asked for the worker's start first",
        "Not asking for the worker's start first",
        "Failed to ask for the worker's start first",
    )
    after = f"--after-cursor='{since}'" if since else ""
    out = ct.sh(
        f"journalctl -q --no-pager -o short-monotonic {after} "
        f"-u provider@{SLUG}.service -u provider-worker@{SLUG}.service",
        check=False,
    ).out
    lines = [line for line in out.splitlines() if any(m in line for m in marks)]
    # The last activation: from the last socket-triggered front start.
    starts = [n for n, line in enumerate(lines) if f"Starting provider@{SLUG}" in line]
    lines = lines[starts[-1] if starts else 0 :]
    return [line for line in lines if "Stopp" not in line and "Deactivated" not in line][:12]


def model_stamps(ct: Container, since: str) -> list[dict[str, float]]:
    """Each cold start since `since`, in CLOCK_MONOTONIC seconds: PID 1's "Starting" of the
    worker unit (logged once the unit's process is forked and in its cgroup), its "Started"
    (for Type=exec: the model's program runs), and the model's own stamps: its first line
    ("started", with its CPU seconds by then), "listens", and its first accepted connection
    ("accepted": the front's readiness probe)."""
    # Unfiltered, the unit's entries picked here: systemd 252's journalctl skips the first
    # match after a cursor that does not match itself.
    out = ct.sh(f"journalctl -q --no-pager -o json --after-cursor='{since}'", check=False).out
    rounds: list[dict[str, float]] = []
    unit = worker_unit(SLUG)
    for line in out.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        message = entry.get("MESSAGE")
        if not isinstance(message, str) or unit not in (
            entry.get("UNIT"),
            entry.get("_SYSTEMD_UNIT"),
        ):
            continue
        logged = int(entry.get("__MONOTONIC_TIMESTAMP", 0)) / 1e6
        if message.startswith(f"Starting {worker_unit(SLUG)}"):
            rounds.append({"unit": logged})
        elif not rounds:
            continue
        elif message.startswith(f"Started {worker_unit(SLUG)}"):
            rounds[-1].setdefault("exec", logged)
        elif message.startswith("bench-model "):
            word, when, *cpu = message.split()[1:]
            rounds[-1].setdefault(word, float(when))
            if cpu:
                rounds[-1].setdefault(f"{word} cpu", float(cpu[0]))
    return [r for r in rounds if {"started", "listens"} <= r.keys()]


def early_starts(ct: Container, since: str) -> list[dict[str, float]]:
    """The front's own account of each early start since `since` (agent.front.early's
    "Asked for the worker's start first, T ms into the front: record R, decision D, bus B
    ms"), as {"into the front": T, "record": R, …}."""
    out = ct.sh(
        f"journalctl -q --no-pager -o cat --after-cursor='{since}' -u provider@{SLUG}.service",
        check=False,
    ).out
    found = []
    for line in out.splitlines():
        _, _, rest = line.partition("Asked for the worker's start first, ")
        if not rest or " ms into the front: " not in rest:
            continue
        took, _, parts = rest.partition(" ms into the front: ")
        try:
            got = {"into the front": float(took)}
            for part in parts.split(", "):
                words = part.split()
                if len(words) >= 2 and words[1].replace(".", "", 1).isdigit():
                    got[words[0]] = float(words[1])
        except ValueError:
            continue
        found.append(got)
    return found


COLUMNS = ("to unit", "set-up", "to line", "model", "probe", "relay", "cpu")


def breakdown_of(st: dict[str, float], t0: float, end: float) -> dict[str, float]:
    """One round's parts in ms, from its stamps (`model_stamps`), the connection at `t0`
    and the first response byte at `end`; a part whose stamps are missing is left out."""
    marks = [("unit", "to unit"), ("exec", "set-up"), ("started", "to line")]
    marks += [("listens", "model"), ("accepted", "probe")]
    at = {"connection": t0, **st}
    out: dict[str, float] = {}
    for i, (key, column) in enumerate(marks):
        before = marks[i - 1][0] if i else "connection"
        if key in at and before in at:
            out[column] = (at[key] - at[before]) * 1000
    if "accepted" in st:
        out["relay"] = (end - st["accepted"]) * 1000
    if "started cpu" in st:
        out["cpu"] = st["started cpu"] * 1000
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deb", default=str(REPO / "dist" / "providerd_0.1.0_all.deb"))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--load", type=float, default=1.0, help="the model's own load time, s")
    ap.add_argument("--keep", action="store_true", help="keep the container tree afterwards")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument(
        "--decided",
        action="store_true",
        help='a provider whose start the front decides (network = "host", a port per start: '
        "the path a GPU provider takes, without NVML), instead of one systemd starts beside it",
    )
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="a GPU provider on a fake card (agent.gpu.nvml.DirNvml): the front decides its "
        "start (placement, worker.env, DeviceAllow=, StartUnit)",
    )
    ap.add_argument(
        "--worker-dropin",
        default="",
        help="text of an extra drop-in for the worker unit, to measure what a directive costs "
        "(e.g. '[Service]\\nProtectKernelTunables=no')",
    )
    ap.add_argument(
        "--favordynmods",
        action="store_true",
        help="remount the host's cgroup2 with favordynmods for the rounds (its options kept, "
        "put back afterwards): no RCU grace period before PID 1 moves a unit's process into "
        "its cgroup. Linux 6.18 keeps the effect after the remount back, until a reboot: "
        "measure the shipped set-up first",
    )
    ap.add_argument(
        "--front-dropin",
        default="",
        help="the same for the front's unit (e.g. '[Service]\\nPrivateDevices=no')",
    )
    ap.add_argument(
        "--ab",
        action="store_true",
        help="with a drop-in: alternate rounds without and with it, in one container",
    )
    args = ap.parse_args()
    dropin = bool(args.worker_dropin or args.front_dropin)
    if args.ab and not dropin:
        ap.error("--ab needs --worker-dropin or --front-dropin")
    if args.favordynmods and dropin:
        ap.error("--favordynmods measures one change: no drop-in with it")
    if args.gpu and args.decided:
        ap.error("--gpu is a start the front decides already; --decided is the CPU one")
    if os.geteuid() != 0:
        print("bench_cold_systemd: needs root (systemd-nspawn)", file=sys.stderr)
        return 2
    deb = Path(args.deb).resolve()
    if not deb.is_file():
        print(f"bench_cold_systemd: {deb} does not exist; run `make deb`", file=sys.stderr)
        return 2
    point, flags, options = cgroup2_mount() if args.favordynmods else ("", "", "")
    if "favordynmods" in options.split(","):
        print(f"bench_cold_systemd: {point} has favordynmods already", file=sys.stderr)
        return 2
    name = f"providerd-bench-{os.getpid()}"
    with installed(deb, base_tarball(), name, prepare, keep=args.keep) as ct:
        if args.gpu:
            ct.write(f"{FAKE_NVML}/cards.json", json.dumps(FAKE_CARDS))
            ct.write(
                f"/etc/systemd/system/provider@{SLUG}.service.d/60-fake-nvml.conf",
                f"[Service]\nEnvironment=PROVIDERD_NVML_FAKE={FAKE_NVML}\n",
            )
        ct.write(
            f"/etc/providerd/providers/{SLUG}.toml", manifest(args.load, args.decided, args.gpu)
        )
        # The generator writes no early-start record for a file changed within 1 s of its
        # run (agent.systemd.early_record.RACY_NS): let the manifest settle first.
        time.sleep(1.1)
        ct.sh("providerctl reload")
        dropins = {
            f"/etc/systemd/system/provider-worker@{SLUG}.service.d/90-bench.conf": args.worker_dropin,
            f"/etc/systemd/system/provider@{SLUG}.service.d/90-bench.conf": args.front_dropin,
        }

        def use_dropin(on: bool) -> None:
            for dropin, text in dropins.items():
                if on and text:
                    ct.write(dropin, text.replace("\\n", "\n") + "\n")
                else:
                    ct.sh(f"rm -f {dropin}")
            ct.sh("systemctl daemon-reload")

        def client(n: int, favour: bool = False) -> list[dict[str, float]]:
            if favour:
                remount_cgroup2(point, flags, options + ",favordynmods")
            try:
                r = ct.sh(
                    f"python3 {LIB}/client.py {n} {PORT} {SLUG} {LIB}/model.py {args.load}",
                    timeout=60 + n * (args.load + 15),
                )
            finally:
                if favour:
                    remount_cgroup2(point, flags, options)
            return [json.loads(line) for line in r.out.splitlines() if line.startswith("{")]

        if dropin and not args.ab:
            use_dropin(True)
        ct.sh(f"systemctl start provider@{SLUG}.socket")
        client(1)  # one warm-up activation (page cache, bytecode), not counted
        since = first = ct.cursor()
        if args.ab:
            rounds = []
            for i in range(args.rounds):
                for variant in ("shipped", "drop-in"):
                    use_dropin(variant == "drop-in")
                    since = ct.cursor()
                    (x,) = client(1)
                    rounds.append({**x, "round": i + 1, "variant": variant})
        else:
            rounds = client(args.rounds, favour=args.favordynmods)
        journal = breakdown(ct, since)
        stamps = model_stamps(ct, first)
        asked = early_starts(ct, first)
        version = ct.sh("systemctl --version | head -n 1", check=False).out.strip()
    extra = f", worker drop-in {args.worker_dropin!r}" if args.worker_dropin else ""
    extra += f", front drop-in {args.front_dropin!r}" if args.front_dropin else ""
    if args.favordynmods:
        extra += ", the host's cgroup2 remounted with favordynmods (--favordynmods)"
    if args.decided:
        extra += ", started by the front (network = host, a port per start)"
    if args.gpu:
        extra += ', a GPU provider (devices = "auto") on a fake card, started by the front'
    out = [
        f"Cold start under systemd ({version}), container tier, model load {args.load:g} s, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}{extra}",
        f"{'round':>5} {'direct ms':>10} {'cold ms':>9} {'added ms':>9}"
        + "".join(f" {c:>{max(6, len(c))}}" for c in COLUMNS),
    ]
    added: dict[str, list[float]] = {}
    parts: dict[str, list[dict[str, float]]] = {}
    cpus: dict[str, list[tuple[float, float]]] = {}
    for n, x in enumerate(rounds):
        a = (x["cold"] - x["direct"]) * 1000
        variant = str(x.get("variant", ""))
        added.setdefault(variant, []).append(a)
        split = ""
        if n < len(stamps):  # PID 1's and the model's own stamps: where the time went
            st = stamps[n]
            worker_cpu, front_cpu = (x.get("cpu") or [None, None])[:2]
            if worker_cpu is not None and front_cpu is not None and "listens cpu" in st:
                cpus.setdefault(variant, []).append(
                    ((worker_cpu - st["listens cpu"]) * 1000, front_cpu * 1000)
                )
            p = breakdown_of(st, x["t0"], x["t0"] + x["cold"])
            parts.setdefault(variant, []).append(p)
            split = "".join(
                f" {p[c]:>{max(6, len(c))}.1f}" if c in p else f" {'-':>{max(6, len(c))}}"
                for c in COLUMNS
            )
        out.append(
            f"{x['round']:>5} {x['direct'] * 1000:>10.1f} {x['cold'] * 1000:>9.1f} {a:>9.1f}"
            + split
            + (f"  {variant}" if variant else "")
        )
    out += [
        "to unit: the connection → PID 1's 'Starting' of the worker (the transaction, the fork, "
        "and the move into the unit's cgroup); set-up: → its 'Started' (a Type=exec worker: "
        "its sandbox, then the model's exec); to line: → the model's first line (its "
        "interpreter's start); model: → it listens (its own start, as in direct); probe: → it "
        "accepts the front's readiness probe; relay: → the client's first response byte; "
        "cpu: the model process's CPU at its first line, its sandbox's set-up included",
    ]
    for variant, ps in parts.items():
        medians = {
            c: statistics.median(p[c] for p in ps if c in p)
            for c in COLUMNS
            if any(c in p for p in ps)
        }
        out.append(
            f"medians{' (' + variant + ')' if variant else ''}: "
            + ", ".join(f"{c} {v:.1f} ms" for c, v in medians.items())
        )
    for variant, cs in cpus.items():
        out.append(
            f"CPU{' (' + variant + ')' if variant else ''}: worker unit beyond the model's own "
            f"{statistics.median(c[0] for c in cs):.1f} ms, front unit "
            f"{statistics.median(c[1] for c in cs):.1f} ms (medians; cgroup CPUUsageNSec after "
            "the first response)"
        )
    for variant, values in added.items():
        out.append(
            f"added{' (' + variant + ')' if variant else ''}: median "
            f"{statistics.median(values):.1f} ms, min {min(values):.1f}, "
            f"max {max(values):.1f} (target: median <= 30 ms)"
        )
    if asked:
        keys = list(dict.fromkeys(k for a in asked for k in a))
        out.append(
            f"the front's early start ({len(asked)} rounds, medians): "
            + ", ".join(
                f"{k} {statistics.median(a[k] for a in asked if k in a):.1f} ms"
                + (f" ({sum(k in a for a in asked)} rounds)" if k in ("record", "manifest") else "")
                for k in keys
            )
        )
    out.append("last round's journal (monotonic s):")
    out += [f"  {line}" for line in journal]
    text = "\n".join(out) + "\n"
    print(text, end="")
    if not args.no_write:
        mode = "_gpu" if args.gpu else "_decided" if args.decided else ""
        mode += "_favordynmods" if args.favordynmods else ""
        RESULTS.with_name(f"cold_systemd{mode}.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
