"""What providerd adds to a cold start in the VM tier: a GPU provider on a fake card, and a
CPU provider, under systemd 252 on a real (emulated) kernel with pure cgroup v2.

The VM is qemu TCG: software-emulated, several times slower than the host, so absolute
figures mean little; each cold start is compared with a direct start of the same model
measured in the same VM just before it (the container bench's client, run inside the VM).
Each round, for each provider: released (front and worker inactive) → connect and send a
request → first response byte, minus the direct start. The GPU provider's start is the
front's to decide (placement on the fake cards of agent.gpu.nvml.DirNvml, worker.env,
DeviceAllow= over D-Bus, then StartUnit); the CPU provider's worker systemd starts beside
the front. The model's own stamps split each round: the connection → the model's first
line ("to model"), its own start, its listening → the first response byte ("after"); and
per round, the GPU provider's added time less the CPU provider's: what the GPU decision
costs beyond a CPU start there.

    python3 bench/bench_cold_vm.py [--deb dist/providerd_0.1.0_all.deb] [--rounds N] [--load S]

Needs root (the image is built with systemd-nspawn, like the VM tier's). Writes
bench/results/cold_vm.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_cold_systemd import CLIENT, LIB, STAMPED_MODEL  # noqa: E402

from tests.vm.qemu import keep, run_payload  # noqa: E402

RESULTS = REPO / "bench" / "results" / "cold_vm.txt"
PROVIDERS = {"coldgpu": 18310, "coldcpu": 18311}

# Runs inside the VM (systemd PID 1) from the payload disk at /ci, as root.
PAYLOAD = """\
import json, os, subprocess, sys, time
sys.path.insert(0, "/ci")
import run_tests as vm  # the VM tier's payload: its fake GPUs

ROUNDS, LOAD, LIB = int(sys.argv[1]), sys.argv[2], sys.argv[3]
PROVIDERS = json.loads(sys.argv[4])

def sh(cmd, timeout=600):
    return subprocess.run(["/bin/bash", "-c", cmd], capture_output=True, text=True, timeout=timeout)

def manifest(slug, port):
    gpu = '[gpu]\\ndevices = "auto"\\nvram_budget_gb = 1\\n' if slug == "coldgpu" else ""
    return (
        f'description = "cold-start bench"\\nenabled = false\\n[listen]\\naddress = "127.0.0.1:{port}"\\n'
        f'protocol = "http"\\n[runtime]\\ncommand = ["/usr/bin/python3", "{LIB}/model.py", "{{port}}", '
        f'"{LOAD}", "{{host}}"]\\nready = "tcp"\\nstart_timeout_s = 120\\nidle_timeout_s = 300\\n{gpu}'
    )

def stamps(slug, cursor):
    log = sh(f"journalctl -q -o cat --after-cursor='{cursor}' -u provider-worker@{slug}.service").stdout
    started = [float(l.split()[2]) for l in log.splitlines() if l.startswith("bench-model started ")]
    listens = [l.split()[2:4] for l in log.splitlines() if l.startswith("bench-model listens ")]
    return (started[-1], float(listens[-1][0]), float(listens[-1][1])) if started and listens else None

def cursor():
    out = sh("journalctl -n 0 --show-cursor -q").stdout
    return out.split("cursor: ")[-1].strip()

debs = sorted(f for f in os.listdir("/ci") if f.endswith(".deb"))
r = sh(f"apt-get install -y --no-install-recommends /ci/{debs[-1]}")
print(json.dumps({"check": "install", "rc": r.returncode, "err": r.stderr[-2000:]}), flush=True)
os.makedirs(vm.CI, exist_ok=True)
vm.setup_fake_gpus()
for f in os.listdir("/etc/providerd/providers"):
    os.remove(f"/etc/providerd/providers/{f}")  # only this bench's providers
os.makedirs(LIB, exist_ok=True)
for name in ("model.py", "client.py"):
    with open(f"/ci/{name}") as src, open(f"{LIB}/{name}", "w") as dst:
        dst.write(src.read())
    os.chmod(f"{LIB}/{name}", 0o755)
