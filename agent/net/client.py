"""The client's side of one HTTP connection, as an asyncio protocol.

The socket stays registered with the loop for the connection's life; back-pressure is
`pause_reading()`. Bytes arrive in pooled buffers lent per read (`get_buffer`): an idle
keep-alive connection holds no buffer, a request in flight holds none while the upstream
works, and a head grows from HEAD_SIZE to BUFFER_SIZE only as its bytes arrive (at most
MAX_HEAD: 431, or 414 for a request line alone).

Time limits, all from one deadline per connection on the loop's deadline queue
(agent.net.deadlines), moved lazily: a head must be complete within HEADER_TIMEOUT_S (of
the accept for the first request, of its first byte after that: else 408); a connection
with no request for KEEPALIVE_TIMEOUT_S is closed without an answer; a connection that
answered and closed first lingers for LINGER_S at most. What happens to a request once its
head is parsed is the `Exchange`'s (agent.core.exchange); this class feeds it the body and
what follows.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, cast

from agent.net import deadlines, sockio
from agent.net.answers import Answer, Style, made_up
from agent.net.deadlines import Entry
from agent.net.headcache import request_head
from agent.net.http import (
    MAX_HEAD,
    HttpError,
    RequestHead,
    find_request_head_end,
    skip_empty_lines,
)
from agent.net.sockio import BUFFER_SIZE, BULK_SIZE, HEAD_SIZE, LINGER_S, give, take

log = logging.getLogger(__name__)


class Exchange(Protocol):
    """The request in flight on a connection (agent.net.exchange.Exchange)."""

    bulk_body: bool  # a long body comes: read it in large buffers

    def body_wanted(self) -> bool: ...
    def body_bytes(self, view: memoryview) -> int: ...
    def client_eof(self) -> None: ...
    def client_lost(self, exc: Exception | None) -> None: ...
    def pause_upstream(self, on: bool) -> None: ...
    def cancel(self) -> None: ...
    def tick(self) -> None: ...


class Site(Protocol):
    """What serves the requests of a listener's connections (agent.net.site)."""

    def exchange(self, conn: ClientConn, req: RequestHead, head_end: int) -> None:
        """Begin serving `req`, whose head ends at `head_end` in conn.buf."""


def head_too_large(buf: bytearray, start: int, end: int) -> tuple[int, str]:
    """431, or 414 when the request line alone fills MAX_HEAD."""
    if buf.find(b"\n", start, end) < 0:
        return 414, f"request line longer than {MAX_HEAD} bytes"
    return 431, f"request head larger than {MAX_HEAD} bytes"


PENDING_MAX = BUFFER_SIZE  # bytes held ahead of the request in flight (pipelining) before pausing
_SCRATCH = memoryview(bytearray(4096))  # what a closing connection reads into, and drops

# Why reading is paused: bits, so that each cause resumes only its own pause.
PAUSE_AHEAD = 1  # too much sent ahead of the request in flight
PAUSE_UPSTREAM = 2  # the upstream does not take the body as fast as it comes
PAUSE_WAIT = 4  # the exchange does not want bytes now
PAUSE_SPLICE = 8  # the request's body (or a tunnel) is spliced from the socket (agent.net.splice)


