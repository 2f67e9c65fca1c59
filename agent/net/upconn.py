"""One connection to the upstream (the worker, for a front; a provider's front, for the
router), as an asyncio protocol that relays HTTP responses to the client.

It reads interim (1xx) responses and the final head, then the body in its framing
(Content-Length, chunked, until EOF; after a tunnel's head, everything) and hands each
piece to the exchange it serves as it arrives, unchanged. A read lends a pooled buffer:
BUFFER_SIZE, or BULK_SIZE once a read fills one; nothing is held between reads except
a head still incomplete. Between requests the connection may be kept (agent.upstream);
while kept, an EOF or any byte makes it unusable at once.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, cast

from agent.errors import ProviderdError
from agent.net import splice
from agent.net.chunked import ChunkedScanner
from agent.net.headcache import response_head
from agent.net.http import (
    MAX_HEAD,
    HttpError,
    ResponseHead,
    find_head_end,
)
from agent.net.sockio import BUFFER_SIZE, BULK_SIZE, give, take

IDLE, HEAD, BODY, TUNNEL = range(4)


class Exchange(Protocol):
    """What a response is relayed to (agent.net.exchange.Exchange)."""

    def on_interim(self, resp: ResponseHead, head: memoryview) -> None: ...
    def on_final(self, resp: ResponseHead) -> None: ...
    def on_whole(self, resp: ResponseHead, data: memoryview, reusable: bool) -> None: ...
    def on_data(self, data: memoryview) -> None: ...
    def on_end(self, reusable: bool) -> None: ...
    def on_tunnel(self, up: UpstreamConn) -> None: ...
    def tunnel_eof(self, up: UpstreamConn) -> None: ...
    def tunnel_lost(self) -> None: ...
    def upstream_gone(self, e: UpstreamGone) -> None: ...
    def upstream_failed(self, err: HttpError) -> None: ...
    def pause_client(self, on: bool) -> None: ...
    def splice_response(self, up: UpstreamConn) -> bool: ...


class UpstreamGone(ProviderdError):
    """The upstream closed, reset or refused the connection."""

    code = "worker_gone"


class UpstreamConn(asyncio.BufferedProtocol):
    __slots__ = (
        "body",
        "buf",
        "bulk",
        "clean",
        "dead",
        "e",
        "eof",
        "ex",
        "generation",
        "left",
        "method",
        "peer",
        "phase",
        "s",
        "scanner",
        "transport",
    )

    def __init__(self, generation: int, peer: str) -> None:
        self.generation = generation
        self.peer = peer  # "worker", "provider": for messages
        self.transport: asyncio.Transport | None = None
        self.ex: Exchange | None = None
        self.buf: bytearray | None = None
        self.s = self.e = 0
        self.phase = IDLE
        self.method = "GET"
        self.body = "none"
        self.left = 0
        self.scanner: ChunkedScanner | None = None
        self.bulk = False
        self.dead = False
        self.eof = False
        self.clean = False  # the last response ended with nothing after it

    # -- the pool's view

    def usable(self) -> bool:
        return not self.dead and self.clean and self.transport is not None

    def close(self) -> None:
        self.dead = True
        self.ex = None
        if self.transport is not None:
            self.transport.close()
        self.drop_buffer()

    def rest(self) -> None:
        """Between requests: no exchange, and reading on (a response that ended while the
        client's side was full left it paused), so that an EOF or a stray byte is seen."""
        self.ex = None
        if self.transport is not None and not self.dead:
            self.transport.resume_reading()

    def shut_write(self) -> None:
        """Pass a client's half-close on; this connection can no longer be kept."""
        self.clean = False
        self.dead = True
        transport = self.transport
        if transport is not None and not transport.is_closing() and transport.can_write_eof():
            transport.write_eof()  # a closed uvloop transport raises

    def begin(self, ex: Exchange, method: str, data: bytes | bytearray) -> None:
        """Serve exchange `ex`: its request (`data`, as received so far) goes out now."""
        self.ex = ex
        self.method = method
        self.phase = HEAD
        self.clean = False
        self.bulk = False
        self.write(data)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send `data`, copied first unless it is bytes (as ClientConn.write)."""
        if self.transport is not None and not self.dead:
            self.transport.write(data if type(data) is bytes else bytes(data))

    def body_spliced(self) -> None:
        """The rest of the body went by splice (agent.net.splice): the response ends here."""
        self.left = 0
        if self.ex is not None:
            self.end(self.ex)

    def body_rest(self, left: int) -> None:
        """The splice was declined: the body's last `left` bytes come through here."""
        self.left = left

    def drop_buffer(self) -> None:
        if self.buf is not None:
            give(self.buf)
            self.buf = None
        self.s = self.e = 0

    # -- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=BULK_SIZE)

    def get_buffer(self, sizehint: int) -> memoryview:
        buf = self.buf
        if buf is None:
            buf = self.buf = take(BULK_SIZE if self.bulk else BUFFER_SIZE)
            self.s = self.e = 0
        elif self.e == len(buf):
            pending = self.e - self.s
            buf[:pending] = buf[self.s : self.e]
            self.s, self.e = 0, pending
        return memoryview(buf)[self.e :]

    def buffer_updated(self, nbytes: int) -> None:
        assert self.buf is not None
        self.e += nbytes
        ex = self.ex
        if ex is None or self.phase == IDLE:
            self.close()  # bytes nobody asked for: never to be kept
            return
        full = self.e == len(self.buf)
        try:
            self.relay(ex)
        except HttpError as err:
            self.drop_buffer()
            if self.ex is ex:
                ex.upstream_failed(err)
            return
        except Exception as e:  # a bug must cost this exchange, never the process's log
            self.drop_buffer()
            self.close()
            ex.upstream_failed(HttpError(502, f"failed to relay the response: {e}"))
            return
        if self.s == self.e:
            self.drop_buffer()
            if full and self.phase in (BODY, TUNNEL):
                self.bulk = True  # a busy stream: fewer, larger reads

    def relay(self, ex: Exchange) -> None:
        buf = self.buf
        assert buf is not None
        view = memoryview(buf)
        while self.s < self.e and self.ex is ex:
            s, e = self.s, self.e
            if self.phase == HEAD:
                head_end = find_head_end(buf, s, e)
                if head_end < 0:
                    if e - s >= MAX_HEAD:
                        too_big = f"the {self.peer} sent a head larger than {MAX_HEAD} bytes"
                        raise HttpError(502, too_big)
                    return
                resp = response_head(buf, self.method, s, head_end)
                body = resp.body
                if resp.status < 200 and body != "tunnel":
                    self.s = head_end
                    ex.on_interim(resp, view[s:head_end])
                    continue
                if body == "none" or (body == "length" and e - head_end >= resp.length):
                    # The usual small response: head and body in this read, relayed in one
                    # write, and over (as end() below, in one call to the exchange).
                    self.s = at = head_end + resp.length
                    self.left = 0
                    self.phase = IDLE
                    self.clean = at == e and not self.eof and not self.dead
                    ex.on_whole(resp, view[s:at], self.clean)
                    continue
                ex.on_final(resp)
                self.body, self.left = resp.body, resp.length
                if resp.body == "tunnel":
                    self.s = e
                    self.phase = TUNNEL
                    ex.on_data(view[s:e])
                    ex.on_tunnel(self)
                    return
                self.phase = BODY
                # The head goes with whatever of the body came with it: one write, not two.
                if resp.body == "length":
                    k = min(e - head_end, self.left)
                    self.left -= k
                    self.s = head_end + k
                    ex.on_data(view[s : self.s])  # not all of it: else on_whole above
                    if self.left >= splice.SPLICE_MIN and ex.splice_response(self):
                        return
                    continue
                self.scanner = ChunkedScanner() if resp.body == "chunked" else None
                self.s = head_end
                if self.scanner is not None:
                    at = self.chunks(buf, head_end, e)
                    self.s = at if at >= 0 else e
                    ex.on_data(view[s : self.s])
                    if at >= 0:
                        self.end(ex)
                    continue
                self.s = e
                ex.on_data(view[s:e])
                continue
            if self.phase == TUNNEL:
                self.s = e
                ex.on_data(view[s:e])
                return
            # BODY
            if self.body == "length":
                k = min(e - s, self.left)
                self.left -= k
                self.s = s + k
                ex.on_data(view[s : s + k])
                if self.left == 0:
                    self.end(ex)
                elif self.left >= splice.SPLICE_MIN and ex.splice_response(self):
                    return
            elif self.scanner is not None:
                at = self.chunks(buf, s, e)
                self.s = at if at >= 0 else e
                ex.on_data(view[s : self.s])
                if at >= 0:
                    self.end(ex)
            else:  # close-delimited: the upstream's EOF ends it
                self.s = e
                ex.on_data(view[s:e])

    def chunks(self, buf: bytearray, s: int, e: int) -> int:
        """Where the chunked body ends in buf[s:e], or -1. Raises HttpError (502)."""
        assert self.scanner is not None
        try:
            return self.scanner.scan(buf, s, e)
        except HttpError as err:
            raise HttpError(
                502, f"the {self.peer} sent a malformed chunked body: {err.reason}"
            ) from None

    def end(self, ex: Exchange) -> None:
        self.phase = IDLE
        self.scanner = None
        self.clean = self.s == self.e and not self.eof and not self.dead
        if self.ex is ex:
            ex.on_end(self.clean)

    def eof_received(self) -> bool:
        self.eof = True
        ex = self.ex
        if ex is None or self.phase == IDLE:
            self.close()
            return False
        if self.phase == TUNNEL:
            ex.tunnel_eof(self)
            return True
        if self.phase == BODY and self.body == "close":
            self.end(ex)
            self.close()
            return False
        where = "before answering" if self.phase == HEAD else "in the middle of a response"
        self.dead = True
        ex.upstream_gone(UpstreamGone(f"the {self.peer} closed the connection {where}"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.dead = True
        self.drop_buffer()
        ex, self.ex = self.ex, None
        if ex is None:
            return
        if self.phase == TUNNEL:
            ex.tunnel_lost()
            return
        why = f" ({exc})" if exc is not None else ""
        ex.upstream_gone(UpstreamGone(f"the {self.peer} connection failed{why}"))

    def pause_writing(self) -> None:
        if self.ex is not None:
            self.ex.pause_client(True)

    def resume_writing(self) -> None:
        if self.ex is not None:
            self.ex.pause_client(False)
