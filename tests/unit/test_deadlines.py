"""The deadline queue of an event loop (agent.net.deadlines), on the product's loop and its
real clock: order, moves earlier and later, removal, many entries, a failing target, the
heap's bound; and a property test of random arm / move / clear / drop / wait sequences.

Timing assertions are one-sided where the machine's load could move them: a deadline
never fires before its time (less the clock's millisecond step), and every deadline that
stays armed has fired once its time is well past; how late is not asserted.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import weakref

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.net import deadlines
from agent.net.deadlines import CLOCK_STEP_S, COMPACT_MIN, Deadlines, Entry


class Target:
    """Records when it expired, and whether its deadline was due then."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: object = None) -> None:
        self.loop = loop
        self.name = name
        self.due: float | None = None
        self.queued: Entry | None = None
        self.fired: list[float] = []
        self.early: list[tuple[float, float | None]] = []  # (now, due) of a wrong call

    def expire(self) -> None:
        now = self.loop.time()
        if self.due is None or now < self.due - CLOCK_STEP_S:
            self.early.append((now, self.due))
        self.fired.append(now)
        self.due = None

    def set(self, queue: Deadlines, due: float) -> None:
        self.due = due
        queue.arm(self, due)


async def settle(queue: Deadlines, timeout: float = 5.0) -> None:
    """Until the queue holds no deadline, nor a stale entry (each goes when its time comes,
    or when it reaches the top of the heap after a firing)."""
    async with asyncio.timeout(timeout):
        while len(queue) or queue.entries():
            await asyncio.sleep(0.005)


def test_deadlines_fire_in_their_order_each_once_and_not_early() -> None:
    async def go() -> list[object]:
        loop = asyncio.get_running_loop()
        queue = Deadlines(loop)
        order: list[object] = []
        targets = []
        now = loop.time()
        for ms in (30, 10, 50, 0, 20, 40):
            t = Target(loop, ms)
            t.expire = lambda t=t, e=t.expire: (e(), order.append(t.name))  # type: ignore[method-assign]
            t.set(queue, now + ms / 1000)
            targets.append(t)
        await settle(queue)
        await asyncio.sleep(0.05)
        for t in targets:
            assert len(t.fired) == 1 and not t.early, (t.name, t.fired, t.early)
        return order

    assert asyncio.run(go()) == [0, 10, 20, 30, 40, 50]


def test_a_deadline_moved_later_pushes_nothing_and_fires_at_its_new_time() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        queue = Deadlines(loop)
        t = Target(loop)
        start = loop.time()
        t.set(queue, start + 0.02)
        for step in range(1, 21):  # as keep-alive requests move an idle deadline on
            t.set(queue, start + 0.02 + step * 0.01)
        assert queue.entries() == 1 and len(queue) == 1
        await settle(queue)
        assert len(t.fired) == 1 and not t.early
        assert t.fired[0] >= start + 0.22 - CLOCK_STEP_S

    asyncio.run(go())


def test_a_deadline_moved_earlier_fires_at_the_earlier_time() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        queue = Deadlines(loop)
        t = Target(loop)
        start = loop.time()
        t.set(queue, start + 30.0)
        t.set(queue, start + 0.01)
        await settle(queue)
        assert len(t.fired) == 1 and not t.early
        assert t.fired[0] < start + 10.0  # not the first deadline's time

    asyncio.run(go())


def test_a_dropped_or_cleared_deadline_never_fires() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        queue = Deadlines(loop)
        dropped, cleared, kept = Target(loop), Target(loop), Target(loop)
        now = loop.time()
        for t in (dropped, cleared, kept):
            t.set(queue, now + 0.02)
        queue.drop(dropped)
        queue.drop(dropped)  # twice: no harm
        cleared.due = None  # what ClientConn.deadline(None) does: the entry is skipped
        assert len(queue) == 2
        await settle(queue)
        await asyncio.sleep(0.04)
        assert (dropped.fired, cleared.fired, len(kept.fired)) == ([], [], 1)

    asyncio.run(go())


