"""A request held while its target is not there yet (a cold start, a full max_concurrency)
whose body is still to come: the body's inactivity limit (sockio.BODY_TIMEOUT_S) runs while
it is held, as once it reaches the worker; the front reads ahead at most exchange.HELD_MAX
of it, and a client blocked only because the front stopped reading is not timed out.

The front is test_proxy's FakeBackend: its `gate` is the activation (cleared: the worker
is starting)."""

from __future__ import annotations

import asyncio
import gc
import json
from typing import Any

import pytest

from agent.net import exchange, sockio
from agent.net.client import PAUSE_WAIT, ClientConn
from agent.net.exchange import Exchange
from tests.unit.test_proxy import FakeBackend, Setup, echo_worker, run


async def held(backend: FakeBackend, n: int = 1) -> None:
    async with asyncio.timeout(2):
        while backend.waiting < n:
            await asyncio.sleep(0.005)


def exchanges() -> list[Exchange]:
    return [o for o in gc.get_objects() if isinstance(o, Exchange) and not o.over]


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n123",
        b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    ],
    ids=["part-of-the-body", "head-only", "chunked"],
)
def test_a_held_request_whose_body_stops_coming_gets_408_and_stops_waiting(
    monkeypatch: pytest.MonkeyPatch, request_bytes: bytes
) -> None:
    monkeypatch.setattr(sockio, "BODY_TIMEOUT_S", 0.3)

    async def test() -> None:
        async with Setup(echo_worker) as (worker, backend, px):
            backend.gate.clear()  # the worker is starting, and stays so
            client = await px.connect()
            await client.send(request_bytes)
            await held(backend)
            loop = asyncio.get_running_loop()
            began = loop.time()
            async with asyncio.timeout(3):
                status, headers, body = await client.response()
            assert status == 408 and headers["connection"] == "close"
            assert json.loads(body)["error"] == "request_timeout"
            assert 0.25 <= loop.time() - began < 2.5
            assert await client.eof()
            # It waits no more: its lease is back and it no longer counts as waiting.
            assert backend.active == 0 and backend.waiting == 0 and backend.ready_cancelled == 1
            assert worker.connections == 0
            client.close()
            await px.settle()

    run(test)


def test_a_held_body_that_keeps_coming_is_not_timed_out_and_arrives_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sockio, "BODY_TIMEOUT_S", 0.5)

    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            backend.gate.clear()
            client = await px.connect()
            await client.send(b"POST /slow HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\n")
            await held(backend)
            for i in range(10):  # 1 s in all, twice the limit; a byte every 0.1 s
                await asyncio.sleep(0.1)
                await client.send(b"%d" % i)
            await asyncio.sleep(0.8)  # whole and still held: no body limit any more
            backend.gate.set()
            assert await client.response() == (
                200,
                {"content-length": "21"},
                b"POST /slow 0123456789",
            )
            client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_a_held_client_blocked_by_the_fronts_own_back_pressure_is_not_timed_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sockio, "BODY_TIMEOUT_S", 0.3)
    size = 4 * 1024 * 1024  # more than the kernel's buffers take: the client is blocked

    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            backend.gate.clear()
            client = await px.connect()
            body = bytes(range(256)) * (size // 256)
            head = b"POST /big HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % size
            sending = asyncio.create_task(client.send(head + body))
            await held(backend)
            await asyncio.sleep(1.0)  # three times the limit, the front not reading
            assert not sending.done()  # blocked: the front stopped reading
            (ex,) = exchanges()
            # Read ahead: at most HELD_MAX of the request, and one read (a head-sized buffer).
            assert 0 < len(ex.data) <= exchange.HELD_MAX + sockio.HEAD_SIZE
            assert ex.conn.paused and not ex.over
            backend.gate.set()
            status, _, echoed = await client.response()
            assert status == 200 and echoed == b"POST /big " + body
            await sending
            client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_a_held_request_with_its_whole_body_waits_past_the_body_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sockio, "BODY_TIMEOUT_S", 0.2)

    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            backend.gate.clear()
            client = await px.connect()
            await client.send(b"POST /w HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nok")
            await held(backend)
            await asyncio.sleep(0.6)
            backend.gate.set()
            assert (await client.response())[2] == b"POST /w ok"
            client.close()
            await px.settle()

    run(test)


