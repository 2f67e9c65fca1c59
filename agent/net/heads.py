"""Reading request heads from a client connection: what the front and the router share.

`HeadReader.read_head()` reads until a request head is complete and returns where it
ends in `buf`, or -1 when the connection is over. The costs a client can cause are
bounded here: a head starts in a HEAD_SIZE buffer and grows only as its bytes arrive (at
most MAX_HEAD: 431, or 414 for a request line alone); an idle connection holds no buffer;
a head must be complete within HEADER_TIMEOUT_S (of the accept for the first request,
of its first byte after that), else 408; a connection with no request for
KEEPALIVE_TIMEOUT_S is closed without an answer.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from agent.net import sockio
from agent.net.http import MAX_HEAD, find_head_end, skip_empty_lines
from agent.net.sockio import BUFFER_SIZE, HEAD_SIZE, give, take, wait_readable

log = logging.getLogger(__name__)

assert BUFFER_SIZE >= MAX_HEAD


def head_too_large(buf: bytearray, start: int, end: int) -> tuple[int, str]:
    """431, or 414 when the request line alone fills MAX_HEAD."""
    if buf.find(b"\n", start, end) < 0:
        return 414, f"request line longer than {MAX_HEAD} bytes"
    return 431, f"request head larger than {MAX_HEAD} bytes"


def grown(buf: bytearray, used: int) -> bytearray:
    """A buffer four times as large (at most BUFFER_SIZE) with buf[:used] in it."""
    bigger = take(BUFFER_SIZE) if len(buf) * 4 >= BUFFER_SIZE else bytearray(len(buf) * 4)
    bigger[:used] = buf[:used]
    give(buf)
    return bigger


class HeadReader:
    """The client side of one connection up to a request head. A subclass answers the
    heads that cannot be read (`refuse_head`)."""

    loop: asyncio.AbstractEventLoop
    client: socket.socket
    buf: bytearray | None  # what the client sent and was not yet forwarded
    start: int
    end: int
    client_eof: bool
    head_deadline: float | None  # None: no head begun

    def begin_reading(self) -> None:
        self.buf = None
        self.start = self.end = 0
        self.client_eof = False
        self.head_deadline = self.loop.time() + sockio.HEADER_TIMEOUT_S

    async def refuse_head(self, status: int, error: str) -> int:
        """Answer a head that cannot be read (408, 414, 431); returns -1."""
        raise NotImplementedError

    def release_buffer(self) -> None:
        """Give the buffer back if nothing is pending in it."""
        if self.buf is not None and self.start == self.end:
            give(self.buf)
            self.buf = None
            self.start = self.end = 0

    async def read_head(self) -> int:
        """Read until a request head is complete; the index past its blank line, or -1 if
        the connection ended (cleanly, by a timeout, or after an answer)."""
        while True:
            buf = self.buf
            if buf is not None:
                self.start = skip_empty_lines(buf, self.start, self.end)
                pending = self.end - self.start
                if pending:
                    if self.head_deadline is None:
                        self.head_deadline = self.loop.time() + sockio.HEADER_TIMEOUT_S
                    head_end = find_head_end(buf, self.start, self.end)
                    if head_end >= 0:
                        self.head_deadline = None  # the next head's clock starts at its byte
                        return head_end
                    if pending >= MAX_HEAD:
                        return await self.refuse_head(*head_too_large(buf, self.start, self.end))
                    if self.end == len(buf):
                        if self.start == 0:  # a head that fills a buffer: a larger one
                            self.buf = buf = grown(buf, self.end)
                        else:
                            buf[:pending] = buf[self.start : self.end]
                            self.start, self.end = 0, pending
                else:
                    self.start = self.end = 0
                    if len(buf) not in (HEAD_SIZE, BUFFER_SIZE):  # a body's buffer goes now
                        self.buf = buf = None
            if self.client_eof:
                return -1
            if buf is None:
                buf = self.buf = take(HEAD_SIZE)
            try:
                n = self.client.recv_into(memoryview(buf)[self.end :])
            except BlockingIOError:
                self.release_buffer()  # an idle connection holds no buffer
                deadline = self.head_deadline
                if deadline is None:
                    deadline = self.loop.time() + sockio.KEEPALIVE_TIMEOUT_S
                if not await wait_readable(self.loop, self.client, deadline):
                    if self.end > self.start:
                        return await self.refuse_head(
                            408,
                            f"request head not complete within {sockio.HEADER_TIMEOUT_S:g} s",
                        )
                    log.debug("Closing a connection idle for its time limit")
                    return -1
                continue
            except OSError:
                self.client_eof = True
                return -1
            if n == 0:
                self.client_eof = True
                if self.end > self.start:
                    log.debug("Client closed the connection in the middle of a request head")
                return -1
            self.end += n
