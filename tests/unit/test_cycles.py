"""The data path leaves no reference cycle per keep-alive request (agent.net).

A request that ends in cyclic garbage is freed only by the cyclic collector: memory that
waits for a collection, and collector time on the hot path. With the collector disabled,
100 keep-alive requests of each shape go through the proxy on real loopback sockets; one
collection with DEBUG_SAVEALL then keeps everything it would have freed in `gc.garbage`,
which must be empty. Run on asyncio's loop and on uvloop's (the one the product runs on).
"""

from __future__ import annotations

import asyncio
import collections
import gc
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from tests.support.loops import loops
from tests.unit.test_proxy import Setup, ok, read_request

N = 100
BIG = b"x" * 300_000  # more than the socket buffers: the response streams in many reads


async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Keeps its connection; answers `/chunked` chunked, `/big` with BIG, else `ok`."""
    while True:
        try:
            head, _ = await read_request(reader)
        except asyncio.IncompleteReadError:
            return
        if b" /chunked " in head:
            writer.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
            )
        elif b" /big " in head:
            writer.write(ok(BIG))
        else:
            writer.write(ok())
        await writer.drain()


REQUESTS = {
    "get": b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n",
    "post": b"POST /a HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\nbody",
    "chunked": b"GET /chunked HTTP/1.1\r\nHost: t\r\n\r\n",
    "big": b"GET /big HTTP/1.1\r\nHost: t\r\n\r\n",
    # The worker gone: each request's connect is refused and answered 503 (an exception
    # raised and caught on the way), the client's connection kept.
    "refused": b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n",
}


class Saved:
    """Between `with` and its end, the collector is off; after it, `objects` holds what one
    collection found unreachable (kept, not freed: DEBUG_SAVEALL)."""

    def __init__(self) -> None:
        self.objects: list[object] = []

    def __enter__(self) -> Saved:
        gc.collect()
        gc.garbage.clear()
        gc.disable()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
        finally:
            gc.set_debug(0)
            self.objects = list(gc.garbage)
            gc.garbage.clear()
            gc.enable()

    def by_type(self) -> dict[str, int]:
        kinds = collections.Counter(
            f"{type(o).__module__}.{type(o).__qualname__}" for o in self.objects
        )
        return dict(kinds.most_common(20))


def keep_alive(kind: str, ready_now: bool) -> Callable[[], Coroutine[Any, Any, Saved]]:
    request = REQUESTS[kind]

    async def test() -> Saved:
        async with Setup(worker) as (upstream, backend, px):
            if ready_now:  # the worker known ready: the request runs in callbacks alone
                backend.ready_now = lambda: (backend.address, backend.generation)  # type: ignore[attr-defined]
            refused = kind == "refused"
            if refused:
                await upstream.stop()
                backend.dead = True
            client = await px.connect()
            for _ in range(3):  # warm-up: the worker connection made, buffers and heads kept
                await client.send(request)
                await client.response()
            with Saved() as saved:
                for _ in range(N):
                    await client.send(request)
                    status, _, body = await client.response()
                    assert (status, bool(body)) == ((503, True) if refused else (200, True))
            # One worker connection, kept throughout (none where the worker is gone).
            assert upstream.connections == (0 if refused else 1)
            client.close()
            await px.settle()
        return saved

    return test


@pytest.mark.parametrize("run", list(loops()))
@pytest.mark.parametrize("ready_now", [False, True], ids=["awaits_ready", "ready_now"])
@pytest.mark.parametrize("kind", list(REQUESTS))
def test_keep_alive_requests_leave_no_cyclic_garbage(
    kind: str, ready_now: bool, run: Callable[[Coroutine[Any, Any, Saved]], Saved]
) -> None:
    async def bounded() -> Saved:
        async with asyncio.timeout(30):
            return await keep_alive(kind, ready_now)()

    saved = run(bounded())
    assert not saved.objects, (
        f"{len(saved.objects) / N:.2f} objects of cyclic garbage per request: {saved.by_type()}"
    )
