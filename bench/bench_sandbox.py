"""What each of the worker's sandbox directives costs a start, under a real systemd.

In the container tier's Debian 12 with the package installed, a oneshot unit carries the
[Service] sandbox of the installed `provider-worker@.service` (its lines read from the
file), and variants of it as drop-ins. Each start runs a tiny static program that prints
CLOCK_MONOTONIC and its own CPU time; the figures are that stamp minus the time just before
`systemctl start` (PID 1's job, the fork, the move into the unit's cgroup, the namespaces
and mounts, the exec), and the CPU time PID 1's child spent before the exec (a process
keeps its CPU time across exec): the sandbox's own work, far less noisy than the wall time
on a shared machine. Variants interleave, in a new random order each round; each prints
its medians and their differences from the shipped sandbox. `--mounts N` mounts N more
tmpfs in the container first: systemd 252 reads the whole mount table again at each of its
~80 steps of building the namespace, so the host's mount count is part of the cost.

    python3 bench/bench_sandbox.py [--deb dist/providerd_0.1.0_all.deb] [--rounds N]
                                   [--variant NAME='Directive=value\\n...' ...] [--only]
                                   [--mounts N]

Needs root (systemd-nspawn), a C compiler for the stamp program (else a Python stamp,
about 6 ms slower, the same for every variant) and the cached base tree of the container
tier. Prints only; the figures belong in a note, not in a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.system.nspawn import Container, base_tarball, installed  # noqa: E402

LIB = "/usr/local/lib/providerd-bench"
# CLOCK_MONOTONIC, then the process's own CPU time: a process keeps its CPU time across
# exec, so that is what PID 1's child spent building the sandbox (with the fork and the exec).
STAMP_C = r"""
#include <stdio.h>
#include <time.h>
int main(void) {
    struct timespec t, c;
    clock_gettime(CLOCK_MONOTONIC, &t);
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c);
    printf("%lld %lld\n", (long long)t.tv_sec * 1000000000LL + t.tv_nsec,
           (long long)c.tv_sec * 1000000000LL + c.tv_nsec);
    return 0;
}
"""
STAMP_PY = (
    "#!/usr/bin/python3 -I -S\nimport time\nprint(time.monotonic_ns(), time.process_time_ns())\n"
)
# Lines of the worker's [Service] that are not its sandbox (or need the provider).
NOT_SANDBOX = (
    "Type=",
    "NotifyAccess=",
    "EnvironmentFile=",
    "Environment=",
    "Restart=",
    "SuccessExitStatus=",
    "TimeoutStopSec=",
    "KillMode=",
    "Slice=",
    "LogExtraFields=",
    "CacheDirectory=",
)
NONE = "\n".join(
    [
        "DynamicUser=no",
        "PrivateUsers=no",
        "PrivateTmp=no",
        "PrivateMounts=no",
        "PrivateNetwork=no",
        "ProtectSystem=no",
        "ProtectHome=no",
        "ProtectKernelTunables=no",
        "ProtectKernelModules=no",
        "ProtectKernelLogs=no",
        "ProtectControlGroups=no",
        "ProtectClock=no",
        "ProtectHostname=no",
        "ProtectProc=default",
        "TemporaryFileSystem=",
        "InaccessiblePaths=",
        "SystemCallFilter=",
        "SystemCallArchitectures=",
        "RestrictNamespaces=no",
        "RestrictAddressFamilies=",
        "LockPersonality=no",
        "RestrictRealtime=no",
        "RestrictSUIDSGID=no",
        "NoNewPrivileges=no",
        "RemoveIPC=no",
        "IPAddressDeny=",
        "IPAddressAllow=",
        "DevicePolicy=auto",
    ]
)
# Each alone switched off, from the shipped sandbox.
ONE_OFF = {
    "DynamicUser": "DynamicUser=no",
    "PrivateUsers": "PrivateUsers=no",
    "PrivateNetwork": "PrivateNetwork=no",
    "ProtectKernelTunables": "ProtectKernelTunables=no",
    "ProtectKernelModules": "ProtectKernelModules=no",
    "ProtectControlGroups": "ProtectControlGroups=no",
    "ProtectHome": "ProtectHome=no",
    "ProtectProc": "ProtectProc=default",
    "TemporaryFileSystem": "TemporaryFileSystem=",
    "InaccessiblePaths": "InaccessiblePaths=",
    "SystemCallFilter": "SystemCallFilter=",
    "IPAddress": "IPAddressDeny=\nIPAddressAllow=",
}

CLIENT = """\
import json, random, subprocess, sys, time
rounds, names = int(sys.argv[1]), sys.argv[2:]
out = {n: [] for n in names}
for _ in range(rounds):
    random.shuffle(names)  # no variant always follows the same one
    for n in names:
        log = f"/run/sbx-{n}.log"
        t0 = time.monotonic_ns()
        subprocess.run(["systemctl", "start", f"sbx-{n}.service"], check=True)
        with open(log) as f:
            stamp, cpu = f.read().split()[-2:]
        out[n].append(((int(stamp) - t0) / 1e6, int(cpu) / 1e6))
