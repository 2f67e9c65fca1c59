"""The opaque TCP relay (`protocol = "tcp"`): bytes both ways between two transports,
half-close aware, with back-pressure (a side whose peer's write buffer is full stops
reading). While the worker is not there yet, the client's first bytes wait (bounded) and
its EOF means it gave up. Once both sides are there, the bytes go socket to socket in the
kernel (agent.net.splice), each way until its EOF, which is passed on; where the kernel
declines, the transports carry them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

from agent.errors import ProviderdError
from agent.net.sockio import BUFFER_SIZE, BULK_SIZE
from agent.net.splice import AVAILABLE, Pump
from agent.net.upstream import connect_retrying
from agent.spec.provider import Address

T = TypeVar("T")


class ClientGone(ProviderdError):
    """The client closed its connection while it waited."""

    code = "client_gone"


class _Side(asyncio.Protocol):
    def __init__(self, relay: TcpRelay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.eof = False
        self.held = bytearray()  # what came before the peer was there
        self.pump: Pump | None = None  # this side's bytes to the peer, in the kernel

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=BULK_SIZE)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
            return
        self.held += data
        if len(self.held) >= BUFFER_SIZE and self.transport is not None:
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        peer = self.peer
        if peer is None:
            self.relay.gone()
            return False
        if peer.eof:
            self.relay.close()
            return False
        if peer.transport is not None and peer.transport.can_write_eof():
            peer.transport.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.relay.close()

    def pause_writing(self) -> None:
        transport = self._peer_reading()
        if transport is not None:
            transport.pause_reading()

    def resume_writing(self) -> None:
        transport = self._peer_reading()
        if transport is not None:
            transport.resume_reading()

    def _peer_reading(self) -> asyncio.Transport | None:
        """The peer's transport where it reads for this side (not a pump) and is still open:
        this side may drain its buffer, and say so, after the peer has gone."""
        peer = self.peer
        if peer is None or peer.pump is not None or peer.transport is None:
            return None
        return None if peer.transport.is_closing() else peer.transport

    def link(self, peer: _Side) -> None:
        self.peer = peer
        if self.held and peer.transport is not None:
            peer.transport.write(bytes(self.held))
            self.held.clear()
            if self.transport is not None:
                self.transport.resume_reading()
        if self.eof and peer.transport is not None and peer.transport.can_write_eof():
            peer.transport.write_eof()


class TcpRelay:
    def __init__(self) -> None:
        self.client = _Side(self)
        self.up: _Side | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.gave_up = False
        self._waiting: asyncio.Task[Any] | None = None

    def gone(self) -> None:
        """The client's EOF before the worker was there: it gave up."""
        self.gave_up = True
        if self._waiting is not None:
            self._waiting.cancel()
        self.close()

    async def watched(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` as a task that the client's leaving cancels (ClientGone)."""
        task = asyncio.ensure_future(coro)
        self._waiting = task
        try:
            return await task
        finally:
            self._waiting = None

    async def connect(
        self,
        loop: asyncio.AbstractEventLoop,
        address: Address,
        alive: Callable[[], bool],
        source: str | None,
    ) -> None:
        sock = await self.watched(connect_retrying(loop, address, alive, source))
        if self.done.done():
            sock.close()
            return
        up = _Side(self)
        await loop.connect_accepted_socket(lambda: up, sock)
        self.up = up
        up.link(self.client)
        self.client.link(up)
        if AVAILABLE:
            for side in (self.client, up):
                self.splice(loop, side)

    # -- both ways in the kernel

    def splice(self, loop: asyncio.AbstractEventLoop, side: _Side) -> None:
        peer = side.peer
        if side.eof or side.transport is None or peer is None or peer.transport is None:
            return
        try:
            side.pump = Pump(
                loop, self, 0 if side is self.client else 1, side.transport, peer.transport, -1
            )
        except OSError:
            return
        side.transport.pause_reading()
        side.pump.start()

    def side_of(self, pump: Pump) -> _Side | None:
        side = self.client if pump.role == 0 else self.up
        return side if side is not None and side.pump is pump else None

    def pump_moved(self, pump: Pump, taken: bool) -> None:
        pass

    def pump_end(self, pump: Pump) -> None:
        """The side's EOF, everything before it passed on."""
        side = self.side_of(pump)
        if side is not None:
            side.pump = None
            side.eof_received()

    def pump_failed(self, pump: Pump, e: OSError, at_source: bool) -> None:
        self.close()

    def pump_declined(self, pump: Pump, held: bytes) -> None:
        side = self.side_of(pump)
        if side is None or side.transport is None or side.peer is None:
            return
        side.pump = None
        # Reading back on first: a write of `held` over the peer's limit pauses it again.
        side.transport.resume_reading()
        if held and side.peer.transport is not None:
            side.peer.transport.write(held)

    def close(self) -> None:
        for side in (self.client, self.up):
            if side is not None and side.pump is not None:
                side.pump.stop()
                side.pump = None
        for side in (self.client, self.up):
            if side is not None and side.transport is not None:
                side.transport.close()
        if not self.done.done():
            self.done.set_result(None)
