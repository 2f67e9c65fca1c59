"""How long the generator takes for many manifests.

Writes N manifests (default 500) into a temporary manifest directory, then runs
the generator as systemd does (a fresh python3 process, argv = output dirs) and
in-process, and prints the times. The target is well under one second for 500.
The output goes to a tmpfs (/dev/shm) where there is one, as /run/systemd/generator
is a tmpfs; the manifests stay on disk, as /etc is.

Then the large cases, each timed as systemd runs the generator (and `providerctl
check` for the single big manifest): 10,000 manifests with model names and
patterns (target: well under systemd's 90 s generator timeout), one 1 MiB manifest
with 40,000 model names (target: under 1 s), and patterns that backtrack for ever in
Python's `re` checked against the longest names a manifest may hold. `--no-large`
skips them.

    python3 bench/bench_generator.py [N] [--runs R] [--large-n M] [--no-large]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.systemd import generator  # noqa: E402

MANIFEST = """\
description = "Benchmark provider {i}"
[listen]
address = "127.0.{hi}.{lo}:{port}"
allow = ["10.0.0.0/8"]
[runtime]
command = ["/opt/model/serve", "--port", "{{port}}", "--name", "bench {i} 100%"]
ready = "http:/health"
idle_timeout_s = 300
idle_ignore_paths = ["/health"]
[runtime.environment]
HF_HOME = "/var/cache/hf"
[limits]
memory_max = "16G"
tasks_max = 256
[gpu]
vram_budget_gb = 8
[models]
names = ["bench-{i}"]
"""


def write_manifests(directory: Path, n: int, models: bool = False) -> None:
    """`n` manifests; with `models`, each with two exact names and two patterns, and one
    in a hundred with a pattern without a literal prefix (tried against every name)."""
    directory.mkdir(mode=0o755)
    for i in range(n):
        path = directory / f"bench_{i:05d}.toml"
        text = MANIFEST.format(i=i, hi=i // 250, lo=i % 250 + 1, port=10000 + i % 50000)
        if models:
            text = text.replace(
                f'names = ["bench-{i}"]',
                f'names = ["bench-{i}", "bench-{i}-instruct"]\n'
                f'patterns = ["bench-{i}-q[0-9]+", "{".*-only-" if i % 100 == 0 else "bench-"}{i}-v.*"]',
            )
        path.write_text(text)
        path.chmod(0o644)


def run_generator(mdir: Path, out: Path) -> tuple[float, str]:
    """One generator run as systemd does it; its time and what it logged."""
    env = dict(
        os.environ, PROVIDERD_MANIFEST_DIRS=str(mdir), PROVIDERD_TRUSTED_UID=str(os.getuid())
    )
    env["PROVIDERD_CONFIG"] = str(mdir / "absent-providerd.toml")
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-c", "import sys; from agent.systemd.generator import main; sys.exit(main(sys.argv[1:]))", str(out)],
        cwd=REPO, env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return time.perf_counter() - t0, r.stderr


def cpu_seconds() -> float:
    """CPU time of the finished child processes so far (the machine may be shared)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_check(path: Path) -> tuple[float, int]:
    env = dict(os.environ, PROVIDERD_TRUSTED_UID=str(os.getuid()))
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "agent", "check", str(path)],
        cwd=REPO, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    return time.perf_counter() - t0, r.returncode