def test_a_dropped_target_is_let_go_of_at_once() -> None:
    """Its stale entry waits in the heap for its time, without the target (a closed
    connection is not kept alive by its old deadline)."""

    async def go() -> tuple[bool, int]:
        loop = asyncio.get_running_loop()
        queue = Deadlines(loop)
        t = Target(loop)
        t.set(queue, loop.time() + 3600.0)
        gone = weakref.ref(t)
        queue.drop(t)
        del t
        gc.collect()
        return gone() is None, queue.entries()

    assert asyncio.run(go()) == (True, 1)


def test_ten_thousand_deadlines_each_fire_once() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        queue = Deadlines(loop)
        rng = random.Random(11)
        now = loop.time()
        targets = [Target(loop) for _ in range(10_000)]
        for t in targets:
            t.set(queue, now + rng.uniform(0, 0.1))
        await settle(queue)
        assert all(len(t.fired) == 1 and not t.early for t in targets)
        assert queue.entries() == 0

    asyncio.run(go())


def test_the_heap_stays_bounded_when_deadlines_keep_moving_earlier() -> None:
    """Each move earlier leaves a stale entry behind: the heap is rebuilt from the live ones
    before the stale outnumber them (and COMPACT_MIN)."""

    async def go() -> None:
        loop = asyncio.get_running_loop()
        queue = Deadlines(loop)
        now = loop.time()
        targets = [Target(loop) for _ in range(100)]
        most = 0
        for step in range(1000):
            for t in targets:
                t.set(queue, now + 3600.0 - step)
            most = max(most, queue.entries())
        assert len(queue) == 100
        assert most <= 2 * 100 + COMPACT_MIN + 1
        for t in targets:
            queue.drop(t)
        assert len(queue) == 0 and queue.entries() <= COMPACT_MIN

    asyncio.run(go())


def test_a_target_that_raises_does_not_stop_the_others_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken(Target):
        def expire(self) -> None:
            super().expire()
            raise RuntimeError("broken target")

    async def go() -> tuple[list[Target], Deadlines]:
        loop = asyncio.get_running_loop()
        queue = Deadlines(loop)
        now = loop.time()
        targets = [Broken(loop), Target(loop), Broken(loop), Target(loop)]
        for i, t in enumerate(targets):
            t.set(queue, now + 0.01 * (i % 2))  # two turns: failures in each
        await settle(queue)
        later = Target(loop)
        later.set(queue, loop.time() + 0.01)  # the queue still serves afterwards
        await settle(queue)
        return [*targets, later], queue

    with caplog.at_level(logging.WARNING, logger="agent.net.deadlines"):
        targets, queue = asyncio.run(go())
    assert all(len(t.fired) == 1 for t in targets)
    assert queue.failed == 2
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1
    assert warned[0].getMessage() == "Failed to act on a time limit: broken target, ignoring"
    assert warned[0].exc_info is None  # one line in the journal


def test_a_target_that_arms_itself_again_while_expiring_is_served_in_a_later_turn() -> None:
    async def go() -> list[float]:
        loop = asyncio.get_running_loop()
        queue = Deadlines(loop)
        t = Target(loop)

        def again() -> None:
            Target.expire(t)
            if len(t.fired) < 3:
                t.set(queue, loop.time())  # due at once, every time

        t.expire = again  # type: ignore[method-assign]
        t.set(queue, loop.time())
        await settle(queue)
        return t.fired

    assert len(asyncio.run(go())) == 3


def test_each_loop_has_its_own_queue() -> None:
    async def one() -> Deadlines:
        loop = asyncio.get_running_loop()
        assert deadlines.of(loop) is deadlines.of(loop)
        return deadlines.of(loop)

    assert asyncio.run(one()) is not asyncio.run(one())


