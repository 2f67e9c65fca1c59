"""How long the generator takes for many manifests.

Writes N manifests (default 500) into a temporary manifest directory, then runs
the generator as systemd does (a fresh python3 process, argv = output dirs) and
in-process, and prints the times. The target is well under one second for 500.
The output goes to a tmpfs (/dev/shm) where there is one, as /run/systemd/generator
is a tmpfs; the manifests stay on disk, as /etc is.

    python3 bench/bench_generator.py [N] [--runs R]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent import generator  # noqa: E402

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


def write_manifests(directory: Path, n: int) -> None:
    directory.mkdir(mode=0o755)
    for i in range(n):
        path = directory / f"bench_{i:04d}.toml"
        path.write_text(MANIFEST.format(i=i, hi=i // 250, lo=i % 250 + 1, port=10000 + i))
        path.chmod(0o644)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int, nargs="?", default=500)
    ap.add_argument("--runs", type=int, default=5)
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
                    "import sys; from agent.generator import main; sys.exit(main(sys.argv[1:]))",
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