def large_cases(tmp: Path, shm: str | None, n: int) -> int:
    status = 0
    with tempfile.TemporaryDirectory(dir=shm) as outdir:
        mdir = tmp / "many"
        write_manifests(mdir, n, models=True)
        size = sum(p.stat().st_size for p in mdir.iterdir())
        cpu0 = cpu_seconds()
        secs, logged = run_generator(mdir, Path(outdir) / "many")
        cpu = cpu_seconds() - cpu0
        made = len(list((Path(outdir) / "many").glob("provider@*.socket.d")))
        print(
            f"{n} manifests with names and patterns ({size >> 20} MiB): generator {secs:.2f} s "
            f"({cpu:.2f} s CPU; {secs / 90:.3f} of systemd's 90 s generator timeout), "
            f"{made} providers generated"
        )
        if logged or made != n:
            print(logged[:2000], file=sys.stderr)
            status = 1

        big = tmp / "big"
        big.mkdir(mode=0o755)
        names = ", ".join(f'"model-{i:05d}-{"x" * 10}"' for i in range(40000))
        one = big / "big.toml"
        one.write_text(
            '[listen]\naddress = "127.0.0.1:9000"\n[runtime]\ncommand = ["/opt/serve"]\n'
            f'[models]\nnames = [{names}]\npatterns = ["model-[0-9]+-y+", ".*-z"]\n'
        )
        one.chmod(0o644)
        mib = one.stat().st_size / (1 << 20)
        check_s, rc = run_check(one)
        secs, logged = run_generator(big, Path(outdir) / "big")
        print(
            f"one manifest of {mib:.2f} MiB with 40,000 model names: providerctl check {check_s:.2f} s "
            f"(exit {rc}), generator {secs:.2f} s (target: under 1 s)"
        )
        if rc != 0 or logged:
            print(logged[:2000], file=sys.stderr)
            status = 1

        evil = tmp / "evil"
        evil.mkdir(mode=0o755)
        long_name = "llama-" + "-" * 250  # the longest name a manifest may hold (256)
        for i, (names_, patterns) in enumerate(
            [
                ([long_name, "a" * 256], []),
                ([], ["llama-.*-.*-instruct", "(a+)+b", "(a|aa)+$", ".*.*.*.*.*.*x"]),
            ]
        ):
            (evil / f"e{i}.toml").write_text(
                f'[listen]\naddress = "127.0.0.1:{9100 + i}"\n[runtime]\ncommand = ["/opt/serve"]\n'
                f"[models]\nnames = {json.dumps(names_)}\npatterns = {json.dumps(patterns)}\n"
            )
            (evil / f"e{i}.toml").chmod(0o644)
        secs, logged = run_generator(evil, Path(outdir) / "evil")
        print(
            f"patterns that backtrack for ever in re against 256-character names: generator {secs:.2f} s"
        )
        (evil / "e2.toml").write_text(
            '[listen]\naddress = "127.0.0.1:9102"\n[runtime]\ncommand = ["/opt/serve"]\n'
            f'[models]\nnames = ["{"x" * 40000}"]\n'
        )
        (evil / "e2.toml").chmod(0o644)
        check_s, rc = run_check(evil / "e2.toml")
        print(f"a 40 KB model name: refused by providerctl check in {check_s:.2f} s (exit {rc})")
    return status


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int, nargs="?", default=500)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--large-n", type=int, default=10000)
    ap.add_argument("--no-large", action="store_true")
    args = ap.parse_args()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=shm) as outdir:
        mdir = Path(tmp) / "providers"
        root = Path(outdir)
        write_manifests(mdir, args.n)
        env = dict(
            os.environ, PROVIDERD_MANIFEST_DIRS=str(mdir), PROVIDERD_TRUSTED_UID=str(os.getuid())
        )
        os.environ.update(env)

        process: list[float] = []
        for r in range(args.runs):
            out = root / f"process-{r}"
            t0 = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import sys; from agent.systemd.generator import main; sys.exit(main(sys.argv[1:]))",
                    str(out),
                    str(out),
                    str(out),
                ],
                cwd=REPO,
                env=env,
                check=True,
            )
            process.append(time.perf_counter() - t0)
        files = sum(len(f) for _, _, f in os.walk(root / "process-0"))

        inproc: list[float] = []
        for r in range(args.runs):
            out = root / f"inproc-{r}"
            log = generator.Log(kmsg="/nonexistent", fallback=io.StringIO())
            t0 = time.perf_counter()
            generator.main([str(out)], log)
            inproc.append(time.perf_counter() - t0)
        if log.fallback.getvalue():  # type: ignore[attr-defined]
            print(log.fallback.getvalue(), file=sys.stderr)  # type: ignore[attr-defined]
            return 1

        startup: list[float] = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], check=True)
            startup.append(time.perf_counter() - t0)

    p, i, s = statistics.median(process), statistics.median(inproc), statistics.median(startup)
    print(
        f"manifests: {args.n}, files written: {files} to {shm or 'a temporary directory'}, runs: {args.runs} (medians)"
    )
    print(
        f"generator as systemd runs it (new python3): {p * 1000:.0f} ms ({p / 1.0:.2f} of the 1 s budget)"
    )
    print(
        f"generator in-process:                        {i * 1000:.0f} ms ({i / args.n * 1e6:.0f} us per manifest)"
    )
    print(f"bare python3 start, for comparison:          {s * 1000:.0f} ms")
    if args.no_large:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        return large_cases(Path(tmp), shm, args.large_n)


if __name__ == "__main__":
    sys.exit(main())