def test_a_held_request_that_waits_for_100_continue_is_timed_from_its_first_body_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing asked it for its body yet: it is not idle. Once it sends some anyway (curl
    does after a second), the body's limit runs."""
    monkeypatch.setattr(sockio, "BODY_TIMEOUT_S", 0.3)
    head = b"POST /e HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n"

    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            backend.gate.clear()
            waits = await px.connect()
            await waits.send(head)
            stalls = await px.connect()
            await stalls.send(head)
            await held(backend, 2)
            await asyncio.sleep(0.6)  # twice the limit, waiting for `100 Continue`
            await stalls.send(b"ab")  # then half its body, and nothing more
            status, _, _ = await stalls.response()
            assert status == 408
            await waits.send(b"body")
            backend.gate.set()
            status, _, body = await waits.response()
            assert (status, body) == (200, b"POST /e body")
            for client in (waits, stalls):
                client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_a_held_request_whose_read_ahead_was_full_gets_one_deadline_as_it_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading again and the body's limit, in one step: not first the response's (set
    while the read-ahead's pause still stops the body's) and then the body's."""
    size = 4 * 1024 * 1024
    calls: list[tuple[float | None, float]] = []  # (due, what the limits make due then)
    attaching: list[Exchange] = []
    attach, deadline = Exchange.attach, ClientConn.deadline

    def attach_spy(self: Exchange, up: Any, reused: bool) -> None:
        attaching.append(self)
        try:
            attach(self, up, reused)
        finally:
            attaching.pop()

    def deadline_spy(self: ClientConn, due: float | None, kind: str) -> None:
        if attaching and attaching[-1].conn is self:
            ex = attaching[-1]
            limit = ex.site.request_timeout_s
            calls.append((due, min(ex.last + limit, ex.body_last + sockio.BODY_TIMEOUT_S)))
        deadline(self, due, kind)

    monkeypatch.setattr(Exchange, "attach", attach_spy)
    monkeypatch.setattr(ClientConn, "deadline", deadline_spy)

    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            backend.gate.clear()
            client = await px.connect()
            body = bytes(range(256)) * (size // 256)
            head = b"POST /big HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % size
            sending = asyncio.create_task(client.send(head + body))
            await held(backend)
            await asyncio.sleep(0.2)
            (ex,) = exchanges()
            assert ex.conn.paused & PAUSE_WAIT  # the read-ahead is full
            backend.gate.set()
            status, _, echoed = await client.response()
            assert status == 200 and echoed == b"POST /big " + body
            (call,) = calls  # one deadline: the earlier of the two limits
            assert call[0] == call[1]
            await sending
            client.close()
            await px.settle()

    run(test)


def test_a_held_request_completed_past_the_read_ahead_is_still_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The read that completes a request of HELD_MAX or more does not stop the front
    reading: the client's leaving is seen while it is held (it stops waiting)."""
    size = exchange.HELD_MAX - 10  # with the head: past HELD_MAX, the body in one read

    async def test() -> None:
        async with Setup(echo_worker) as (worker, backend, px):
            backend.gate.clear()
            client = await px.connect()
            await client.send(b"POST /b HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % size)
            await held(backend)
            await client.send(b"x" * size)  # the whole body, in a read after the head's
            await asyncio.sleep(0.1)
            (ex,) = exchanges()
            assert ex.consumed and not ex.conn.paused
            client.close()  # the client leaves: the request waits no more
            async with asyncio.timeout(2):
                while backend.waiting:
                    await asyncio.sleep(0.01)
            assert backend.ready_cancelled == 1 and backend.active == 0
            assert worker.connections == 0
            await px.settle()

    run(test)