def test_a_closed_loops_queue_is_let_go_of_with_the_connections_on_it() -> None:
    """A loop closed with a deadline still pending: its queue (whose timer holds the loop)
    and the target on it are freed once another loop makes its queue."""

    async def leave_one_pending() -> weakref.ref[Target]:
        loop = asyncio.get_running_loop()
        t = Target(loop)
        t.set(deadlines.of(loop), loop.time() + 3600)
        return weakref.ref(t)

    left = [asyncio.run(leave_one_pending()) for _ in range(3)]

    async def one() -> None:
        deadlines.of(asyncio.get_running_loop())

    asyncio.run(one())
    gc.collect()
    assert all(ref() is None for ref in left)
    assert len(deadlines._queues) <= 1  # at most the last loop's, closed after `one`


def test_an_expire_that_raises_a_base_exception_loses_no_other_deadline() -> None:
    """KeyboardInterrupt out of one target's expire(): the targets due with it are served in
    a later turn, and the queue still serves afterwards."""

    class Interrupting(Target):
        def expire(self) -> None:
            super().expire()
            raise KeyboardInterrupt

    loop = asyncio.new_event_loop()
    try:
        queue = Deadlines(loop)
        now = loop.time()
        targets: list[Target] = [Interrupting(loop), *(Target(loop) for _ in range(3))]
        for t in targets:
            t.set(queue, now)  # all due in the same firing
        with pytest.raises(KeyboardInterrupt):  # out of the loop, as asyncio lets it
            loop.run_until_complete(asyncio.sleep(0.05))
        loop.run_until_complete(settle(queue))
        later = Target(loop)
        later.set(queue, loop.time() + 0.01)
        loop.run_until_complete(settle(queue))
    finally:
        loop.close()
    targets.append(later)
    assert all(len(t.fired) == 1 for t in targets)


# -- the property: arm / move / clear / drop / wait, in any order ---------------------------

TARGETS = 6
FAR_MS = 3_600_000  # a deadline that must not fire during the test
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("set"),
            st.integers(0, TARGETS - 1),
            st.one_of(st.integers(0, 12), st.just(FAR_MS)),
        ),
        st.tuples(st.just("clear"), st.integers(0, TARGETS - 1), st.just(0)),
        st.tuples(st.just("drop"), st.integers(0, TARGETS - 1), st.just(0)),
        st.tuples(st.just("wait"), st.just(0), st.integers(0, 6)),
    ),
    max_size=30,
)


@given(OPS)
def test_random_sequences_fire_exactly_the_armed_deadlines_once_each_never_early(
    ops: list[tuple[str, int, int]],
) -> None:
    """ "set" arms or moves a deadline (ms from now: 0-12, or an hour), "clear" leaves its
    entry to be skipped (ClientConn.deadline(None)), "drop" forgets it (a close), "wait"
    lets time pass. The model: a deadline armed and not cleared or dropped since fires
    exactly once, not before its time; nothing else fires; a deadline moved from an hour to
    a few ms fires within the test. The heap never holds more than twice the live entries
    and COMPACT_MIN."""

    async def go() -> None:
        loop = asyncio.get_running_loop()
        queue = Deadlines(loop)
        model: list[float | None] = [None] * TARGETS  # each target's armed deadline
        wrong: list[str] = []

        class Modelled(Target):
            def expire(self) -> None:
                i = self.name
                assert isinstance(i, int)
                due = model[i]
                if due is None or loop.time() < due - CLOCK_STEP_S:
                    wrong.append(f"{i} fired at {loop.time()}, armed {due}")
                model[i] = None
                super().expire()

        targets = [Modelled(loop, i) for i in range(TARGETS)]
        for op, i, n in ops:
            if op == "set":
                due = model[i] = loop.time() + n / 1000
                targets[i].set(queue, due)
            elif op == "clear":
                model[i] = targets[i].due = None
            elif op == "drop":
                model[i] = targets[i].due = None
                queue.drop(targets[i])
            else:
                await asyncio.sleep(n / 1000)
            assert queue.entries() <= 2 * len(queue) + COMPACT_MIN + 1
        async with asyncio.timeout(5):  # every near deadline fires
            while any(due is not None and due < loop.time() + 60 for due in model):
                await asyncio.sleep(0.005)
        assert not wrong, wrong
        assert all(not t.early for t in targets)

    asyncio.run(go())
