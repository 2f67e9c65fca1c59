"""What the data path benchmarks share: an epoll HTTP backend loop, a front that is always
ready (the front's data path: agent.net's HttpListeners and connection core), processes that get their
listening socket as fd 3, and the client's reads and percentiles."""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

Address = tuple[str, int]

# What a backend does with a connection's buffered bytes (everything it received and did not
# consume yet): answer and consume complete requests, or take the connection off the selector.
OnData = Callable[[selectors.BaseSelector, socket.socket, bytearray], None]


def serve_epoll(on_data: OnData) -> None:
    """A backend on the listening socket fd 3: accepts, reads, closes at EOF; `on_data` gets
    each connection's buffer after every read."""
    listener = socket.socket(fileno=3)
    listener.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    while True:
        for key, _ in sel.select():
            if key.data is None:
                while True:
                    try:
                        conn, _ = listener.accept()
                    except BlockingIOError:
                        break
                    conn.setblocking(False)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sel.register(conn, selectors.EVENT_READ, bytearray())
                continue
            conn = key.fileobj
            assert isinstance(conn, socket.socket)
            try:
                data = conn.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                sel.unregister(conn)
                conn.close()
                continue
            buf: bytearray = key.data
            buf += data
            on_data(sel, conn, buf)


def always_ready_backend(worker_port: int) -> Any:
    """A front's backend for the core (`agent.net.proxy.FrontSite`) that is always ready at
    127.0.0.1:worker_port and holds no lease."""
    sys.path.insert(0, str(ROOT))
    from agent.net.upstream import Upstream
    from agent.spec.provider import Address

    class NoLease:
        def release(self) -> None:
            pass

    class AlwaysReady:
        slug = "bench"
        request_timeout_s = 300.0
        address = Address("127.0.0.1", worker_port)
        no_lease = NoLease()
        # As many requests at once as the bench sends: it measures the relay, not the pacing.
        upstream = Upstream(limit=4096, max_waiting=100_000)

        def lease(self, path: str | None) -> NoLease:
            return self.no_lease

        def alive(self, generation: int) -> bool:
            return True

        def waiting_for_start(self) -> int:
            return 0

        def ready_now(self) -> tuple[Address, int]:
            return self.address, 1

        async def ready(self, *, may_start: bool = True) -> tuple[Address, int]:
            return self.address, 1

    return AlwaysReady()


def always_ready_front(worker_port: int) -> None:
    """The front's data path (`agent.net.proxy.accept_http` with a `FrontSite`, accepting
    through `agent.net.listeners.Listeners` as the front does) on the listening socket fd 3,
    every connection relayed to 127.0.0.1:worker_port by a backend that is always ready
    and holds no lease."""
    import asyncio
    import logging

    sys.path.insert(0, str(ROOT))
    from agent.net import loop
    from agent.net.listeners import Listeners
    from agent.net.proxy import FrontSite, Style, accept_http

    async def main() -> None:
        site = FrontSite(always_ready_backend(worker_port))
        style = Style("bench")
        listening: Listeners

        def connection(sock: socket.socket) -> None:
            accept_http(sock, site, style, listening.closed, listening.loop)

        listening = Listeners([socket.socket(fileno=3)], connection, logging.getLogger("bench"))
        listening.start()
        await asyncio.Event().wait()

    loop.run(main())  # the loop the front runs on


def listener() -> socket.socket:
    """A listening loopback TCP socket on a free port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    return sock


def spawn(
    argv: list[str], sock: socket.socket, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start argv with `sock` as its fd 3."""
    fd = sock.fileno()

    def as_fd3() -> None:
        if fd == 3:
            os.set_inheritable(3, True)  # dup2(3, 3) would keep close-on-exec
        else:
            os.dup2(fd, 3)  # dup2 leaves fd 3 inheritable

    return subprocess.Popen(
        argv,
        preexec_fn=as_fd3,
        close_fds=False,  # everything else Python opened is close-on-exec already
        env=env,
    )


def read_n(sock: socket.socket, n: int) -> None:
    """Read and drop n bytes."""
    got = 0
    while got < n:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("connection closed early")
        got += len(data)


def next_head(conn: socket.socket, pending: bytes) -> tuple[bytes, bytes] | None:
    """The next request head from conn (after what `pending` already holds) and the bytes
    after it; None once the client has closed."""
    while b"\r\n\r\n" not in pending:
        data = conn.recv(65536)
        if not data:
            return None
        pending += data
    i = pending.index(b"\r\n\r\n") + 4
    return pending[:i], pending[i:]


def drain(conn: socket.socket, sink: bytearray, left: int) -> bool:
    """Read and drop `left` bytes into `sink`, a chunk at a time; False if conn closed first."""
    while left > 0:
        n = conn.recv_into(sink, min(left, len(sink)))
        if not n:
            return False
        left -= n
    return True


def wait_listening(exchange: Callable[[], None]) -> None:
    """Retry `exchange` (one request and its answer) until it works, for up to 10 s."""
    deadline = time.monotonic() + 10
    while True:
        try:
            exchange()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def pct(values: list[float], p: float) -> float:
    """The p-th percentile (0-100) of values, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]
