"""One connection to the upstream (the worker, for a front; a provider's front, for the
router), as an asyncio protocol that relays HTTP responses to the client.

It reads interim (1xx) responses and the final head, then the body in its framing
(Content-Length, chunked, until EOF; after a tunnel's head, everything) and hands each
piece to the exchange it serves as it arrives, unchanged. Reads come as bytes (on uvloop,
a copy of what one read put in the loop's own 256 KiB buffer): a response that came whole
in one read goes on to the client as that same object, with no copy. Nothing is held between reads except a head
still incomplete. Between requests the connection may be kept (agent.upstream); while
kept, an EOF or any byte makes it unusable at once. (The client's side reads into lent
buffers instead, agent.net.client: what it reads ahead of a held request is bounded.)
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
from agent.net.sockio import BULK_SIZE

IDLE, HEAD, BODY, TUNNEL = range(4)


class Exchange(Protocol):
    """What a response is relayed to (agent.net.exchange.Exchange)."""

    def on_interim(self, resp: ResponseHead, head: memoryview) -> None: ...
    def on_final(self, resp: ResponseHead) -> None: ...
    def on_whole(self, resp: ResponseHead, data: bytes | memoryview, reusable: bool) -> None: ...
    def on_data(self, data: bytes | memoryview) -> None: ...
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


class UpstreamConn(asyncio.Protocol):
    __slots__ = (
        "body",
        "clean",
        "dead",
        "eof",
        "ex",
        "generation",
        "left",
        "method",
        "peer",
        "pending",
        "phase",
        "scanner",
        "transport",
    )

    def __init__(self, generation: int, peer: str) -> None:
        self.generation = generation
        self.peer = peer  # "worker", "provider": for messages
        self.transport: asyncio.Transport | None = None
        self.ex: Exchange | None = None
        self.pending = b""  # the start of a head, until the rest comes
        self.phase = IDLE
        self.method = "GET"
        self.body = "none"
        self.left = 0
        self.scanner: ChunkedScanner | None = None
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
        self.pending = b""

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
        self.write(data)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send `data`, copied first unless it is bytes (as ClientConn.write)."""
        if self.transport is not None and not self.dead:
            self.transport.write(data if type(data) is bytes else bytes(data))

    def body_spliced(self) -> None:
        """The rest of the body went by splice (agent.net.splice): the response ends here."""
        self.left = 0
        if self.ex is not None:
            self.end(self.ex, True)

    def body_rest(self, left: int) -> None:
        """The splice was declined: the body's last `left` bytes come through here."""
        self.left = left

    # -- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=BULK_SIZE)

    def data_received(self, data: bytes) -> None:
        ex = self.ex
        if ex is None or self.phase == IDLE:
            self.close()  # bytes nobody asked for: never to be kept
            return
        if self.pending:
            data, self.pending = self.pending + data, b""
        try:
            self.relay(ex, data)
        except HttpError as err:
            self.pending = b""
            if self.ex is ex:
                ex.upstream_failed(err)
        except Exception as e:  # a bug must cost this exchange, never the process's log
            self.pending = b""
            self.close()
            ex.upstream_failed(HttpError(502, f"failed to relay the response: {e}"))

    def relay(self, ex: Exchange, data: bytes) -> None:
        view = memoryview(data)
        s, e = 0, len(data)
        sent = 0  # data[sent:s] is a final head, handed on with the body bytes after it
        while s < e and self.ex is ex:
            if self.phase == HEAD:
                head_end = find_head_end(data, s, min(e, s + MAX_HEAD))  # a read: 256 KiB
                if head_end < 0:
                    if e - s >= MAX_HEAD:
                        too_big = f"the {self.peer} sent a head larger than {MAX_HEAD} bytes"
                        raise HttpError(502, too_big)
                    self.pending = data[s:]
                    return
                resp = response_head(data, self.method, s, head_end)
                body = resp.body
                if resp.status < 200 and body != "tunnel":
                    ex.on_interim(resp, view[s:head_end])
                    s = sent = head_end
                    continue
                if body == "none" or (body == "length" and e - head_end >= resp.length):
                    # The usual small response: head and body in this read, relayed in one
                    # write (this very object when it is all of the read), and over (as
                    # end() below, in one call to the exchange).
                    at = head_end + resp.length
                    self.left = 0
                    self.phase = IDLE
                    self.clean = at == e and not self.eof and not self.dead
                    ex.on_whole(resp, data if s == 0 and at == e else view[s:at], self.clean)
                    s = sent = at
                    continue
                ex.on_final(resp)
                self.body, self.left = body, resp.length
                if body == "tunnel":
                    self.phase = TUNNEL
                    ex.on_data(_part(data, view, s, e))
                    ex.on_tunnel(self)
                    return
                self.phase = BODY
                self.scanner = ChunkedScanner() if body == "chunked" else None
                s = head_end  # the head goes with whatever of the body came with it: one write
                if s == e:
                    ex.on_data(_part(data, view, sent, e))
                    return
                continue
            if self.phase == TUNNEL:
                ex.on_data(_part(data, view, s, e))
                return
            # BODY
            if self.body == "length":
                k = min(e - s, self.left)
                self.left -= k
                ex.on_data(_part(data, view, sent, s + k))
                s = sent = s + k
                if self.left == 0:
                    self.end(ex, s == e)
                elif self.left >= splice.SPLICE_MIN and ex.splice_response(self):
                    return
            elif self.scanner is not None:
                at = self.chunks(data, s, e)
                ex.on_data(_part(data, view, sent, at if at >= 0 else e))
                if at < 0:
                    return
                s = sent = at
                self.end(ex, s == e)
            else:  # close-delimited: the upstream's EOF ends it
                ex.on_data(_part(data, view, sent, e))
                return

    def chunks(self, data: bytes, s: int, e: int) -> int:
        """Where the chunked body ends in data[s:e], or -1. Raises HttpError (502)."""
        assert self.scanner is not None
        try:
            return self.scanner.scan(data, s, e)
        except HttpError as err:
            raise HttpError(
                502, f"the {self.peer} sent a malformed chunked body: {err.reason}"
            ) from None

    def end(self, ex: Exchange, nothing_after: bool) -> None:
        """The response is over; `nothing_after`: no byte followed it in its read."""
        self.phase = IDLE
        self.scanner = None
        self.clean = nothing_after and not self.eof and not self.dead
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
            self.end(ex, True)
            self.close()
            return False
        where = "before answering" if self.phase == HEAD else "in the middle of a response"
        self.dead = True
        ex.upstream_gone(UpstreamGone(f"the {self.peer} closed the connection {where}"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.dead = True
        self.pending = b""
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


def _part(data: bytes, view: memoryview, s: int, e: int) -> bytes | memoryview:
    """data[s:e]: the bytes object itself when that is all of it (the client's side writes
    it with no copy), else a view (copied there)."""
    return data if s == 0 and e == len(data) else view[s:e]
