"""Signal handlers on the event loop, put back as they were when the work they serve ends.

`asyncio`'s own `remove_signal_handler` leaves SIG_DFL (or Python's SIGINT handler)
behind, whatever was there before; `handling()` restores exactly what it replaced, as
the worker wrapper does with its own handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator, Mapping


@contextlib.contextmanager
def handling(
    loop: asyncio.AbstractEventLoop, handlers: Mapping[int, Callable[[], object]]
) -> Iterator[None]:
    """Run `handlers[sig]()` on `loop` for each signal while the block runs; restore after."""
    previous = {sig: signal.getsignal(sig) for sig in handlers}
    try:
        for sig, handler in handlers.items():
            loop.add_signal_handler(sig, handler)
        yield
    finally:
        for sig, before in previous.items():
            loop.remove_signal_handler(sig)
            if before is not None:  # None: not set from Python; nothing to put back
                signal.signal(sig, before)
