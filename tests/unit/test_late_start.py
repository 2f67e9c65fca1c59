"""A StartUnit held by polkit never undoes a stop: the bus layer follows each call's answer
apart from its job, sends a stop only after the starts before it are answered and reads
job mode "fail"'s refusal as the unit being stopped; the worker reports that as a start
the stop ended; a leaving front exits, and says STOPPING=1, only once its starts are
answered."""

from __future__ import annotations

import asyncio
import gc

import pytest
from dbus_next.errors import DBusError

from agent.front.front import Front
from agent.systemd.bus import REFUSED, UNDOES_A_STOP, DbusSystemd
from agent.systemd.syncbus import START_MODE
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
