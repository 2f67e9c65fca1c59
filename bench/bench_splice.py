#!/usr/bin/env python3
"""Where splicing a body pays: the front's data path with splice off and on, body by body.

One run on this machine, loopback only. A backend (a thread per connection) answers
`GET /n/SIZE` with SIZE bytes and reads `POST` bodies of any length; two processes run
the front's data path (agent.net, as bench_proxy.py runs it) to it, one that never splices
(agent.net.splice.SPLICE_MIN beyond any body) and one that splices every Content-Length
body. For each body size, keep-alive requests each way, the two paths taking turns: the
rate, and the CPU the proxy process spends per MiB relayed (its scheduler's run time,
/proc/PID/task/*/schedstat, in ns: kernel and user). SPLICE_MIN is where "on" stops
costing more CPU than "off". Writes bench/results/splice.txt.

    python3 bench/bench_splice.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_proxy import spawn_activated
from common import ROOT, drain, listener, next_head, wait_listening

KIB = 1024
SIZES = [128 * KIB, 256 * KIB, 384 * KIB, 512 * KIB, 1024 * KIB, 4096 * KIB, 16384 * KIB]
NEVER = 1 << 62


def backend(sock: socket.socket) -> None:
    chunk = memoryview(bytes(4 * 1024 * KIB))
    sink = bytearray(1024 * KIB)

    def serve(conn: socket.socket) -> None:
        pending = b""
        with conn:
            while True:
                got = next_head(conn, pending)
                if got is None:
                    return
                head, pending = got
                size = int(head.split(b" ")[1].rsplit(b"/", 1)[1])
                if head.startswith(b"GET"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
                    left = size
                    while left:
                        n = min(left, len(chunk))
                        conn.sendall(chunk[:n])
                        left -= n
                    continue
                left, pending = size - len(pending), b""
                if not drain(conn, sink, left):
                    return
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    while True:
        conn, _ = sock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def proxy_main(backend_port: int, splice_min: int) -> None:
    sys.path.insert(0, str(ROOT))
    from common import always_ready_front

    from agent.net import splice

    splice.SPLICE_MIN = splice_min
    always_ready_front(backend_port)


def cpu_s(pid: int) -> float:
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return sum(int((t / "schedstat").read_text().split()[0]) for t in tasks) / 1e9


def read_n(sock: socket.socket, n: int, buf: bytearray) -> None:
    view = memoryview(buf)
    while n:
        k = sock.recv_into(view[: min(len(buf), n)])
        if not k:
            raise ConnectionError("cut short")
        n -= k


def read_head(sock: socket.socket) -> None:
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += sock.recv(1)


def one_way(port: int, size: int, reps: int, up: bool) -> float:
    """Seconds per request, median."""
    buf = bytearray(1024 * KIB)
    body = bytes(size)
    out = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(reps):
            t = time.perf_counter()
            if up:
                head = b"POST /n/%d HTTP/1.1\r\nHost: b\r\nContent-Length: %d\r\n\r\n"
                sock.sendall(head % (size, size))
                sock.sendall(body)
                read_head(sock)
                read_n(sock, 2, buf)
            else:
                sock.sendall(b"GET /n/%d HTTP/1.1\r\nHost: b\r\n\r\n" % size)
                read_head(sock)
                read_n(sock, size, buf)
            out.append(time.perf_counter() - t)
    return statistics.median(out)


def run(quick: bool) -> str:
    rounds = 3 if quick else 5
    volume = (64 if quick else 256) * 1024 * KIB  # bytes each way, per size and round
    back = listener()
    threading.Thread(target=backend, args=(back,), daemon=True).start()
    port = back.getsockname()[1]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    ports: dict[str, int] = {}
    try:
        for name, minimum in (("off", NEVER), ("on", 1)):
            sock = listener()
            argv = [sys.executable, __file__, "--role", "proxy", "--backend-port", str(port)]
            procs[name] = spawn_activated([*argv, "--splice-min", str(minimum)], sock)
            ports[name] = sock.getsockname()[1]
        for name in procs:
            wait_listening(lambda name=name: one_way(ports[name], 1, 1, False))
        rows = []
        for size in SIZES:
            reps = max(4, volume // size)
            got: dict[tuple[str, str], list[float]] = {}
            for _ in range(rounds):
                for name in ("off", "on"):
                    for way in ("down", "up"):
                        pid = procs[name].pid
                        before = cpu_s(pid)
                        per = one_way(ports[name], size, reps, way == "up")
                        cpu = (cpu_s(pid) - before) / (size * reps / (1024 * KIB))
                        got.setdefault((name, way), []).append(size / per / 1e6)
                        got.setdefault((name, way + " cpu"), []).append(cpu * 1e6)
            rows.append((size, {k: statistics.median(v) for k, v in got.items()}))
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            proc.wait(timeout=5)
    return table(rows, rounds)


def table(rows: list[tuple[int, dict[tuple[str, str], float]]], rounds: int) -> str:
    lines = [
        f"providerd body splicing — {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, "
        f"Linux {platform.release()}, Python {platform.python_version()}, loopback TCP.",
        "off = the transports always; on = every Content-Length body spliced (agent.net.splice).",
        f"Keep-alive requests, medians of {rounds} interleaved rounds; CPU = the proxy process's",
        "run time per MiB relayed (schedstat). Where on's CPU stops exceeding off's: SPLICE_MIN.",
        "",
        "{:>10} {:>9} {:>9} {:>10} {:>10} {:>9} {:>9} {:>10} {:>10}".format(
            "body",
            "down off",
            "down on",
            "cpu off",
            "cpu on",
            "up off",
            "up on",
            "cpu off",
            "cpu on",
        ),
        "{:>10} {:>9} {:>9} {:>10} {:>10} {:>9} {:>9} {:>10} {:>10}".format(
            "(KiB)",
            "(MB/s)",
            "(MB/s)",
            "(µs/MiB)",
            "(µs/MiB)",
            "(MB/s)",
            "(MB/s)",
            "(µs/MiB)",
            "(µs/MiB)",
        ),
    ]
    for size, m in rows:
        lines.append(
            "{:>10} {:>9.0f} {:>9.0f} {:>10.0f} {:>10.0f} {:>9.0f} {:>9.0f} {:>10.0f} {:>10.0f}".format(
                size // KIB,
                m[("off", "down")],
                m[("on", "down")],
                m[("off", "down cpu")],
                m[("on", "down cpu")],
                m[("off", "up")],
                m[("on", "up")],
                m[("off", "up cpu")],
                m[("on", "up cpu")],
            )
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument("--role", choices=("proxy",), help=argparse.SUPPRESS)
    parser.add_argument("--backend-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--splice-min", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "splice.txt"))
    args = parser.parse_args(argv)
    if args.role:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        proxy_main(args.backend_port, args.splice_min)
        return 0
    text = run(args.quick)
    print(text, end="")
    if not args.quick:
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
