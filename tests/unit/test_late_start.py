"""A StartUnit held by polkit never undoes a stop: the bus layer follows each call's answer
apart from its job, sends a stop only after the starts before it are answered and reads
job mode "fail"'s refusal as the unit being stopped; the worker reports that as a start
the stop ended; a leaving front exits, and says STOPPING=1, only once its starts are
answered."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from dbus_next.errors import DBusError

from agent.front.front import START_ANSWER_WAIT_S, Front
from agent.spec.provider import Ready
from agent.systemd.bus import FINISHED_KEPT, REFUSED, UNDOES_A_STOP, DbusSystemd
from agent.systemd.syncbus import START_MODE
from agent.systemd.units import FRONT_STOP_MARGIN_S
from agent.worker.control import StartFailed, SystemdWorker
from tests.fakes.fake_systemd import FakeSystemd
from tests.unit.test_front import InProcessWorker, listener, provider

UNIT = "provider-worker@demo.service"
JOB = "/org/freedesktop/systemd1/job/7"


class Manager:
    """systemd's Manager interface as dbus-next's proxy calls it: StartUnit answered once
    `answer` is set (polkit), with a job or with `error`; every call recorded in order."""

    def __init__(self, error: DBusError | None = None) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.answer = asyncio.Event()
        self.error = error

    async def call_start_unit(self, name: str, mode: str) -> str:
        self.calls.append(("StartUnit", name, mode))
        await self.answer.wait()
        self.calls.append(("answered", name, mode))
        if self.error is not None:
            raise self.error
        return JOB

    async def call_stop_unit(self, name: str, mode: str) -> str:
        self.calls.append(("StopUnit", name, mode))
        return "/org/freedesktop/systemd1/job/8"


def bus(manager: Manager) -> DbusSystemd:
    systemd = DbusSystemd()
    systemd._manager = manager
    systemd._units[UNIT] = object()  # loaded: no LoadUnit round trip in these tests
    return systemd


def test_a_stop_goes_out_only_once_a_start_sent_before_it_is_answered() -> None:
    """The start's caller was cancelled (the front released the worker while it started):
    its StartUnit is still on its way to PID 1, and the stop waits for its answer."""
    manager = Manager()
    systemd = bus(manager)

    async def go() -> None:
        start = asyncio.ensure_future(systemd.start_unit(UNIT))
        await asyncio.sleep(0.01)
        start.cancel()
        stop = asyncio.ensure_future(systemd.stop_unit(UNIT))
        await asyncio.sleep(0.05)
        assert not await systemd.answered(0)
        assert [c[0] for c in manager.calls] == ["StartUnit"]  # the stop waits
        manager.answer.set()
        await asyncio.sleep(0)
        systemd._on_job_removed(8, "/org/freedesktop/systemd1/job/8", UNIT, "done")
        assert await asyncio.wait_for(stop, 1) == "done"
        assert await systemd.answered(0)

    asyncio.run(go())
    assert [c[0] for c in manager.calls] == ["StartUnit", "answered", "StopUnit"]
    assert manager.calls[0][2] == START_MODE == "fail"


def test_a_start_that_would_undo_a_stop_job_is_refused() -> None:
    error = DBusError(
        UNDOES_A_STOP, "Transaction for provider-worker@demo.service/start is destructive"
    )
    manager = Manager(error)
    systemd = bus(manager)

    async def go() -> str:
        manager.answer.set()
        return await systemd.start_unit(UNIT)

    assert asyncio.run(go()) == REFUSED


def test_any_other_error_of_a_start_is_raised() -> None:
    manager = Manager(DBusError("org.freedesktop.DBus.Error.AccessDenied", "no"))
    systemd = bus(manager)

    async def go() -> str:
        manager.answer.set()
        return await systemd.start_unit(UNIT)

    with pytest.raises(DBusError, match="no"):
        asyncio.run(go())


def test_a_start_refused_for_a_stop_is_a_start_the_stop_ended() -> None:
    """PID 1 answers the worker's StartUnit once polkit allows it; a stop job queued
    meanwhile (the operator's) makes job mode "fail" refuse it: the worker was stopped
    while it started, not a failed start (no backoff)."""
    fake = FakeSystemd()
    fake.unit(UNIT).behaviour.answer_s = 0.2
    w = SystemdWorker(fake, "demo", start_timeout_s=5)

    async def go() -> StartFailed:
        start = asyncio.ensure_future(w.start({}, None))
        await asyncio.sleep(0.05)
        fake.queue_stop(UNIT)
        with pytest.raises(StartFailed) as e:
            await start
        return e.value

    e = asyncio.run(go())
    assert e.stopped and not e.job_failed, e
    assert "stopped while it started" in e.reason
    assert ("refused", UNIT) in fake.calls and fake.unit(UNIT).starts == 0


class Unanswered(InProcessWorker):
    """A worker whose StartUnit PID 1 has not answered yet (held by polkit)."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = asyncio.Event()

    async def answered(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self.answer.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


def test_a_leaving_front_waits_for_its_starts_answers_before_stopping_1_and_exit() -> None:
    async def go() -> list[str]:
        notes: list[str] = []
        worker = Unanswered()
        front = Front(provider(), worker, [listener()], exit_on_idle=True, notify=notes.append)
        front.start_accepting()
        stopping = asyncio.ensure_future(front.stop(0))
        await asyncio.sleep(0.2)
        assert not front.done.is_set() and not stopping.done()
        assert not [n for n in notes if n.startswith("STOPPING=1")], notes
        worker.answer.set()
        await asyncio.wait_for(stopping, 2)
        return notes

    notes = asyncio.run(go())
    assert [n for n in notes if n.startswith("STOPPING=1")] == [
        "STOPPING=1\nSTATUS=Stopping on request"
    ]


def test_a_front_with_every_start_answered_says_stopping_1_at_once() -> None:
    async def go() -> list[str]:
        notes: list[str] = []
        worker = Unanswered()
        worker.answer.set()
        front = Front(provider(), worker, [listener()], exit_on_idle=True, notify=notes.append)
        front.start_accepting()
        await asyncio.wait_for(front.stop(0), 2)
        return notes

    assert any(n.startswith("STOPPING=1") for n in asyncio.run(go()))


def test_an_error_answering_a_start_whose_caller_was_cancelled_is_not_left_unretrieved() -> None:
    """PID 1 (or polkit) answers no after the caller gave up: nobody is to see that error,
    and asyncio must not log it as never retrieved."""
    manager = Manager(DBusError("org.freedesktop.DBus.Error.AccessDenied", "no"))
    systemd = bus(manager)
    unretrieved: list[str] = []

    async def go() -> None:
        asyncio.get_running_loop().set_exception_handler(
            lambda _loop, context: unretrieved.append(context["message"])
        )
        start = asyncio.ensure_future(systemd.start_unit(UNIT))
        await asyncio.sleep(0.01)
        start.cancel()
        await asyncio.wait({start})
        manager.answer.set()
        assert await systemd.answered(1)
        await asyncio.sleep(0)

    asyncio.run(go())
    gc.collect()
    assert not unretrieved, unretrieved


def test_the_job_of_a_start_whose_caller_was_cancelled_leaves_nothing_behind() -> None:
    """PID 1 answers a start with a job after its caller was cancelled, or the caller is
    cancelled while it waits for the job: that job's JobRemoved is kept for nobody."""
    manager = Manager()
    systemd = bus(manager)

    async def go() -> None:
        start = asyncio.ensure_future(systemd.start_unit(UNIT))
        await asyncio.sleep(0.01)
        start.cancel()
        await asyncio.wait({start})
        manager.answer.set()
        assert await systemd.answered(1)
        systemd._on_job_removed(7, JOB, UNIT, "done")
        waiting = asyncio.ensure_future(systemd.start_unit(UNIT))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.wait({waiting})
        systemd._on_job_removed(7, JOB, UNIT, "done")

    asyncio.run(go())
    assert systemd._finished == {} and systemd._waiting == {} and not systemd._unwanted


def test_a_stop_waits_for_answers_only_until_a_leaving_fronts_deadline() -> None:
    """dbus-next puts no timeout on a call: the stop's wait ends at the one deadline set
    when the front decided to leave, and a later wait skips the calls it gave up on."""
    manager = Manager()
    systemd = bus(manager)

    async def go() -> tuple[float, float, bool]:
        loop = asyncio.get_running_loop()
        start = asyncio.ensure_future(systemd.start_unit(UNIT))
        await asyncio.sleep(0.01)
        began = loop.time()
        systemd.answers_by(began + 0.2)
        stop = asyncio.ensure_future(systemd.stop_unit(UNIT))
        while len(manager.calls) < 2:
            await asyncio.sleep(0.01)
        sent_after = loop.time() - began
        systemd._on_job_removed(8, "/org/freedesktop/systemd1/job/8", UNIT, "done")
        await asyncio.wait_for(stop, 1)
        began = loop.time()
        answered = await systemd.answered(5)
        manager.answer.set()
        await asyncio.sleep(0.01)
        systemd._on_job_removed(7, JOB, UNIT, "done")
        await asyncio.wait_for(start, 1)
        return sent_after, loop.time() - began, answered

    sent_after, waited, answered = asyncio.run(go())
    assert 0.15 < sent_after < 2, sent_after  # not ANSWERS_BEFORE_STOP_S
    assert waited < 0.1 and not answered, (waited, answered)


class Sending(InProcessWorker):
    """A worker whose start, let go on by `go`, asks PID 1 for a start (`sent`) that is
    answered `answer_s` later; its stop takes `stop_s`. What happens is noted in `notes`."""

    def __init__(self, notes: list[str], answer_s: float = 0.2, stop_s: float = 0.0) -> None:
        super().__init__()
        self.notes = notes
        self.go = asyncio.Event()
        self.answer_s, self.stop_s = answer_s, stop_s
        self.calls: set[asyncio.Future[None]] = set()
        self.deadline: float | None = None
        self._sending = False

    async def _answer(self) -> None:
        await asyncio.sleep(self.answer_s)
        self.notes.append("answered")

    async def start(self, env: Any, devices: Any) -> None:
        self._sending = True
        try:
            await self.go.wait()
            self.notes.append("sent")
            self.calls.add(asyncio.ensure_future(self._answer()))
            await asyncio.shield(next(iter(self.calls)))
            await super().start(env, devices)
        finally:
            self._sending = False

    async def stop(self) -> None:
        await asyncio.sleep(self.stop_s)
        self.notes.append("stopped")
        await super().stop()

    async def answered(self, timeout_s: float) -> bool:
        pending = {c for c in self.calls if not c.done()}
        if not pending:
            return True
        _done, late = await asyncio.wait(pending, timeout=max(0.0, timeout_s))
        return not late

    def answers_by(self, deadline: float) -> None:
        self.deadline = deadline

    def sending(self) -> bool:
        return self._sending


def test_a_start_let_go_on_as_the_front_leaves_sends_nothing_after_stopping_1() -> None:
    """The start's wait ends in the very turn of the loop the front decides to leave,
    before the release's cancel reaches it: a StartUnit it sends then is answered before
    STOPPING=1, or it sends none."""

    async def go() -> list[str]:
        notes: list[str] = []
        worker = Sending(notes)
        front = Front(provider(), worker, [listener()], exit_on_idle=True, notify=notes.append)
        front.start_accepting()
        front.warm("request")
        await asyncio.sleep(0.05)
        stopping = asyncio.ensure_future(front.stop(0))
        await asyncio.sleep(0)  # the stop is decided: the leave and the release are spawned
        worker.go.set()
        await asyncio.wait_for(stopping, 5)
        await asyncio.sleep(0.3)
        return [n.split("\n")[0] for n in notes if not n.startswith("STATUS=")]

    notes = asyncio.run(go())
    assert "STOPPING=1" in notes, notes
    if "sent" in notes:
        assert notes.index("answered") < notes.index("STOPPING=1"), notes


def test_a_leaving_front_says_stopping_1_once_answered_not_once_its_worker_stopped() -> None:
    async def go() -> tuple[list[str], float | None, float]:
        notes: list[str] = []
        worker = Sending(notes, answer_s=0.1, stop_s=0.5)
        worker.go.set()
        front = Front(provider(), worker, [listener()], exit_on_idle=True, notify=notes.append)
        front.start_accepting()
        front.warm("request")
        await asyncio.sleep(0.01)
        left_at = asyncio.get_running_loop().time()
        await asyncio.wait_for(front.stop(0), 5)
        return (
            [n.split("\n")[0] for n in notes if not n.startswith("STATUS=")],
            worker.deadline,
            left_at,
        )

    notes, deadline, left_at = asyncio.run(go())
    assert notes.index("sent") < notes.index("answered") < notes.index("STOPPING=1"), notes
    assert notes.index("STOPPING=1") < notes.index("stopped"), notes
    assert deadline is not None and 0 < deadline - left_at <= START_ANSWER_WAIT_S + 0.1
    assert START_ANSWER_WAIT_S < FRONT_STOP_MARGIN_S / 2


def test_a_worker_start_is_sending_until_it_has_taken_its_cancel() -> None:
    """`sending` covers the start from its entry until a cancel reaches it; by then the
    StartUnit it made is one `answered` waits for, and the stop after it is not waited on."""
    fake = FakeSystemd()
    fake.unit(UNIT).behaviour.answer_s = 0.3
    fake.unit(UNIT).behaviour.delay_s = 0.5
    w = SystemdWorker(fake, "demo", start_timeout_s=5)

    async def go() -> tuple[bool, bool, bool]:
        start = asyncio.ensure_future(w.start({}, None))
        await asyncio.sleep(0.05)
        during = w.sending()
        stop_unit = fake.stop_unit
        sending_at_stop: list[bool] = []

        async def stop(name: str) -> str:  # the stop after the cancel
            sending_at_stop.append(w.sending())
            return await stop_unit(name)

        fake.stop_unit = stop  # type: ignore[method-assign]
        start.cancel()
        await asyncio.wait({start})
        return during, sending_at_stop == [False], await w.answered(0)

    during, after, answered = asyncio.run(go())
    assert during and after and not answered


def test_a_start_with_a_probe_cancelled_while_it_waits_ends_cancelled() -> None:
    """A release's cancel reaches the start in the front's own task: it is a cancel, not
    an error of the start's own."""
    fake = FakeSystemd()
    fake.unit(UNIT).behaviour.delay_s = 5
    w = SystemdWorker(fake, "demo", start_timeout_s=5, ready=Ready("tcp"))

    async def go() -> None:
        start = asyncio.ensure_future(w.start({"PROVIDERD_WORKER_PORT": "9"}, None))
        await asyncio.sleep(0.05)
        start.cancel()
        await asyncio.wait({start})
        assert start.cancelled(), start.exception()

    asyncio.run(go())


def test_the_host_s_other_jobs_are_not_kept_for_the_front_s_whole_life() -> None:
    systemd = DbusSystemd()
    for n in range(10 * FINISHED_KEPT):
        systemd._on_job_removed(n, f"/org/freedesktop/systemd1/job/{n}", f"o{n}.service", "done")
    assert len(systemd._finished) == FINISHED_KEPT
    assert f"/org/freedesktop/systemd1/job/{10 * FINISHED_KEPT - 1}" in systemd._finished


def test_a_cancel_while_a_failed_start_waits_for_its_watch_is_a_cancel() -> None:
    """The start failed, and its cleanup waits for the unit's watch to be set up: a
    release's cancel that lands there is raised, not taken for the start's failure."""

    class SlowWatch(FakeSystemd):
        async def watch(self, name: str, callback: Any) -> None:
            await asyncio.sleep(5)

        async def start_unit(self, name: str) -> str:
            raise DBusError("org.freedesktop.DBus.Error.AccessDenied", "denied")

    fake = SlowWatch()
    w = SystemdWorker(fake, "demo", start_timeout_s=5, ready=Ready("tcp"))

    async def go() -> None:
        start = asyncio.ensure_future(w.start({"PROVIDERD_WORKER_PORT": "9"}, None))
        await asyncio.sleep(0.2)  # its StartUnit failed; its watch is still being set up
        assert not start.done()
        start.cancel()
        await asyncio.wait({start})
        assert start.cancelled(), start.exception()

    asyncio.run(go())