class ClientConn(asyncio.BufferedProtocol):
    """One client connection. `site` makes the exchanges (`site.exchange(conn, req)`);
    `on_closed` runs once when the connection is gone."""

    __slots__ = (
        "ahead",
        "buf",
        "closed",
        "closing",
        "deadlines",
        "due",
        "due_kind",
        "end",
        "eof",
        "ex",
        "head_due",
        "loop",
        "on_closed",
        "paused",
        "queued",
        "site",
        "start",
        "style",
        "transport",
        "tunnel",
        "write_paused",
    )

    def __init__(
        self,
        site: Site,
        style: Style,
        on_closed: Callable[[], None] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.site = site
        self.style = style
        self.on_closed = on_closed
        self.transport: asyncio.Transport | None = None
        self.buf: bytearray | None = None  # head bytes (or what follows a request) not yet used
        self.start = self.end = 0
        self.ahead = b""  # bytes after the request in flight (pipelined), until it ends
        self.ex: Exchange | None = None
        self.tunnel: asyncio.Transport | None = None  # after a 101: bytes go straight there
        self.eof = False  # the client half-closed (or is gone)
        self.closed = False
        self.closing = False  # answered and closing first: reads are dropped
        self.write_paused = False
        self.paused = 0
        self.due: float | None = None  # the connection's deadline (loop time)
        self.due_kind = ""  # "head" | "idle" | "linger" | "request"
        self.deadlines = deadlines.of(self.loop)
        self.queued: Entry | None = None  # the deadline queue's entry for this connection
        self.head_due: float | None = None

    # -- asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=BULK_SIZE)
        self.head_due = self.loop.time() + sockio.HEADER_TIMEOUT_S
        self.deadline(self.head_due, "head")

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.closing:
            return _SCRATCH
        buf = self.buf
        if buf is None:
            size = BULK_SIZE if self.ex is not None and self.ex.bulk_body else HEAD_SIZE
            buf = self.buf = take(size)
            self.start = self.end = 0
        elif self.end == len(buf):
            pending = self.end - self.start
            if self.start:
                buf[:pending] = buf[self.start : self.end]
                self.start, self.end = 0, pending
            else:  # a head that fills its buffer: a larger one (checked against MAX_HEAD)
                bigger = take(BUFFER_SIZE) if len(buf) < BUFFER_SIZE else bytearray(2 * len(buf))
                bigger[:pending] = buf[:pending]
                give(buf)
                self.buf = buf = bigger
        return memoryview(buf)[self.end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.closing:
            return
        self.end += nbytes
        try:
            if self.tunnel is not None:
                self.to_tunnel()
            elif self.ex is not None:
                self.to_exchange()
            else:
                self.next_request()
        except Exception as e:  # a bug must cost this connection, never the process's log
            log.warning("Failed to serve a connection: %s, closing it", e)
            log.debug("Failed to serve a connection", exc_info=e)
            self.abort()

    def eof_received(self) -> bool:
        self.eof = True
        if self.closing:
            self.close()
            return False
        if self.ex is not None:  # in a tunnel too: the exchange passes the EOF on, or ends
            self.ex.client_eof()
            return not self.closed
        if self.end > self.start:
            log.debug("Client closed the connection in the middle of a request head")
        self.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        if self.ex is not None:
            self.ex.client_lost(exc)
        self.finish()

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.ex is not None:
            self.ex.pause_upstream(True)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.ex is not None:
            self.ex.pause_upstream(False)

    # -- reading -------------------------------------------------------------------------

    def pause(self, why: int, on: bool) -> None:
        was = self.paused
        self.paused = was | why if on else was & ~why
        if self.transport is None or self.closed:
            return
        if was and not self.paused:
            self.transport.resume_reading()
        elif self.paused and not was:
            self.transport.pause_reading()

    def release_buffer(self) -> None:
        """Give the buffer back when nothing is pending in it."""
        if self.buf is not None and self.start == self.end:
            give(self.buf)
            self.buf = None
            self.start = self.end = 0

    def take_pending(self) -> bytes:
        """What the buffer holds (after a request's part was used), as bytes; the buffer goes."""
        data = b""
        if self.buf is not None:
            data = bytes(memoryview(self.buf)[self.start : self.end])
            give(self.buf)
            self.buf = None
            self.start = self.end = 0
        return data

    def to_exchange(self) -> None:
        """Bytes during a request: its body first, then what comes after (held, bounded)."""
        ex = self.ex
        assert ex is not None and self.buf is not None
        if self.start == self.end:  # the usual case: nothing after the request's bytes
            give(self.buf)
            self.buf = None
            self.start = self.end = 0
            return
        view = memoryview(self.buf)
        while self.start < self.end and ex.body_wanted():
            used = ex.body_bytes(view[self.start : self.end])
            self.start += used
            if self.ex is not ex or self.buf is None:
                return
        if self.start < self.end:
            self.ahead += bytes(view[self.start : self.end])
            self.start = self.end
            if len(self.ahead) >= PENDING_MAX:
                self.pause(PAUSE_AHEAD, True)
        self.release_buffer()

    def to_tunnel(self) -> None:
        assert self.tunnel is not None and self.buf is not None
        self.tunnel.write(self.buf[self.start : self.end])  # a copy: see write()
        self.start = self.end
        self.release_buffer()

    def next_request(self) -> None:
        """Between requests: find the next head in the buffer and hand it to an exchange."""
        while not self.closed and self.ex is None and self.tunnel is None:
            buf = self.buf
            if buf is None:
                self.idle()
                return
            start = self.start
            if start == self.end or buf[start] == 13 or buf[start] == 10:
                start = self.start = skip_empty_lines(buf, start, self.end)
                if start == self.end:
                    self.release_buffer()
                    self.idle()
                    return
            head_end = find_request_head_end(buf, start, self.end)
            if head_end < 0:
                # The head's time limit runs from its first byte: these came just now (or,
                # pipelined, with the request before). A head that came whole needs none.
                if self.head_due is None:
                    self.head_due = self.loop.time() + sockio.HEADER_TIMEOUT_S
                    self.deadline(self.head_due, "head")
                if self.end - self.start >= MAX_HEAD:
                    status, why = head_too_large(buf, self.start, self.end)
                    self.answer(Answer(status, why), close=True)
                return
            try:
                req = request_head(buf, self.start, head_end)
            except HttpError as e:
                self.answer(Answer(e.status, e.reason), close=True)
                return
            self.head_due = None
            self.deadline(None, "")
            self.site.exchange(self, req, head_end)

    def idle(self) -> None:
        if self.eof:
            self.close()
        elif self.head_due is None:
            self.deadline(self.loop.time() + sockio.KEEPALIVE_TIMEOUT_S, "idle")

    def request_done(self, keep: bool) -> None:
        """The exchange ended; serve what the client sent meanwhile, or close."""
        self.ex = None
        if self.closed or self.closing:
            return
        if not keep:
            self.close(linger=True)
            return
        ahead, self.ahead = self.ahead, b""
        if ahead:
            pending = self.take_pending()
            data = ahead + pending
            self.buf = take(HEAD_SIZE if len(data) <= HEAD_SIZE else BUFFER_SIZE)
            if len(data) > len(self.buf):
                self.buf = bytearray(data)
            else:
                self.buf[: len(data)] = data
            self.start, self.end = 0, len(data)
        if self.paused:  # the request's pauses end with it
            self.pause(PAUSE_AHEAD | PAUSE_UPSTREAM | PAUSE_WAIT | PAUSE_SPLICE, False)
        if self.buf is None:
            self.idle()  # the usual keep-alive case: nothing came meanwhile
        else:
            self.next_request()

    # -- time limits ---------------------------------------------------------------------

    def deadline(self, due: float | None, kind: str) -> None:
        """Move the connection's deadline. A later one leaves the queue's entry alone (it
        is pushed again when it pops early); only an earlier one is pushed."""
        self.due, self.due_kind = due, kind
        if due is not None and (self.queued is None or due < self.queued[0]):  # else: no push
            self.deadlines.arm(self, due)

    def expire(self) -> None:
        """The deadline has come (agent.net.deadlines calls this when `due` has passed)."""
        if self.closed:
            return
        kind, self.due = self.due_kind, None
        if kind == "request":
            if self.ex is not None:
                self.ex.tick()
        elif kind == "linger":  # the client did not close within LINGER_S: now we do
            self.closing = False
            self.close()
        elif kind == "head" and self.end > self.start:
            limit = sockio.HEADER_TIMEOUT_S
            self.answer(Answer(408, f"request head not complete within {limit:g} s"), close=True)
        else:
            log.debug("Closing a connection idle for its time limit")
            self.close()

    # -- answering and closing -----------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send `data`. What is not bytes is copied first: the loop holds what it is given
        until the end of its turn (uvloop sends a turn's writes together), and views into
        pooled buffers change before that."""
        if self.transport is not None and not self.closed:
            self.transport.write(data if type(data) is bytes else bytes(data))

    def answer(self, a: Answer, *, close: bool, head_only: bool = False, what: str = "") -> None:
        """Answer the client ourselves; with `close`, close first (lingering)."""
        self.write(made_up(self.style, a, close=close, head_only=head_only, what=what))
        if close:
            self.close(linger=True)

    def close(self, linger: bool = False) -> None:
        """Close the connection. With `linger` (we close first while the client may still
        send): shut down writing, read and drop for up to LINGER_S, then close: closing with
        unread input makes the kernel send a reset that can destroy our last answer."""
        if self.closed or self.closing:
            return
        transport = self.transport
        if transport is None:
            return
        self.take_pending()
        self.ahead = b""
        if linger and not self.eof and transport.can_write_eof():
            self.closing = True
            self.pause(~0, False)
            transport.write_eof()
            self.deadline(self.loop.time() + LINGER_S, "linger")
            return
        self.closed = True
        transport.close()

    def abort(self) -> None:
        """End at once (a release cancels every connection)."""
        if self.ex is not None:
            self.ex.cancel()
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    def finish(self) -> None:
        self.closed = True
        self.due = None
        self.deadlines.drop(self)
        self.take_pending()
        if self.on_closed is not None:
            callback, self.on_closed = self.on_closed, None
            callback()
