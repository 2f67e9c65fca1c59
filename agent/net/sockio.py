"""Buffer and socket primitives of the connection core (agent.net.client, agent.net.upconn):
pooled buffers, TCP_NODELAY, the client time limits, error texts, a connect with no resolver.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import select
import socket

HEAD_SIZE = 4 * 1024  # a head's first buffer; grown to BUFFER_SIZE only if the head needs it
BUFFER_SIZE = 64 * 1024  # heads and small bodies; must hold a whole head (http.MAX_HEAD)
BULK_SIZE = 256 * 1024  # large bodies and busy tunnels, per direction
LINGER_S = 2.0  # after answering and closing first, read and drop what the client still sends
POOL_MAX = 64  # buffers kept per size

# What a client may take (nginx: client_header_timeout, keepalive_timeout, client_body_timeout).
HEADER_TIMEOUT_S = 10.0  # from a head's first byte (a new connection: from its accept) to its end
KEEPALIVE_TIMEOUT_S = 60.0  # an open connection with no request
BODY_TIMEOUT_S = 60.0  # between two reads of a request body

# Free buffers by size. A buffer of another size (one grown for a whole body) is not kept.
pools: dict[int, list[bytearray]] = {HEAD_SIZE: [], BUFFER_SIZE: [], BULK_SIZE: []}


def take(size: int = BUFFER_SIZE) -> bytearray:
    """A buffer of `size` bytes (HEAD_SIZE, BUFFER_SIZE or BULK_SIZE), from the pool if it has one."""
    pool = pools[size]
    return pool.pop() if pool else bytearray(size)


def give(buf: bytearray) -> None:
    """Return a buffer to its pool; kept only if it has a pooled size and the pool has room."""
    pool = pools.get(len(buf))
    if pool is not None and len(pool) < POOL_MAX:
        pool.append(buf)


def nodelay(sock: socket.socket) -> None:
    """Send small writes at once (TCP only; unix sockets have no Nagle)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def error_text(e: OSError) -> str:
    """What an OSError says, as a person reads it ("Connection refused")."""
    return os.strerror(e.errno) if e.errno else str(e)


async def connect_to(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    target: str | tuple[str, int],
    timeout_s: float | None = None,
) -> None:
    """Connect the non-blocking `sock` to `target`: a numeric (host, port), or a unix socket
    path. Raises OSError (TimeoutError after `timeout_s`, if given): a unix socket whose
    accept queue is full raises EAGAIN at once, as a refused TCP connect does ECONNREFUSED.

    Not the loop's sock_connect: uvloop's resolves every address, numeric ones too, in
    libuv's thread pool, whose first use starts its four threads (3 ms of a cold start's
    first request, 2 of them the front's CPU; 10 ms under systemd on a busy host), and each
    later connect makes a round trip through it. A loopback connect is settled as soon as
    it is sent: looked at at once (poll, no wait, ~10 us); only one still under way waits
    on the loop. A host must be an IP address (names would be looked up here, blocking):
    a scoped IPv6 one ("fe80::1%eth0") is turned into its 4-tuple first, numerically."""
    if isinstance(target, tuple) and "%" in target[0]:  # connect_ex would drop the scope
        flags = socket.AI_NUMERICHOST | socket.AI_NUMERICSERV
        target = socket.getaddrinfo(*target, socket.AF_INET6, socket.SOCK_STREAM, 0, flags)[0][4]  # type: ignore[assignment]
    err = sock.connect_ex(target)
    if err == errno.EINPROGRESS:
        poller = select.poll()
        poller.register(sock, select.POLLOUT)
        if not poller.poll(0):
            writable: asyncio.Future[None] = loop.create_future()

            def ready() -> None:
                if not writable.done():
                    writable.set_result(None)

            loop.add_writer(sock, ready)
            try:
                await asyncio.wait_for(writable, timeout_s)
            finally:
                loop.remove_writer(sock)
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise OSError(err, os.strerror(err))
