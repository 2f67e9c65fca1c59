#!/usr/bin/python3
"""A model worker for the container and VM tiers: it reports what it saw.

At start it can allocate memory, try to start threads and try to open a device, then
it serves HTTP on --port. Every GET answers one JSON object: its argv, environment,
and the outcome of those probes. `GET /alloc?mb=N` allocates N MiB more while
serving; `GET /read?path=P` tries to read file P and `GET /connect?path=P` to connect
to unix socket P (or HOST:PORT over TCP), as this worker, and answer "ok: <first bytes>" or the errno's name.
Standard library only; it runs as the worker's (dynamic) user.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

HELD: list[bytearray] = []


def allocate(mb: int) -> None:
    for _ in range(mb):
        block = bytearray(1 << 20)
        for i in range(0, len(block), 4096):  # touch every page: resident, not just reserved
            block[i] = 1
        HELD.append(block)


def try_threads(n: int) -> int:
    release = threading.Event()
    started: list[threading.Thread] = []
    for _ in range(n):
        t = threading.Thread(target=release.wait, daemon=True)
        try:
            t.start()
        except RuntimeError:  # "can't start new thread": EAGAIN from clone()
            break
        started.append(t)
    release.set()
    for t in started:
        t.join()
    return len(started)


def try_open(path: str) -> str:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOCTTY)
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e.errno))
    os.close(fd)
    return "ok"


def try_read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return "ok: " + f.read(200).decode(errors="replace")
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e))


def try_connect(path: str) -> str:
    """`path`: a unix socket, or HOST:PORT for TCP."""
    tcp = not path.startswith("/")
    s = socket.socket(socket.AF_INET if tcp else socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        if tcp:
            host, _, port = path.rpartition(":")
            s.connect((host, int(port)))
        else:
            s.connect(path)
        return "ok: connected"
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e))
    finally:
        s.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--alloc-mb", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--open", default="")
    ap.add_argument(
        "--exit", type=int, default=None, help="exit with this status instead of serving"
    )
    ap.add_argument(
        "--notify", action="store_true", help="send READY=1 to $NOTIFY_SOCKET once listening"
    )
    ap.add_argument("rest", nargs="*", help="ignored; echoed back in argv")
    args = ap.parse_args()
    # The tests count model starts by this line (the worker's main process is this program).
    print(f"probe worker: started (pid {os.getpid()})", file=sys.stderr, flush=True)

    if args.exit is not None:
        print(
            f"probe worker: exiting with status {args.exit} as asked", file=sys.stderr, flush=True
        )
        return int(args.exit)
    allocate(args.alloc_mb)
    report: dict[str, object] = {
        "argv": sys.argv,
        "env": dict(os.environ),
        "pid": os.getpid(),
        "uid": os.getuid(),
        "alloc_mb": args.alloc_mb,
    }
    if args.threads:
        report["threads_started"] = try_threads(args.threads)
    if args.open:
        report["open"] = try_open(args.open)
    print(
        f"probe worker: serving on {args.host}:{args.port}: {json.dumps(report)[:400]}",
        file=sys.stderr,
        flush=True,
    )

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection

        def do_GET(self) -> None:
            url = urlparse(self.path)
            query = parse_qs(url.query)
            if url.path in ("/read", "/connect"):
                path = query.get("path", [""])[0]
                outcome = try_read(path) if url.path == "/read" else try_connect(path)
                body = json.dumps({"path": path, "outcome": outcome}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if url.path == "/alloc":
                mb = int(parse_qs(url.query).get("mb", ["0"])[0])
                allocate(mb)
                report["alloc_mb"] = int(str(report["alloc_mb"])) + mb
            body = json.dumps(report).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *a: object) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    if args.notify:
        import socket

        where = os.environ["NOTIFY_SOCKET"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as n:
            n.sendto(b"READY=1\nSTATUS=probe worker ready", where)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
