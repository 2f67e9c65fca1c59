"""ClientConn's reading pauses (agent.net.client), on a transport that records them."""

from __future__ import annotations

import asyncio

from agent.net import client
from agent.net.answers import Style
from agent.net.client import ClientConn


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
