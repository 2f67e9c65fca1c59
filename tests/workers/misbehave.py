#!/usr/bin/env python3
"""A real HTTP worker with misbehaviour switches, for tests. Standard library only.

    python3 misbehave.py [--port N | --unix PATH] [--host H] [switches...] [-- ARG...]

Used by the front's integration tests and by the container and VM tiers: keep this
command line stable.

Where it listens
    --port N            TCP port (default: $PROVIDERD_WORKER_PORT)
    --host H            address (default 127.0.0.1; IPv6 allowed)
    --unix PATH         listen on a unix stream socket instead (an old file is removed)
    --backlog N         listen queue size (default 1024; Python's own default is 5)

Start
    --pid-file PATH     write the pid there first thing
    --start-delay S     sleep S seconds before anything below
    --exit-at-start C   after the start delay, exit with status C without listening
    --never-listen      after the start delay, never listen (sleep until signalled)
    --never-ready       listen, but GET /health answers 503 forever (and no --notify)
    --ready-after S     listen, but GET /health answers 503 until S seconds after the
                        start (--notify then waits as long)
    --notify            once listening, send READY=1 to $NOTIFY_SOCKET itself
    --memory-mb M       hold M MiB, every page touched, from the start
    --grow-mb-per-s R   then grow by R MiB per second, touched, until killed

Stop and crash
    --ignore-sigterm    SIGTERM is ignored (SIGINT still ends it)
    --term-exit C       exit status on SIGTERM/SIGINT (default 0)
    --crash-after N     exit with status 3 right after answering the Nth request
                        (requests to /health and /pid do not count)

Slowness
    --slow-read         read request bodies slowly: --read-rate bytes per second
    --read-rate B       (default 65536), in 4 KiB pieces
    --slow-body S       send answers in --body-chunks pieces (default 10) spread over S
    --body-chunks N     seconds: the first piece at once, the last after S seconds. Echo
                        answers keep their Content-Length; /stream is chunked
    --work S            take S seconds over each echo answer (before its first byte)

Echo
    --echo-env A,B      GET /env answers {"A": value or null, ...}
    --echo-argv         GET /argv answers sys.argv (ARGs after -- included)

Endpoints: GET /conns ({"open": N, "peak": N}: connections that carried a request other
than /health, /pid or /conns, open now and at most at once),
GET /health (200 {"status": "ok"}, or 503 {"status": "loading"}),
GET /pid ({"pid": N}), GET /env and /argv (above), GET /stream?chunks=N&delay=S
(chunked: N lines "chunk i", S seconds apart; by default --body-chunks lines spread
over the --slow-body time, or 0.1 s apart without it), /bytes?n=N (any method: N bytes of
`pattern(N)` with a Content-Length; --slow-body spreads them too); any other method and
path answers {"method", "path", "body_length", "sha256", "pid"} after reading the whole
body (sha256: of the body, hex).
Log lines on stderr start with "misbehave:". HTTP/1.1 with keep-alive.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import ThreadingUnixStreamServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

CRASH_STATUS = 3
READY_AT = 0.0  # time.monotonic() from which /health answers 200
UNCOUNTED = ("/health", "/pid", "/conns")
BLOCK = 65536


def pattern(n: int) -> bytes:
    """n bytes that no reordering, loss or repetition of blocks leaves unchanged: each
    64 KiB block begins with its number."""
    rest = bytes((i * 7 + 3) % 251 for i in range(BLOCK - 8))
    out = bytearray()
    i = 0
    while len(out) < n:
        out += i.to_bytes(8, "big") + rest
        i += 1
    return bytes(out[:n])


def log(line: str) -> None:
    print(f"misbehave: {line}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="misbehave.py", description="A test worker.")
    p.add_argument("--port", type=int, default=int(os.environ.get("PROVIDERD_WORKER_PORT", "0")))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--unix")
    p.add_argument("--backlog", type=int, default=1024)
    p.add_argument("--work", type=float, default=0.0)
    p.add_argument("--pid-file")
    p.add_argument("--start-delay", type=float, default=0.0)
    p.add_argument("--exit-at-start", type=int)
    p.add_argument("--never-listen", action="store_true")
    p.add_argument("--never-ready", action="store_true")
    p.add_argument("--ready-after", type=float, default=0.0)
    p.add_argument("--notify", action="store_true")
    p.add_argument("--memory-mb", type=int, default=0)
    p.add_argument("--grow-mb-per-s", type=float, default=0.0)
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--term-exit", type=int, default=0)
    p.add_argument("--crash-after", type=int)
    p.add_argument("--slow-read", action="store_true")
    p.add_argument("--read-rate", type=int, default=65536)
    p.add_argument("--slow-body", type=float)
    p.add_argument("--body-chunks", type=int, default=10)
    p.add_argument("--echo-env", default=None)
    p.add_argument("--echo-argv", action="store_true")
    p.add_argument("extra", nargs="*", help="ignored; GET /argv shows them")
    args = p.parse_args(argv)
    if args.unix is None and not 0 < args.port < 65536:
        p.error("give --port N (or set PROVIDERD_WORKER_PORT) or --unix PATH")
    return args


def sd_notify(state: str) -> bool:
    address = os.environ.get("NOTIFY_SOCKET", "")
    if address.startswith("@"):
        address = "\0" + address[1:]
    if not address:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(state.encode(), address)
    return True


def notify_when_ready(where: str) -> None:
    sd_notify("STATUS=misbehave loading")
    time.sleep(max(0.0, READY_AT - time.monotonic()))
    sd_notify(f"READY=1\nSTATUS=misbehave serving on {where}")


class Memory:
    """Touched memory: `mb` MiB now, then `grow` MiB per second in a thread."""

    def __init__(self, mb: int, grow: float) -> None:
        self.blocks: list[bytearray] = []
        self.add(mb)
        if grow > 0:
            threading.Thread(target=self.grow, args=(grow,), daemon=True).start()

    def add(self, mb: int) -> None:
        block = bytearray(mb << 20)
        block[::4096] = b"\x01" * len(range(0, len(block), 4096))
        self.blocks.append(block)

    def grow(self, rate: float) -> None:
        step = max(1, int(rate / 10))
        while True:
            time.sleep(step / rate)
            self.add(step)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "misbehave"
    sys_version = ""
    disable_nagle_algorithm = True
    args: argparse.Namespace
    lock = threading.Lock()
    counted = 0
    open_now = 0
    peak = 0

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        if isinstance(self.request, socket.socket) and self.request.family == socket.AF_UNIX:
            self.disable_nagle_algorithm = False
        self.seen = False  # this connection carried a counted request
        super().setup()

    def finish(self) -> None:
        if self.seen:
            with Handler.lock:
                Handler.open_now -= 1
        super().finish()

    def do_GET(self) -> None:
        self.handle_any()

    def do_POST(self) -> None:
        self.handle_any()

    def do_PUT(self) -> None:
        self.handle_any()

    def do_DELETE(self) -> None:
        self.handle_any()

    def handle_any(self) -> None:
        a = self.args
        url = urlsplit(self.path)
        if url.path not in UNCOUNTED and not self.seen:
            self.seen = True
            with Handler.lock:
                Handler.open_now += 1
                Handler.peak = max(Handler.peak, Handler.open_now)
        self.digest = hashlib.sha256()
        length = self.read_body()
        if self.command == "GET" and url.path == "/health":
            if a.never_ready or time.monotonic() < READY_AT:
                self.send_json(503, {"status": "loading"})
            else:
                self.send_json(200, {"status": "ok"})
        elif self.command == "GET" and url.path == "/conns":
            self.send_json(200, {"open": Handler.open_now, "peak": Handler.peak})
        elif self.command == "GET" and url.path == "/pid":
            self.send_json(200, {"pid": os.getpid()})
        elif self.command == "GET" and url.path == "/env" and a.echo_env is not None:
            names = [n for n in a.echo_env.split(",") if n]
            self.send_json(200, {n: os.environ.get(n) for n in names})
        elif self.command == "GET" and url.path == "/argv" and a.echo_argv:
            self.send_json(200, sys.argv)
        elif self.command == "GET" and url.path == "/stream":
            query = parse_qs(url.query)
            chunks = int(query.get("chunks", [a.body_chunks])[0])
            gap = 0.1 if a.slow_body is None else a.slow_body / max(1, chunks - 1)
            self.stream(chunks, float(query.get("delay", [gap])[0]))
        elif url.path == "/bytes":
            self.send_bytes(pattern(int(parse_qs(url.query).get("n", ["0"])[0])))
        else:
            time.sleep(a.work)
            echo = {"method": self.command, "path": self.path, "body_length": length}
            echo["sha256"] = self.digest.hexdigest()
            echo["pid"] = os.getpid()
            self.send_json(200, echo, slow=a.slow_body)
        if url.path not in UNCOUNTED:
            self.count()

    def count(self) -> None:
        if self.args.crash_after is None:
            return
        with Handler.lock:
            Handler.counted += 1
            crash = Handler.counted >= self.args.crash_after
        if crash:
            self.wfile.flush()
            log(f"crashing after {Handler.counted} requests (exit status {CRASH_STATUS})")
            os._exit(CRASH_STATUS)

    def read_body(self) -> int:
        length = int(self.headers.get("Content-Length") or 0)
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self.read_chunked()
        left = length
        while left > 0:
            piece = self.rfile.read(min(left, 4096 if self.args.slow_read else 1 << 20))
            if not piece:
                break
            left -= len(piece)
            self.digest.update(piece)
            if self.args.slow_read:
                time.sleep(len(piece) / self.args.read_rate)
        return length - left

    def read_chunked(self) -> int:
        total = 0
        while True:
            size = int(self.rfile.readline(1024).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass
                return total
            left = size
            while left > 0:
                piece = self.rfile.read(min(left, 4096))
                if not piece:
                    return total
                left -= len(piece)
                total += len(piece)
                self.digest.update(piece)
                if self.args.slow_read:
                    time.sleep(len(piece) / self.args.read_rate)
            self.rfile.readline(1024)

    def send_json(self, status: int, obj: object, slow: float | None = None) -> None:
        data = json.dumps(obj).encode() + b"\n"
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if slow is None:  # head and body in one write: one segment for a small answer
            self._headers_buffer.append(b"\r\n" + data)
            self.flush_headers()
            return
        self.end_headers()
        n = max(1, min(self.args.body_chunks, len(data)))
        size = -(-len(data) // n)
        pieces = [data[i : i + size] for i in range(0, len(data), size)]
        for i, piece in enumerate(pieces):
            if i:
                time.sleep(slow / max(1, len(pieces) - 1))
            self.wfile.write(piece)

    def send_bytes(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        slow = self.args.slow_body
        n = max(1, self.args.body_chunks if slow is not None else 1)
        size = -(-len(data) // n) if data else 1
        for i in range(0, len(data), size):
            if i and slow is not None:
                time.sleep(slow / max(1, n - 1))
            self.wfile.write(data[i : i + size])

    def stream(self, chunks: int, delay: float) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(chunks):
            if i:
                time.sleep(delay)
            line = f"chunk {i}\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        self.wfile.write(b"0\r\n\r\n")


class TCPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024


class UnixServer(ThreadingUnixStreamServer):
    daemon_threads = True
    request_queue_size = 1024


def main(argv: list[str] | None = None) -> int:
    global READY_AT
    a = parse_args(argv)
    READY_AT = time.monotonic() + a.ready_after
    if a.pid_file:
        with open(a.pid_file, "w") as f:
            f.write(f"{os.getpid()}\n")
    signal.signal(signal.SIGINT, lambda *_: os._exit(a.term_exit))
    if a.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(a.term_exit))
    log(f"starting (pid {os.getpid()})")
    memory = Memory(a.memory_mb, a.grow_mb_per_s)
    time.sleep(a.start_delay)
    if a.exit_at_start is not None:
        log(f"exiting with status {a.exit_at_start} at start")
        return int(a.exit_at_start)
    if a.never_listen:
        log("never listening")
        while True:
            time.sleep(3600)
    Handler.args = a
    TCPServer.request_queue_size = UnixServer.request_queue_size = a.backlog
    server: TCPServer | UnixServer
    if a.unix:
        if os.path.exists(a.unix):
            os.unlink(a.unix)
        server = UnixServer(a.unix, Handler)
        where = a.unix
    else:
        TCPServer.address_family = socket.AF_INET6 if ":" in a.host else socket.AF_INET
        server = TCPServer((a.host, a.port), Handler)
        where = f"{a.host}:{a.port}"
    log(f"listening on {where}")
    if a.notify and not a.never_ready:
        threading.Thread(target=notify_when_ready, args=(where,), daemon=True).start()
    server.serve_forever(poll_interval=0.1)
    del memory
    return 0


if __name__ == "__main__":
    sys.exit(main())
