"""One queue of deadlines per event loop: every client connection's time limits (head,
keep-alive idle, linger, a request's inactivity) and a listener's first-request grace
ride on it, and the loop holds ONE timer, for the earliest entry.

A loop timer per connection cost a uvloop TimerHandle (a libuv timer and its Python
objects, about 610 bytes each, measured); an entry here is a list [due, seq, target] in a
heap, about 160 bytes, and costs a push, no loop call.

A target is any object with `due` (its deadline in loop time, or None), `queued` (its
entry, kept for it by the queue) and `expire()`. Entries are deleted lazily:
- `arm(target, due)` pushes an entry only when the target has none or `due` is earlier
  than its entry; a later `due` just stays in `target.due`, and is found when the entry
  pops (the target is then pushed again, at its `due`). A connection whose deadline moves
  on with every keep-alive request costs one push per time limit, not one per request.
- `drop(target)` (a connection closed) forgets the entry: it is skipped when it pops.
- Each target has at most one live entry (`target.queued`); an entry left behind (moved
  earlier, or dropped) is stale: it lets go of its target at once (`entry[2] = None`: a
  closed connection is not kept alive by the heap), is skipped when it pops, and the heap
  is rebuilt from the live entries when the stale outnumber them (and COMPACT_MIN), so it
  never holds more than about twice the live entries.

Resolution: the loop's clock. uvloop's counts whole milliseconds, so its timer may read
as fired up to one early: an entry within CLOCK_STEP_S of now is due. The time limits
here are seconds to minutes; a heap (exact order, O(log n) a push) was chosen over
buckets of a few ms (a dict of lists: a bucket for each distinct ms would cost more than
a heap entry while connections are few and spread out, and need their own order anyway).

An `expire()` that raises is contained: the queue goes on with the next entry, and logs
the first such failure (later ones at debug).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import weakref
from typing import Any, Protocol

log = logging.getLogger(__name__)

# uvloop's clock counts whole milliseconds: a timer may read as fired up to one early.
CLOCK_STEP_S = 0.001
COMPACT_MIN = 64  # stale entries always allowed before the heap is rebuilt

# [due, seq, target]: a list, so that a stale entry can let go of its target (None); the
# seq breaks ties between equal dues (a heap compares lists item by item, in C).
Entry = list[Any]


class Timed(Protocol):
    """What has a deadline on the queue."""

    due: float | None  # when expire() is due (loop time); None: no deadline
    queued: Entry | None  # the target's live entry, or None: the queue's own

    def expire(self) -> None:
        """The deadline `due` has come (the target may arm a new one)."""


class Deadlines:
    """The deadlines of one event loop, on one loop timer (see the module's text)."""

    __slots__ = ("_firing", "_heap", "_loop", "_seq", "_timer", "_timer_at", "failed", "live")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the loop's registry holds the queue, not the reverse
        self._heap: list[Entry] = []
        self._seq = itertools.count()
        # Not the handle's when(): uvloop returns a plain Handle (no when()) for a call_at
        # whose delay rounds to 0 ms on its millisecond clock.
        self._timer: asyncio.Handle | None = None
        self._timer_at = 0.0
        self._firing = False
        self.live = 0  # targets with an entry
        self.failed = 0  # expire() calls that raised

    def __len__(self) -> int:
        """The targets that have a deadline on the queue."""
        return self.live

    def entries(self) -> int:
        """The heap's entries, stale ones included (at most about twice `len`)."""
        return len(self._heap)

    def arm(self, target: Timed, due: float) -> None:
        """Make sure `target` is woken by `due` at the latest (`target.due` says what is due
        when it wakes: the target sets it before or after, as it likes)."""
        old = target.queued
        if old is None:
            self.live += 1
        elif old[0] <= due:
            return  # later: found when the entry pops
        else:
            old[2] = None  # stale from now on
        entry = [due, next(self._seq), target]
        target.queued = entry
        heapq.heappush(self._heap, entry)
        if not self._firing and (self._timer is None or due < self._timer_at):
            self._schedule(due)
        if old is not None:  # now stale
            self._bound()

    def drop(self, target: Timed) -> None:
        """Forget `target`'s entry (its connection closed)."""
        entry = target.queued
        if entry is not None:
            entry[2] = target.queued = None
            self.live -= 1
            self._bound()

    def _bound(self) -> None:
        """Rebuild the heap from its live entries when the stale ones outnumber them (in
        place: a firing holds the list)."""
        heap = self._heap
        if len(heap) - self.live > max(COMPACT_MIN, self.live):
            heap[:] = [e for e in heap if e[2] is not None]
            heapq.heapify(heap)

    def _schedule(self, at: float) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(at, self._fire), at

    def _fire(self) -> None:
        self._timer = None
        loop = self._loop()
        if loop is None:
            return
        limit = loop.time() + CLOCK_STEP_S
        heap = self._heap
        due_now: list[Entry] = []
        while heap and heap[0][0] <= limit:
            due_now.append(heapq.heappop(heap))
        self._firing = True
        pending = iter(due_now)
        try:
            for entry in pending:
                self._expire(entry, limit)
        finally:  # also after a BaseException: the entries not reached wait for the next turn
            self._firing = False
            for entry in pending:
                heapq.heappush(heap, entry)
            while heap and heap[0][2] is None:  # stale: moved or dropped
                heapq.heappop(heap)
            if heap:
                self._schedule(heap[0][0])

    def _expire(self, entry: Entry, limit: float) -> None:
        """One popped entry: skipped if stale (moved or dropped), pushed again if its target
        moved its deadline later, else the target expires. Entries pushed meanwhile wait for
        the next turn of the loop."""
        target: Timed | None = entry[2]
        if target is None:
            return
        entry[2] = target.queued = None
        self.live -= 1
        due = target.due
        if due is None:
            return
        if due > limit:
            self.arm(target, due)
            return
        try:
            target.expire()
        except Exception as e:  # a bug must cost its target, never the other deadlines
            self.failed += 1
            if self.failed == 1:
                log.warning("Failed to act on a time limit: %s, ignoring", e)
            log.debug("Failed to act on a time limit", exc_info=e)


_queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Deadlines] = (
    weakref.WeakKeyDictionary()
)


def of(loop: asyncio.AbstractEventLoop) -> Deadlines:
    """The deadline queue of `loop` (made on first use)."""
    queue = _queues.get(loop)
    if queue is None:
        # A closed loop's queue goes now: its timer would keep the loop, and so the queue and
        # every connection still on it, alive for good.
        for closed in [other for other in _queues if other.is_closed()]:
            del _queues[closed]
        queue = _queues[loop] = Deadlines(loop)
    return queue