os.chmod(LIB, 0o755)
for slug, port in PROVIDERS.items():
    with open(f"/etc/providerd/providers/{slug}.toml", "w") as f:
        f.write(manifest(slug, port))
time.sleep(1.1)  # files changed within 1 s of the generator's run get no early-start record
r = sh("providerctl reload && systemctl start " + " ".join(f"provider@{s}.socket" for s in PROVIDERS))
print(json.dumps({"check": "reload", "rc": r.returncode, "out": r.stdout, "err": r.stderr}), flush=True)

MARKS = ("Starting provider", "Started provider", "Asked for", "Not asking", "Failed to ask",
         "Starting worker", "Started the model", "bench-model", "Worker ready")

def steps(slug, cursor):  # the round's journal lines that mark its steps
    log = sh(f"journalctl -q -o short-monotonic --after-cursor='{cursor}' "
             f"-u provider@{slug}.service -u provider-worker@{slug}.service").stdout
    lines = [l for l in log.splitlines() if any(m in l for m in MARKS)]
    return lines[:14]

def one(slug, port):
    c = cursor()
    r = sh(f"python3 {LIB}/client.py 1 {port} {slug} {LIB}/model.py {LOAD}")
    rounds = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    if not rounds:
        return {"error": r.stderr[-2000:]}
    return {**rounds[0], "stamps": stamps(slug, c), "steps": steps(slug, c)}

for slug, port in PROVIDERS.items():
    one(slug, port)  # warm-up: page cache, bytecode
for i in range(ROUNDS):
    for slug, port in PROVIDERS.items():
        print(json.dumps({"check": f"round-{i + 1}-{slug}", "slug": slug, "round": i + 1, **one(slug, port)}), flush=True)
