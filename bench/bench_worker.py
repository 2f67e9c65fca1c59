"""What the worker wrapper adds to a model's start.

For a model that is ready at once, compares
  direct:  launching the model  → its port accepts (polled every 0.2 ms), and
  wrapped: launching `python3 -m agent.worker … -- <model>` → READY=1 on NOTIFY_SOCKET,
runs alternating, and prints the medians (p50) and their difference. Two models: a
minimal Python listener and the demo model (`agent.demo`), the latter also with an
HTTP readiness probe. For scale it prints the bare interpreter start and the
wrapper's own start (`--help`: interpreter + imports). Writes bench/results/worker.txt.

    python3 bench/bench_worker.py [--runs N] [--python PATH]

The interpreter is /usr/bin/python3 (as in the unit files) unless --python says
otherwise; byte-code is compiled first, as an installed package has it.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "worker.txt"

MINIMAL = (
    "import socket, sys, time\n"
    "s = socket.socket()\n"
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1])))\n"
    "s.listen(16)\n"
    "time.sleep(3600)\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env() -> dict[str, str]:
    e = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "NOTIFY_SOCKET")
    }
    e["PYTHONPATH"] = str(REPO)
    return e


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def direct(argv: list[str], port: int) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env(), stderr=subprocess.DEVNULL)
    try:
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return time.perf_counter() - t0
            if proc.poll() is not None:
                raise SystemExit(f"bench_worker: the model exited with {proc.returncode}")
            time.sleep(0.0002)
    finally:
        stop(proc)


def wrapped(python: str, ready: str, argv: list[str], port: int, tmp: Path) -> float:
    path = tmp / f"notify-{port}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as n:
        n.bind(str(path))
        n.settimeout(30)
        e = {**env(), "NOTIFY_SOCKET": str(path), "PROVIDERD_WORKER_PORT": str(port)}
        cmd = [python, "-m", "agent.worker", "--slug", "bench", "--ready", ready, "--", *argv]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=e, stderr=subprocess.DEVNULL)
        try:
            while b"READY=1" not in n.recv(4096).split(b"\n"):
                pass
            return time.perf_counter() - t0
        finally:
            stop(proc)
            path.unlink()


def run_once(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=env(), check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def p50_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    default = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    ap.add_argument("--python", default=default)
    args = ap.parse_args()
    py = args.python
    subprocess.run([py, "-m", "compileall", "-q", str(REPO / "agent")], env=env(), check=True)

    cases: list[tuple[str, str, Callable[[int], list[str]]]] = [
        ("minimal listener", "tcp", lambda port: [py, "-c", MINIMAL, str(port)]),
        (
            "demo model",
            "tcp",
            lambda port: [py, "-m", "agent.demo", "--port", str(port), "--dim", "8"],
        ),
        (
            "demo model",
            "http:/health",
            lambda port: [py, "-m", "agent.demo", "--port", str(port), "--dim", "8"],
        ),
    ]
    lines = [
        f"bench_worker: {args.runs} runs each, p50, {py} ({platform.python_version()}), "
        f"{os.cpu_count()} CPUs, {platform.machine()}, load average {os.getloadavg()[0]:.2f}",
        f"  interpreter start (python3 -c pass):          {p50_ms([run_once([py, '-c', 'pass']) for _ in range(args.runs)]):7.1f} ms",
        f"  wrapper start (python3 -m agent.worker --help): {p50_ms([run_once([py, '-m', 'agent.worker', '--help']) for _ in range(args.runs)]):5.1f} ms",
        "",
        f"  {'model':<18} {'ready':<13} {'direct':>9} {'wrapped':>9} {'added':>9}",
    ]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, ready, make in cases:
            d: list[float] = []
            w: list[float] = []
            wrapped(py, ready, make(port := free_port()), port, Path(tmp))  # warm-up
            for _ in range(args.runs):
                port = free_port()
                d.append(direct(make(port), port))
                port = free_port()
                w.append(wrapped(py, ready, make(port), port, Path(tmp)))
            line = (
                f"  {name:<18} {ready:<13} {p50_ms(d):7.1f} ms {p50_ms(w):6.1f} ms "
                f"{p50_ms(w) - p50_ms(d):+6.1f} ms"
            )
            print(line, flush=True)
            lines.append(line)
    lines += [
        "",
        "  direct: launch → port accepts (polled every 0.2 ms); wrapped: launch the wrapper →",
        "  READY=1 on NOTIFY_SOCKET. added = wrapped - direct, medians.",
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"  (written to {RESULTS.relative_to(REPO)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
