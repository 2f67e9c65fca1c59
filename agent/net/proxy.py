"""Entry points of the core: hand an accepted socket to it.

`accept_http(sock, site, style, on_closed)` makes the socket an asyncio transport with a
`ClientConn` and returns at once (no task: a held or idle connection costs its transport
and protocol only). `serve_http(client, backend)` and `serve_tcp(client, backend)` do the
same and wait until the connection is over, for callers that want a task per connection;
cancelling that task ends the connection and releases what it holds.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from agent.net.answers import Style
from agent.net.client import ClientConn, Site
from agent.net.contract import Lease
from agent.net.loop import adopt
from agent.net.site import Backend, FrontSite, Unavailable, too_many_waiting
from agent.net.sockio import nodelay
from agent.net.tcp import TcpRelay

__all__ = [
    "Backend",
    "ClientConn",
    "FrontSite",
    "Lease",
    "Style",
    "Unavailable",
    "accept_http",
    "serve_http",
    "serve_tcp",
    "too_many_waiting",
]

log = logging.getLogger(__name__)


def transport_for(
    sock: socket.socket,
    protocol: asyncio.BaseProtocol,
    loop: asyncio.AbstractEventLoop | None = None,
) -> None:
    """An accepted socket as a transport driving `protocol`, made at once, with no task
    (`agent.net.loop.adopt`; connection_made runs in the next turn of the loop, as for any
    new transport). uvloop sets TCP_NODELAY on every TCP socket; asyncio's loop only on one
    whose protocol says TCP (those systemd passes), so one that says 0 (bound here, in the
    foreground) gets it here. `loop` spares a look-up (a getpid() each) per connection."""
    loop = loop or asyncio.get_running_loop()
    sock.setblocking(False)
    if sock.proto != socket.IPPROTO_TCP:
        nodelay(sock)
    adopt(sock, protocol, loop)


def accept_http(
    sock: socket.socket,
    site: Site,
    style: Style,
    on_closed: Callable[[], None] | None,
    loop: asyncio.AbstractEventLoop | None = None,
) -> ClientConn:
    """Serve HTTP on an accepted socket from now on; `on_closed` runs once it is gone."""
    loop = loop or asyncio.get_running_loop()
    conn = ClientConn(site, style, on_closed, loop)
    transport_for(sock, conn, loop)
    return conn


async def serve_http(client: socket.socket, backend: Backend) -> None:
    """Serve one accepted HTTP client connection until it ends. Never raises (except
    CancelledError when the task is cancelled); always closes `client` and releases leases."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def closed() -> None:
        if not done.done():
            done.set_result(None)

    conn = accept_http(client, FrontSite(backend), Style(backend.slug), closed)
    try:
        await done
    except asyncio.CancelledError:
        conn.abort()
        raise


async def serve_tcp(client: socket.socket, backend: Backend) -> None:
    """Relay one accepted TCP client connection to the worker; the connection is one lease.
    Never raises (except CancelledError when the task is cancelled); always closes `client`."""
    loop = asyncio.get_running_loop()
    relay = TcpRelay()
    transport_for(client, relay.client)
    lease: Lease | None = None
    try:
        lease = backend.lease(None)
        address, generation = await relay.watched(backend.ready())
        source = getattr(backend, "source", None)
        await relay.connect(loop, address, lambda: backend.alive(generation), source)
        await relay.done
    except asyncio.CancelledError:
        relay.close()
        if not relay.gave_up:
            raise
    except Unavailable as e:
        log.debug("Closing a TCP connection: %s", e.error)
    except Exception as e:
        log.debug("Failed to relay a TCP connection: %s", e, exc_info=True)
    finally:
        if lease is not None:
            lease.release()
        relay.close()