print(json.dumps(out))
"""


def sandbox_lines(unit_text: str) -> list[str]:
    lines, section = [], ""
    for raw in unit_text.splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line and not line.startswith(("#", *NOT_SANDBOX)):
            lines.append(line)
    return lines


def stamp_program(tmp: Path) -> tuple[Path, str]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc:
        src = tmp / "stamp.c"
        src.write_text(STAMP_C)
        out = tmp / "stamp"
        r = subprocess.run([cc, "-O2", "-static", "-o", str(out), str(src)], capture_output=True)
        if r.returncode == 0:
            return out, "a static C program"
    out = tmp / "stamp"
    out.write_text(STAMP_PY)
    return out, "python3 -I -S (no C compiler)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deb", default=str(REPO / "dist" / "providerd_0.1.0_all.deb"))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=DROPIN",
        help="an extra variant: drop-in lines over the shipped sandbox (\\n between lines)",
    )
    ap.add_argument("--only", action="store_true", help="measure only none, shipped and --variant")
    ap.add_argument(
        "--mounts",
        type=int,
        default=0,
        help="mount this many more tmpfs in the container first (what the host's mount count costs)",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_sandbox: needs root (systemd-nspawn)", file=sys.stderr)
        return 2
    deb = Path(args.deb).resolve()
    if not deb.is_file():
        print(f"bench_sandbox: {deb} does not exist; run `make deb`", file=sys.stderr)
        return 2
    variants = {"none": NONE, "shipped": ""}
    if not args.only:
        variants |= {f"-{k}": v for k, v in ONE_OFF.items()}
    for spec in args.variant:
        name, _, text = spec.partition("=")
        variants[name] = text.replace("\\n", "\n")
    with tempfile.TemporaryDirectory() as t:
        stamp, stamp_kind = stamp_program(Path(t))

        def prepare(c: Container) -> None:
            lib = c.root / LIB.lstrip("/")
            lib.mkdir(parents=True, exist_ok=True)
            shutil.copy(stamp, lib / "stamp")
            (lib / "stamp").chmod(0o755)
            (lib / "client.py").write_text(CLIENT)

        with installed(deb, base_tarball(), f"providerd-sbx-{os.getpid()}", prepare) as ct:
            shipped = sandbox_lines(ct.sh("cat /lib/systemd/system/provider-worker@.service").out)
            for name, extra in variants.items():
                unit = "\n".join(
                    [
                        "[Service]",
                        "Type=oneshot",
                        f"ExecStart={LIB}/stamp",
                        f"StandardOutput=append:/run/sbx-{name}.log",
                        *shipped,
                    ]
                )
                ct.write(f"/etc/systemd/system/sbx-{name}.service", unit + "\n")
                if extra:
                    ct.write(
                        f"/etc/systemd/system/sbx-{name}.service.d/v.conf", f"[Service]\n{extra}\n"
                    )
            ct.sh("systemctl daemon-reload")
            if args.mounts > 0:
                ct.sh(
                    f"for i in $(seq {args.mounts}); do mkdir -p /mnt/sbx/$i && "
                    "mount -t tmpfs sbx /mnt/sbx/$i; done"
                )
            ct.sh(f"python3 {LIB}/client.py 2 {' '.join(variants)}", timeout=300)  # warm-up
            r = ct.sh(
                f"python3 {LIB}/client.py {args.rounds} {' '.join(variants)}",
                timeout=60 + args.rounds * len(variants),
            )
            version = ct.sh("systemctl --version | head -n 1", check=False).out.strip()
            mounts = ct.sh("wc -l < /proc/self/mountinfo", check=False).out.strip()
    times: dict[str, list[list[float]]] = json.loads(r.out.strip().splitlines()[-1])
    base = statistics.median(t[0] for t in times["shipped"])
    base_cpu = statistics.median(t[1] for t in times["shipped"])
    print(
        f"Worker sandbox cost per start ({version}), container tier, {args.rounds} interleaved "
        f"rounds, stamp: {stamp_kind}; the container has {mounts} mounts"
    )
    print(
        f"{'variant':<26} {'median ms':>10} {'p10':>7} {'p90':>7} {'vs shipped':>11}"
        f" {'CPU ms':>7} {'vs shipped':>11}"
    )
    for name, ts in times.items():
        wall, cpu = [t[0] for t in ts], [t[1] for t in ts]
        q = statistics.quantiles(wall, n=10)
        print(
            f"{name:<26} {statistics.median(wall):>10.2f} {q[0]:>7.2f} {q[-1]:>7.2f} "
            f"{statistics.median(wall) - base:>+11.2f} {statistics.median(cpu):>7.2f} "
            f"{statistics.median(cpu) - base_cpu:>+11.2f}"
        )
    print(
        "median ms: `systemctl start` → the unit's program runs (PID 1's job, the fork, the "
        "move into the unit's cgroup, the sandbox, the exec); CPU ms: the CPU time PID 1's "
        "child spent before the exec (the sandbox's own work, less noisy than the wall time)"
    )
    print("'-X': the shipped sandbox with X switched off; 'none': no sandbox at all.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
