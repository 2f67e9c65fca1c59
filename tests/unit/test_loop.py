"""The loop the product runs on (agent.net.loop): uvloop, accepted sockets made transports
at once with no task, and writes that never send bytes changed after the call."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from typing import cast

import pytest
import uvloop

from agent.net import loop
from agent.net.answers import Style
from agent.net.client import ClientConn
from agent.net.proxy import transport_for
from agent.net.upconn import UpstreamConn


class Echo(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set_result(exc)


def pair() -> tuple[socket.socket, socket.socket]:
    """A connected loopback TCP pair as an accept gives it: (accepted, client)."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        client = socket.create_connection(listening.getsockname())
        accepted, _ = listening.accept()
    client.setblocking(False)
    return accepted, client


def test_the_product_runs_on_uvloop() -> None:
    async def kind() -> type:
        return type(asyncio.get_running_loop())

    assert loop.run(kind()) is uvloop.Loop
    assert isinstance(loop.new_loop(), uvloop.Loop)


def test_an_adopted_socket_is_a_transport_with_no_task_and_no_delay() -> None:
    async def test() -> None:
        running = asyncio.get_running_loop()
        accepted, client = pair()
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        tasks = asyncio.all_tasks()
        echo = Echo()
        accepted.setblocking(False)
        loop.adopt(accepted, echo, running)
        assert asyncio.all_tasks() == tasks  # no task for the connection
        assert echo.transport is None  # connection_made comes in the next turn
        await asyncio.sleep(0)
        assert echo.transport is not None
        # Set by the loop on a socket whose protocol number says 0 (bound by hand).
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        await running.sock_sendall(client, b"ping")
        assert await asyncio.wait_for(running.sock_recv(client, 16), 5) == b"ping"
        client.close()
        assert await asyncio.wait_for(echo.lost, 5) is None
        assert accepted.fileno() == -1  # the loop closed the socket with its transport

    loop.run(test())


def test_a_socket_that_cannot_be_a_transport_is_closed_and_the_error_raised() -> None:
    async def test() -> None:
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with pytest.raises((ValueError, TypeError, OSError)):
            loop.adopt(udp, Echo(), asyncio.get_running_loop())
        assert udp.fileno() == -1

    loop.run(test())


class NoSite:
    def exchange(self, conn: ClientConn, req: object, head_end: int) -> None:
        raise AssertionError("no request is read here")


@pytest.mark.parametrize("side", ["client", "upstream"])
def test_a_write_sends_the_bytes_of_the_moment_of_the_call(side: str) -> None:
    """Regression: uvloop sends a turn's writes at the end of the turn; a view into a pooled
    buffer that another connection refilled meanwhile went out with that connection's bytes
    (a held request's client got another client's response)."""

    async def test() -> bytes:
        running = asyncio.get_running_loop()
        accepted, client = pair()
        conn: ClientConn | UpstreamConn
        conn = ClientConn(NoSite(), Style("t")) if side == "client" else UpstreamConn(0, "worker")
        loop.adopt(accepted, conn, running)
        await asyncio.sleep(0)
        pooled = bytearray(b"first answer")
        conn.write(memoryview(pooled)[:6])
        pooled[:6] = b"SECOND"  # the buffer serves someone else before the turn ends
        conn.write(pooled[6:])
        got = b""
        async with asyncio.timeout(5):
            while len(got) < len(pooled):
                got += await running.sock_recv(client, 64)
        client.close()
        return got

    assert loop.run(test()) == b"first answer"


def test_without_uvloop_the_loop_is_asyncios_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkout run where python3-uvloop is not installed still serves, and says why it
    costs more; the data path is the same code (adopt on asyncio's loop)."""
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop: ImportError
    monkeypatch.setattr(loop, "_warned", [])

    async def echo_once() -> tuple[type, bytes]:
        running = asyncio.get_running_loop()
        accepted, client = pair()
        accepted.setblocking(False)
        echo = Echo()
        loop.adopt(accepted, echo, running)
        await running.sock_sendall(client, b"ping")
        got = await asyncio.wait_for(running.sock_recv(client, 16), 5)
        client.close()
        await asyncio.wait_for(echo.lost, 5)
        return type(running), got

    async def no_delay() -> int:
        accepted, client = pair()
        transport_for(accepted, Echo())  # as the listeners hand a connection over
        value = accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        client.close()
        return value

    with caplog.at_level(logging.WARNING):
        kind, got = loop.run(echo_once())
        nodelay = loop.run(no_delay())
    assert kind is asyncio.SelectorEventLoop and got == b"ping"
    # asyncio's loop sets it only on a socket whose protocol number says TCP; this one says 0.
    assert nodelay == 1
    warned = [r for r in caplog.records if "uvloop is not installed" in r.getMessage()]
    assert len(warned) == 1
