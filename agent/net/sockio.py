"""Socket and buffer primitives of the relays (agent.net.proxy, agent.router.router).

Non-blocking sockets driven by an asyncio loop: pooled buffers, TCP_NODELAY, a check
that an idle upstream connection can be reused, a wait for readability that holds no
buffer, a connect to an `Address`, and a close that lets the peer read our last answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

from agent.spec.provider import Address

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


def shutdown_write(sock: socket.socket) -> None:
    """Half-close: the peer reads EOF after what was sent; errors are ignored."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)


def still_open(sock: socket.socket) -> bool:
    """An idle upstream connection can be reused: no EOF, no error, nothing unexpected to read."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


async def wait_readable(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, deadline: float | None = None
) -> bool:
    """Wait until `sock` has something to read (data, EOF or an error), holding no buffer.
    False if `deadline` (loop time) came first."""
    fut: asyncio.Future[bool] = loop.create_future()
    fd = sock.fileno()

    def wake(result: bool = True) -> None:
        if not fut.done():
            fut.set_result(result)

    loop.add_reader(fd, wake)
    timer = loop.call_at(deadline, wake, False) if deadline is not None else None
    try:
        return await fut
    finally:
        loop.remove_reader(fd)
        if timer is not None:
            timer.cancel()


async def recv_within(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, into: memoryview, timeout_s: float
) -> int:
    """recv_into() that waits at most `timeout_s` for bytes to come. Raises TimeoutError,
    OSError."""
    while True:
        try:
            return sock.recv_into(into)
        except (BlockingIOError, InterruptedError):
            pass
        if not await wait_readable(loop, sock, loop.time() + timeout_s):
            raise TimeoutError()


def error_text(e: OSError) -> str:
    """What an OSError says, as a person reads it ("Connection refused")."""
    return os.strerror(e.errno) if e.errno else str(e)


def bind_loopback_source(sock: socket.socket, target: object) -> None:
    """To a loopback address other than 127.0.0.1 (a host-network worker's own), connect
    from that address: the worker's IP filter admits only it (agent.systemd.units.worker_loopback)."""
    if isinstance(target, tuple) and sock.family == socket.AF_INET:
        host = str(target[0])
        if host.startswith("127.") and host != "127.0.0.1":
            sock.bind((host, 0))


async def connect(loop: asyncio.AbstractEventLoop, address: Address) -> socket.socket:
    """A non-blocking stream connection to `address` (no host: 127.0.0.1), TCP_NODELAY set.
    Raises OSError (the socket closed) if it cannot be reached."""
    if address.path is not None:
        family, target = socket.AF_UNIX, address.path
    else:
        host = address.host or "127.0.0.1"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        target = (host, address.port or 0)  # type: ignore[assignment]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        bind_loopback_source(sock, target)
        await loop.sock_connect(sock, target)
    except BaseException:
        sock.close()
        raise
    nodelay(sock)
    return sock


async def close_lingering(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, linger: bool
) -> None:
    """Close a client connection. With `linger` (we answered and close first while the
    client may still send): shut down writing, read and drop for up to LINGER_S, then
    close. Closing with unread input makes the kernel send a reset that can destroy our
    answer before the client reads it."""
    try:
        if linger:
            shutdown_write(sock)
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(LINGER_S):
                    drain = bytearray(4096)
                    while await loop.sock_recv_into(sock, drain):
                        pass
    finally:
        sock.close()
