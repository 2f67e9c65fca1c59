"""The worker's side of the data path: how many requests it gets at once, and its connections.

`Upstream` admits at most `limit` requests to the worker at once (`[runtime]
max_concurrency`); the others wait in arrival order (FIFO) and a wait beyond `max_waiting`
is refused at once. Each admitted request uses one connection to the worker, a kept one
if one is idle, so the worker never has more than `limit` connections open from the front:
a model server with a small accept queue (Python's `ThreadingHTTPServer` has 5) is never
flooded, however many clients arrive at once.

`connect_retrying` opens a connection, retrying refused, reset and would-block connects
with a short backoff while the worker is alive (a worker briefly behind on its accept
queue is not a client error).
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from agent.errors import ProviderdError
from agent.net.sockio import connect_to, nodelay
from agent.spec.provider import Address

RETRY_FIRST_S = 0.01
RETRY_MAX_S = 0.25
RETRY_FOR_S = 10.0  # a worker that refuses connections this long is not coming back soon
IDLE_MAX = 1024  # idle connections kept (never more than `limit`)
# A kept connection idle longer is closed, not reused: servers close idle keep-alive
# connections on timers of their own (gunicorn 2 s, uvicorn and Node 5 s), and one closed
# just as a request goes out fails that request.
KEEP_IDLE_S = 1.0

# connect() errors that mean "not now" rather than "not there".
RETRYABLE = frozenset(
    {errno.ECONNREFUSED, errno.ECONNRESET, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNABORTED}
)


class Kept(Protocol):
    """A connection between responses: the pool asks whether it is still good, or closes it."""

    def usable(self) -> bool: ...

    def close(self) -> None: ...


class QueueFull(ProviderdError):
    """More requests wait than `max_waiting`."""

    code = "too_many_waiting"


class Upstream:
    def __init__(
        self, limit: int, max_waiting: int, on_full: Callable[[], None] | None = None
    ) -> None:
        self.limit = limit
        self.max_waiting = max_waiting
        self.on_full = on_full  # called for each request refused because too many wait
        self.in_use = 0
        self.idle_max = min(limit, IDLE_MAX)
        self._waiters: deque[asyncio.Future[None]] = deque()
        # (connection, worker generation, when it went idle), the most recent last
        self._idle: list[tuple[Kept, int, float]] = []

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, also_waiting: int = 0) -> None:
        """Wait for a slot, after everyone who waited before. Raises QueueFull when
        `also_waiting` (waiting elsewhere, for the start) plus those waiting here already
        reach `max_waiting`. Cancellation leaves the queue."""
        fut = self.join(also_waiting)
        if fut is not None:
            await self.wait(fut)

    def join(self, also_waiting: int = 0) -> asyncio.Future[None] | None:
        """acquire()'s first half, at once: None (a slot now), or the place in the queue to
        `wait()` on, or to `leave()` unawaited. Raises QueueFull as acquire() does."""
        if self.in_use < self.limit and not self._waiters:
            self.in_use += 1
            return None
        if len(self._waiters) + also_waiting >= self.max_waiting:
            if self.on_full is not None:
                self.on_full()
            raise QueueFull()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return fut

    def leave(self, fut: asyncio.Future[None]) -> None:
        """Give up a place from join() that was never waited on (its slot passes on if it
        was granted already)."""
        if fut.done() and not fut.cancelled():
            self.release()
        elif fut in self._waiters:
            self._waiters.remove(fut)
            fut.cancel()

    async def wait(self, fut: asyncio.Future[None]) -> None:
        """Wait on a place from join() until its slot is granted. Cancellation leaves the
        queue (or passes on a slot granted in the same turn)."""
        try:
            await fut
        except BaseException:
            self.leave(fut)  # granted and cancelled in the same turn: the slot passes on
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes on; in_use stays
                return
        self.in_use -= 1

    def take_idle(self, generation: int) -> Kept | None:
        """A kept connection to worker `generation` that is still open, or None."""
        idle = self._idle
        if not idle:
            return None
        fresh_since = time.monotonic() - KEEP_IDLE_S
        while idle:
            sock, gen, since = idle.pop()
            if gen == generation and since >= fresh_since and sock.usable():
                return sock
            sock.close()
        return None

    def keep(self, sock: Kept, generation: int) -> None:
        """Keep a connection whose last response ended cleanly, for the next request; those
        kept too long to be reused (the oldest come first) are closed."""
        now = time.monotonic()
        idle = self._idle
        if idle and idle[0][2] < now - KEEP_IDLE_S:
            stale = now - KEEP_IDLE_S
            while idle and idle[0][2] < stale:
                idle.pop(0)[0].close()
        if len(idle) < self.idle_max:
            idle.append((sock, generation, now))
        else:
            sock.close()

    def clear(self) -> None:
        """The worker is gone: close the kept connections."""
        for sock, _, _ in self._idle:
            sock.close()
        self._idle.clear()


async def connect(
    loop: asyncio.AbstractEventLoop, address: Address, source: str | None = None
) -> socket.socket:
    """A non-blocking stream connection to `address` (no host: 127.0.0.1), TCP_NODELAY set,
    from the local address `source` if given. Raises OSError (the socket closed)."""
    target: str | tuple[str, int]
    if address.path is not None:
        family, target = socket.AF_UNIX, address.path
    else:
        host = address.host or "127.0.0.1"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        target = (host, address.port or 0)
    sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        if source is not None and family != socket.AF_UNIX:
            sock.bind((source, 0))
        await connect_to(loop, sock, target)
    except BaseException:
        sock.close()
        raise
    nodelay(sock)
    return sock


async def connect_retrying(
    loop: asyncio.AbstractEventLoop,
    address: Address,
    alive: Callable[[], bool],
    source: str | None = None,
) -> socket.socket:
    """Connect to `address` (from `source`); a refused, reset or would-block connect is tried
    again with a growing delay while `alive()`. All of it takes at most RETRY_FOR_S, a connect
    the worker never completes too (its accept queue full, the kernel drops the SYNs: else
    up to two minutes of retransmits). Raises OSError (TimeoutError at the deadline)."""
    delay = RETRY_FIRST_S
    give_up = loop.time() + RETRY_FOR_S
    while True:
        deadline = asyncio.timeout_at(give_up)
        try:
            async with deadline:
                return await connect(loop, address, source)
        except OSError as e:
            if deadline.expired():
                raise TimeoutError(errno.ETIMEDOUT, os.strerror(errno.ETIMEDOUT)) from None
            if e.errno not in RETRYABLE or not alive() or loop.time() + delay > give_up:
                raise
        await asyncio.sleep(delay)
        delay = min(RETRY_MAX_S, delay * 2)
