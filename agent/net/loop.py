"""The event loop providerd runs on: uvloop's (libuv, compiled), for the front, the router,
the metrics service and `providerctl serve` alike.

On asyncio's own selector loop a relayed keep-alive request cost a third more CPU than
here (the bench front, side by side: 30.9 against 23.3 µs), the loop's own work per
callback (a Handle, the selector's bookkeeping, every read and write through Python).
uvloop runs the same protocols, transports and futures.

`run(main)` is `asyncio.run(main)` on a new uvloop loop (`new_loop()`). `adopt(sock,
protocol)` makes an accepted socket a transport at once, with no task.

The package depends on python3-uvloop. A checkout run where it is not installed (the
foreground agent on a GPU host with nothing to install, say) runs on asyncio's loop, with
one warning: the data path is the same code on both.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)
_warned: list[bool] = []


def new_loop() -> asyncio.AbstractEventLoop:
    """A new event loop of the kind the product runs on: uvloop's, else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        if not _warned:
            _warned.append(True)
            log.warning(
                "uvloop is not installed (python3-uvloop): serving on asyncio's own event "
                "loop, which costs more CPU per request"
            )
        return asyncio.SelectorEventLoop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to its end on a new loop and close the loop (as `asyncio.run` does: the
    tasks left are cancelled, async generators and the default executor shut down; a first
    Ctrl-C cancels `main`)."""
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(main)


def adopt(
    sock: socket.socket,
    protocol: asyncio.BaseProtocol,
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Make the connected socket `sock` a transport driving `protocol`, now: the loop owns
    the socket from here on and calls `protocol.connection_made` in its next turn.

    A loop makes such a transport in `connect_accepted_socket`, a coroutine that builds it
    before its one wait (for connection_made). Run as a task, the transport would come a
    turn later, after a task was made for it (accepting, connecting and closing took 34.5
    µs of CPU per connection that way, 30 µs like this); here the coroutine is stepped by
    hand: once now, which makes the transport, and once more when connection_made has
    happened. A socket that cannot be a transport (not a stream) is closed, and the error
    raised."""
    opening = loop.connect_accepted_socket(lambda: protocol, sock)
    try:
        waited = opening.send(None)
    except StopIteration:
        return
    except BaseException:
        sock.close()  # not made a transport: nothing else owns the socket
        raise
    waited.add_done_callback(lambda _: _resume(opening))


def _resume(coro: Coroutine[Any, Any, Any]) -> None:
    """Step `coro` on once the future it waited on is done, until it ends."""
    try:
        waited = coro.send(None)
    except StopIteration:
        return
    except (Exception, asyncio.CancelledError) as e:
        # The transport failed before connection_made, and closed itself.
        log.debug("A connection closed before it was made: %s", e)
        return
    waited.add_done_callback(lambda _: _resume(coro))
