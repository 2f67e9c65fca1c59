"""ClientConn (agent.net.client): its reading pauses, on a transport that records them; its
deadlines."""

from __future__ import annotations

import asyncio
import socket

import pytest

from agent.net import client
from agent.net.answers import Style
from agent.net.client import ClientConn
from agent.net.proxy import accept_http


class Recording(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


class NoSite:
    def exchange(self, conn: ClientConn, req: object, head_end: int) -> None:
        raise AssertionError("no request is sent")


def test_a_request_that_ends_leaves_none_of_its_pauses_behind() -> None:
    """The upstream side that was full when the request ended never says it drained to
    this connection (its connection may serve another by then): the end resumes reading."""

    async def test() -> None:
        conn = ClientConn(NoSite(), Style("t"))
        transport = Recording()
        conn.connection_made(transport)
        for why in (client.PAUSE_AHEAD, client.PAUSE_UPSTREAM, client.PAUSE_WAIT):
            conn.pause(why, True)
            assert not transport.reading
            conn.request_done(keep=True)
            assert transport.reading and conn.paused == 0

    asyncio.run(test())


def test_a_deadline_moved_after_a_timer_that_rounds_to_now_is_kept() -> None:
    """On uvloop a call_at whose delay rounds to 0 ms is a plain Handle (no when()): moving
    the deadline again must not need it, and the earliest deadline still fires."""

    async def test() -> None:
        loop = asyncio.get_running_loop()
        conn = ClientConn(NoSite(), Style("t"))
        transport = Recording()
        conn.connection_made(transport)
        conn.deadline(loop.time() - 1.0, "idle")  # already past: a delay of 0
        conn.deadline(loop.time() + 60.0, "idle")  # later: the armed timer stays
        conn.deadline(loop.time() - 0.5, "idle")  # earlier again
        for _ in range(50):
            await asyncio.sleep(0.002)
            if conn.closing or conn.closed:
                break
        assert conn.closing or conn.closed, "the idle deadline in the past did not close it"

    asyncio.run(test())


def test_a_connection_answered_and_closed_first_lingers_for_its_time_then_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a 400 the connection shuts down writing and reads and drops what the client
    still sends for LINGER_S (its deadline on the loop's queue), then closes."""
    monkeypatch.setattr(client, "LINGER_S", 0.3)

    async def go() -> tuple[bytes, float, float]:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        closed = loop.create_future()
        accept_http(ours, NoSite(), Style("t"), lambda: closed.set_result(loop.time()))
        try:
            await loop.sock_sendall(theirs, b"BAD\r\n\r\n")
            sent = loop.time()
            answer = b""
            async with asyncio.timeout(5):
                while chunk := await loop.sock_recv(theirs, 4096):  # to the answer's EOF
                    answer += chunk
            await loop.sock_sendall(theirs, b"more the client still sends")
            async with asyncio.timeout(5):
                at = await closed
        finally:
            theirs.close()
        return answer, sent, at

    answer, sent, at = asyncio.run(go())
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert at - sent >= 0.3 - 0.01  # not before its linger (less the loop's ms steps)
