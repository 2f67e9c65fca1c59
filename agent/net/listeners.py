"""The accept side of a socket-activated service (a front, the router).

Accepts in batches from the listening sockets and hands each connection over at once,
in the accept callback itself, so whoever decides an idle exit in the same turn of the
event loop already sees it. Stopping is for good: our copies of the sockets are closed
(never `shutdown()`: PID 1 shares them), and what arrives next waits in the kernel's
queue for the next activation.

Bounded: at most `max_connections` client connections at once (systemd-socket-proxyd's
`--connections-max`); beyond that, accepting pauses until one closes and new clients wait
in the kernel's queue. When the process runs out of file descriptors (EMFILE, ENFILE),
accepting pauses for PAUSE_S, once logged, instead of spinning on the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import resource
import socket
from collections.abc import Callable

from agent.net.answers import Style
from agent.net.client import ClientConn, Site
from agent.net.deadlines import Entry
from agent.net.proxy import accept_http
from agent.net.ratelog import RateLog

MAX_CONNECTIONS = 16384
FD_RESERVE = 64  # descriptors kept for the worker connections, the control socket, logs
PAUSE_S = 0.5  # after EMFILE/ENFILE (nginx waits as long)
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def settle() -> None:
    """Start-up is over: what the process holds now (modules, manifests, tables) leaves the
    garbage collector's view (`gc.freeze()`), so that a full collection while serving walks
    only what serving made (with the front's modules loaded: 5.7 ms before, a few µs after),
    a pause that every request in flight would wait out. Freezing costs nothing by itself;
    a collection first would delay the connection that activated the service."""
    gc.freeze()


def connection_cap(reserve: int = FD_RESERVE) -> int:
    """MAX_CONNECTIONS, or fewer when the file descriptor limit is lower."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(8, min(MAX_CONNECTIONS, soft - reserve))


class Listeners:
    def __init__(
        self,
        sockets: list[socket.socket],
        on_connection: Callable[[socket.socket], None],
        log: logging.Logger,
        max_connections: int | None = None,
    ) -> None:
        self.sockets = sockets
        self.on_connection = on_connection
        self.log = log
        self.max_connections = max_connections or connection_cap()
        self.accepting = False  # until stop(): paused or not
        self.open = 0  # connections handed over and not yet closed()
        self._registered = False
        self._pause: asyncio.TimerHandle | None = None
        self._full_log = RateLog(log, interval_s=60.0, burst=1)
        self._fds_logged = False
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        for sock in self.sockets:
            sock.setblocking(False)
        self.accepting = True
        self._register()
        settle()

    def _register(self) -> None:
        if self._registered or not self.accepting:
            return
        loop = asyncio.get_running_loop()
        for sock in self.sockets:
            loop.add_reader(sock.fileno(), self.accept, sock)
        self._registered = True

    def _unregister(self) -> None:
        if not self._registered:
            return
        loop = asyncio.get_running_loop()
        for sock in self.sockets:
            loop.remove_reader(sock.fileno())
        self._registered = False

    def stop(self) -> None:
        """Stop accepting for good."""
        if not self.accepting:
            return
        self._unregister()
        self.accepting = False
        if self._pause is not None:
            self._pause.cancel()
            self._pause = None
        for sock in self.sockets:
            sock.close()  # our copy only; never shutdown(): PID 1 shares the socket

    def closed(self) -> None:
        """A connection handed over has closed: accept again if the cap had paused it."""
        self.open -= 1
        if self.open < self.max_connections and self._pause is None and self.accepting:
            self._register()

    def _resume(self) -> None:
        self._pause = None
        if self.open < self.max_connections:
            self._register()

    def accept(self, sock: socket.socket) -> None:
        for _ in range(64):
            if self.open >= self.max_connections:
                self._unregister()
                self._full_log.log(
                    "cap",
                    "Reached %d client connections, not accepting more until one closes",
                    self.open,
                )
                return
            try:
                conn, _peer = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in OUT_OF_FDS:
                    self._unregister()
                    self._pause = asyncio.get_running_loop().call_later(PAUSE_S, self._resume)
                    if not self._fds_logged:
                        self.log.warning(
                            "Failed to accept connection: %s; pausing accepting for %g s "
                            "(%d connections open)",
                            e.strerror or e,
                            PAUSE_S,
                            self.open,
                        )
                        self._fds_logged = True
                    return
                self.log.warning("Failed to accept connection: %s, ignoring", e)
                return
            if self._fds_logged:
                self.log.info("Accepting connections again (%d open)", self.open)
                self._fds_logged = False
            self.open += 1  # non-blocking and TCP_NODELAY as it becomes a transport (net.proxy)
            try:
                self.on_connection(conn)
            except Exception as e:  # not made a transport (closed): this connection only
                conn.close()
                self.closed()
                self.log.warning("Failed to take connection: %s, ignoring", e)


class Grace:
    """A new connection's first-request grace, a deadline on the loop's queue."""

    __slots__ = ("conn", "due", "listeners", "queued")

    def __init__(self, listeners: HttpListeners, conn: ClientConn, due: float) -> None:
        self.listeners = listeners
        self.conn = conn
        self.due: float | None = due
        self.queued: Entry | None = None

    def expire(self) -> None:
        self.listeners.first_request(self.conn)


class HttpListeners(Listeners):
    """Listeners whose connections go to the connection core (`accept_http`), each with a
    first-request grace: until its first request begins (`first_request`, at most
    `grace_s`), a new connection counts as fresh (`on_fresh(+1)`, then `on_fresh(-1)`), so
    an idle exit decided meanwhile does not cut a connection whose request is on its way.
    `connections` holds every connection until it has closed, with its grace while fresh
    (a deadline on the loop's queue, agent.net.deadlines: no timer of its own)."""

    def __init__(
        self,
        sockets: list[socket.socket],
        site: Site,
        style: Style,
        log: logging.Logger,
        grace_s: float,
        on_fresh: Callable[[int], None],
    ) -> None:
        super().__init__(sockets, self._accepted, log)
        self.site = site
        self.style = style
        self.grace_s = grace_s
        self.on_fresh = on_fresh
        self.connections: dict[ClientConn, Grace | None] = {}
        self.all_closed: asyncio.Event | None = None  # set once none is open, when asked for

    def _accepted(self, sock: socket.socket) -> None:
        loop = self.loop or asyncio.get_running_loop()
        conn = accept_http(sock, self.site, self.style, lambda: self._closed(conn), loop)
        due = loop.time() + self.grace_s
        grace = self.connections[conn] = Grace(self, conn, due)
        conn.deadlines.arm(grace, due)
        self.on_fresh(+1)

    def first_request(self, conn: ClientConn) -> None:
        """`conn` began a request, or its grace ran out: it is no longer fresh."""
        grace = self.connections.get(conn)
        if grace is not None:
            conn.deadlines.drop(grace)
            self.connections[conn] = None
            self.on_fresh(-1)

    def _closed(self, conn: ClientConn) -> None:
        self.first_request(conn)
        self.connections.pop(conn, None)
        self.closed()
        if not self.connections and self.all_closed is not None:
            self.all_closed.set()

    def abort_all(self) -> None:
        """End every connection at once (a release)."""
        for conn in list(self.connections):
            conn.abort()

    async def wait_closed(self, timeout_s: float) -> None:
        """Wait until every connection has closed, at most `timeout_s`."""
        if self.connections:
            self.all_closed = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self.all_closed.wait()
