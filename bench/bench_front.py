"""What the front adds to a cold start, and what it costs to hold 1,000 connections.

Cold start, for a worker that is ready at once (a minimal Python listener):
  direct: launch the worker → its port accepts (polled every 0.2 ms) → first response byte;
  front:  `providerctl serve` running, provider idle → connect and send a request → first byte.
The overhead is the difference of the medians (the target is ≤ 10 ms). Between rounds the
provider is released with `providerctl stop`, so each round is a real cold start
(front → worker wrapper → model → readiness → proxy).

Memory: the serve process's RSS while 1,000 requests are held waiting for a worker that
takes 3 s to load (it does not listen before), compared with its RSS idle: GETs, then
POSTs of 1 MiB whose clients have sent 300 KB (the front reads ahead at most HELD_MAX of a
held body; the rest waits in the kernel's socket buffers, and the client's).

    python3 bench/bench_front.py [--runs N]

Foreground mode (no systemd here); writes bench/results/front.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "front.txt"

WORKER = (  # listens after argv[2] seconds (its load), then answers every request
    "import socket, sys, time\n"
    "time.sleep(float(sys.argv[2]))\n"
    "s = socket.socket()\n"
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1])))\n"
    "s.listen(1024)\n"
    "while True:\n"
    "    c, _ = s.accept()\n"
    "    c.recv(65536)\n"
    "    c.sendall(b'HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok')\n"
    "    c.close()\n"
)
REQUEST = b"GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def first_byte(port: int, timeout: float = 30) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        c.sendall(REQUEST)
        if not c.recv(1):
            raise RuntimeError("closed without an answer")


def direct(worker: Path) -> float:
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(worker), str(port), "0"])
    try:
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.0002)
        first_byte(port)
        return time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait()


class Served:
    def __init__(
        self, tmp: Path, worker: Path, port: int, delay: float, max_held: int = 2000
    ) -> None:
        self.mdir = tmp / f"m{port}"
        self.mdir.mkdir(mode=0o755)
        (self.mdir / "bench.toml").write_text(
            f"""[listen]
address = "127.0.0.1:{port}"
max_held = {max_held}
[runtime]
command = ["{{python}}", "{worker}", "{{port}}", "{delay}"]
ready = "tcp"
start_timeout_s = 60
idle_timeout_s = 600
"""
        )
        self.env = {
            **os.environ,
            "PROVIDERD_RUNTIME_DIR": str(tmp / f"run{port}"),
            "PROVIDERD_TRUSTED_UID": str(os.getuid()),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "serve", str(self.mdir)],
            env=self.env,
            cwd=REPO,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("providerctl serve did not listen")
            time.sleep(0.05)

    def ctl(self, *args: str) -> None:
        subprocess.run(
            [sys.executable, "-m", "agent", *args],
            env=self.env,
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
        )

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def cold(served: Served, port: int) -> float:
    served.ctl("stop", "bench")
    t0 = time.perf_counter()
    first_byte(port)
    return time.perf_counter() - t0


HELD_BODY = 300_000  # of a 1 MiB upload, sent before the front stops reading


def held_memory(tmp: Path, worker: Path, n: int, body: bool) -> tuple[int, int]:
    """The serve process's RSS idle, then holding `n` requests while the worker loads:
    each a GET, or (`body`) a POST of 1 MiB whose client sent its head and what the kernel
    took of HELD_BODY bytes before the front stopped reading it."""
    port = free_port()
    served = Served(tmp, worker, port, 3.0, max_held=n + 100)  # every one held, none refused
    if body:
        request = (
            b"POST / HTTP/1.1\r\nHost: bench\r\nContent-Length: %d\r\n\r\n" % (1 << 20)
            + b"x" * HELD_BODY
        )
    else:
        request = REQUEST
    try:
        time.sleep(0.5)
        idle = served.rss()
        clients = []
        for _ in range(n):
            c = socket.create_connection(("127.0.0.1", port))
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sent = 0
                while sent < len(request):
                    sent += c.send(request[sent:])
            clients.append(c)
        time.sleep(1.0)  # all accepted and held; the worker is still loading
        holding = served.rss()
        for c in clients:
            with contextlib.suppress(OSError):
                c.setblocking(True)
                c.settimeout(30)
                c.recv(1)
            c.close()
        return idle, holding
    finally:
        served.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--held", type=int, default=1000)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(8192, 2 * args.held + 1024)  # both ends of every held connection, and room
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, want)), hard))

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        worker = tmp / "worker.py"
        worker.write_text(WORKER)
        port = free_port()
        served = Served(tmp, worker, port, 0.0)
        directs, fronts = [], []
        try:
            first_byte(port)  # warm the page cache and byte-code
            for _ in range(args.runs):
                directs.append(direct(worker))
                fronts.append(cold(served, port))
        finally:
            served.close()
        held = {body: held_memory(tmp, worker, args.held, body) for body in (False, True)}

    d50, f50 = statistics.median(directs), statistics.median(fronts)
    lines = [
        f"# providerd front: cold start and held connections ({time.strftime('%Y-%m-%d')})",
        f"# {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{args.runs} rounds, foreground mode",
        "",
        "cold start, worker ready at once           p50        p90",
        f"  direct (launch → first byte)       {d50 * 1000:8.1f} ms {sorted(directs)[int(0.9 * len(directs))] * 1000:8.1f} ms",
        f"  through the front (cold)           {f50 * 1000:8.1f} ms {sorted(fronts)[int(0.9 * len(fronts))] * 1000:8.1f} ms",
        f"  overhead the front adds            {(f50 - d50) * 1000:8.1f} ms   (target ≤ 10 ms)",
        "",
        f"memory of `providerctl serve` holding {args.held} requests during a load",
        "(its RSS growth; the held read-ahead of a body is agent.net.exchange.HELD_MAX)",
    ]
    for body, (idle_rss, held_rss) in held.items():
        what = f"POST of 1 MiB, {HELD_BODY:,} B sent" if body else "GET"
        per = (held_rss - idle_rss) / args.held
        lines += [
            f"  {what}: idle {idle_rss / 2**20:.1f} MiB, holding {held_rss / 2**20:.1f} MiB",
            f"    per held request               {per:8,.0f} B   (target ≤ 8,192 B)",
        ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