journal = sh("journalctl -q -o short-monotonic -u 'provider@cold*.service' -u 'provider-worker@cold*.service' | tail -n 40").stdout
version = sh("systemctl --version | head -n 1").stdout.strip()
print(json.dumps({"check": "done", "journal": journal, "systemd": version, "kernel": os.uname().release}), flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deb", default=str(REPO / "dist" / "providerd_0.1.0_all.deb"))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--load", type=float, default=1.0, help="the model's own load time, s")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_cold_vm: needs root (systemd-nspawn, qemu)", file=sys.stderr)
        return 2
    deb = Path(args.deb).resolve()
    if not deb.is_file():
        print(f"bench_cold_vm: {deb} does not exist; run `make deb`", file=sys.stderr)
        return 2
    work = Path(f"/var/tmp/providerd-benchvm-{os.getpid()}")
    files = Path(tempfile.mkdtemp(prefix="providerd-benchvm-files-"))
    try:
        (files / "run-tests").write_text(
            "#!/bin/bash\nexec /usr/bin/python3 /ci/cold_vm.py "
            f"{args.rounds} {args.load:g} {LIB} '{json.dumps(PROVIDERS)}'\n"
        )
        (files / "run-tests").chmod(0o755)
        (files / "cold_vm.py").write_text(PAYLOAD)
        (files / "model.py").write_text(STAMPED_MODEL)
        (files / "client.py").write_text(CLIENT)
        payload = [
            files / "run-tests",
            files / "cold_vm.py",
            files / "model.py",
            files / "client.py",
            REPO / "tests" / "vm" / "payload" / "run_tests.py",
            REPO / "tests" / "gpu" / "cuda_worker.py",
            REPO / "tests" / "support",  # the helpers run_tests.py imports
            deb,
        ]
        # TCG on a busy host: a cold round has taken up to 40 s; the boot and install 150 s.
        timeout = 300 + args.rounds * len(PROVIDERS) * (args.load + 45)
        boot = run_payload(deb, payload, work, timeout)
    finally:
        shutil.rmtree(files, ignore_errors=True)
        if not keep():
            shutil.rmtree(work, ignore_errors=True)
    finished = "done" in boot.checks
    if not finished:
        print(
            f"bench_cold_vm: the VM payload did not finish (qemu exit {boot.qemu_rc}, "
            f"{boot.vm_s:.0f} s); the rounds it did:\n--- console\n{boot.console}",
            file=sys.stderr,
        )
        if not any(k.startswith("round-") for k in boot.checks):
            print(boot.results[-4000:], file=sys.stderr)
            return 1
    done = boot.checks.get("done", {"systemd": "systemd ?", "kernel": "?", "journal": ""})
    out = [
        f"Cold start in the VM tier (qemu TCG, {done['systemd']}, kernel {done['kernel']}), "
        f"model load {args.load:g} s, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        'coldgpu: devices = "auto" on two fake cards (the front decides: placement, worker.env, '
        "DeviceAllow=, StartUnit); coldcpu: the worker starts beside the front",
        f"{'round':>5} {'provider':>8} {'direct ms':>10} {'cold ms':>9} {'added ms':>9}"
        f"  {'to model':>8} {'model':>7} {'after':>6}",
    ]
    added: dict[str, list[float]] = {}
    parts: dict[str, list[tuple[float, float, float]]] = {}
    cpus: dict[str, list[tuple[float, float]]] = {}
    by_round: dict[int, dict[str, float]] = {}
    for i in range(args.rounds):
        for slug in PROVIDERS:
            x = boot.checks.get(f"round-{i + 1}-{slug}")
            if x is None or "cold" not in x:
                out.append(f"{i + 1:>5} {slug:>8} failed: {x}")
                continue
            a = (x["cold"] - x["direct"]) * 1000
            added.setdefault(slug, []).append(a)
            by_round.setdefault(i, {})[slug] = a
            split = ""
            if x.get("stamps"):
                started, listens, model_cpu = x["stamps"]
                worker_cpu, front_cpu = (x.get("cpu") or [None, None])[:2]
                if worker_cpu is not None and front_cpu is not None:
                    cpus.setdefault(slug, []).append(
                        ((worker_cpu - model_cpu) * 1000, front_cpu * 1000)
                    )
                end = x["t0"] + x["cold"]
                p = ((started - x["t0"]) * 1000, (listens - started) * 1000, (end - listens) * 1000)
                parts.setdefault(slug, []).append(p)
                split = f"  {p[0]:>8.1f} {p[1]:>7.1f} {p[2]:>6.1f}"
            out.append(
                f"{i + 1:>5} {slug:>8} {x['direct'] * 1000:>10.1f} {x['cold'] * 1000:>9.1f} "
                f"{a:>9.1f}{split}"
            )
    # What the GPU decision costs beyond a CPU start, round by round in the same VM: the
    # front's decision (placement, worker.env, DeviceAllow=, StartUnit) against systemd
    # starting the worker beside the front.
    gpu_over = [r["coldgpu"] - r["coldcpu"] for r in by_round.values() if len(r) == 2]
    if gpu_over:
        out.append(
            "coldgpu - coldcpu added, per round: "
            + ", ".join(f"{d:+.1f}" for d in gpu_over)
            + f" ms (median {statistics.median(gpu_over):+.1f} ms)"
        )
    for slug, values in added.items():
        target = " (target: median <= 60 ms)" if slug == "coldgpu" else ""
        medians = [statistics.median(p[i] for p in parts.get(slug, [(0, 0, 0)])) for i in range(3)]
        out.append(
            f"{slug}: added median {statistics.median(values):.1f} ms, min {min(values):.1f}, "
            f"max {max(values):.1f}{target}; to model {medians[0]:.1f} ms, model "
            f"{medians[1]:.1f} ms, after {medians[2]:.1f} ms"
        )
    for slug, cs in cpus.items():
        out.append(
            f"{slug} CPU: worker unit beyond the model's own {statistics.median(c[0] for c in cs):.1f} ms, "
            f"front unit {statistics.median(c[1] for c in cs):.1f} ms (medians; cgroup CPUUsageNSec)"
        )
    out.append(f"VM boot and payload {boot.vm_s:.0f} s; each provider's last round (monotonic s):")
    for slug in PROVIDERS:
        last = boot.checks.get(f"round-{args.rounds}-{slug}") or {}
        out += [f"  {line}" for line in last.get("steps", [])]
    text = "\n".join(out) + "\n"
    print(text, end="")
    if not args.no_write and finished:
        RESULTS.write_text(text)
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
