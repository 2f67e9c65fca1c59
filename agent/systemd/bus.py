"""systemd's D-Bus API, behind one small interface.

`DbusSystemd` talks to PID 1 with dbus-next; tests drive the same callers with
`tests/fakes/fake_systemd.py`, which models jobs, signals and their races.

The races this guards against (research/systemd.md §7):
- `JobRemoved` can be dispatched before the `StartUnit` reply reaches us, so
  results of jobs nobody waits for yet are kept until someone asks.
- A unit nobody pins is garbage-collected: always `LoadUnit`, never `GetUnit`.
- Signals only flow after `Subscribe()`.
- A StartUnit from the front (user providerd) waits for polkit before PID 1 takes it, for
  hundreds of milliseconds on a busy host: a stop asked for meanwhile must not be undone by
  it. Starts go out in job mode "fail" (`START_MODE`): one that would reverse a stop job
  queued or running (the worker's, or the front's pulled in by the worker's BindsTo=) is
  refused (`REFUSED`) instead of replacing it. A call's answer is followed apart from its
  job's end (`answered`): a stop of ours goes out once every start sent before it is
  answered, so PID 1 takes them in that order, and a front leaving waits for them while
  its own stop job is still installed.
- A start asked for before this connection existed (`agent.systemd.syncbus`, by the
  front's early start) is followed, not asked for again (`follow`): its `JobRemoved` may
  have gone out before `Subscribe()`, and then the unit's state tells how it ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from agent.systemd.syncbus import START_MODE

SD = "org.freedesktop.systemd1"
SD_PATH = "/org/freedesktop/systemd1"

StateCallback = Callable[[str, str], None]  # (ActiveState, SubState)

# PID 1's error for such a start ("Transaction ... is destructive"), and `start_unit`'s
# result for it: the unit is being stopped.
UNDOES_A_STOP = SD + ".TransactionIsDestructive"
REFUSED = "refused"
# How long a stop waits for the answers to the starts sent before it (polkit's own checks
# end well within it). dbus-next puts no timeout on a method call: this is the only bound,
# and a leaving front's budget (`answers_by`) can make it shorter.
ANSWERS_BEFORE_STOP_S = 10.0

# What providerd calls, as introspection data: PID 1's own introspection of the manager and
# of a unit is tens of kilobytes of XML, and fetching and parsing it took 10-20 ms of the
# front's start before its first StartUnit. (Properties.Get reads any property by name.)
MANAGER_XML = """<node><interface name="org.freedesktop.systemd1.Manager">
<method name="Subscribe"/>
<method name="LoadUnit"><arg type="s" direction="in"/><arg type="o" direction="out"/></method>
<method name="StartUnit"><arg type="s" direction="in"/><arg type="s" direction="in"/>
<arg type="o" direction="out"/></method>
<method name="StopUnit"><arg type="s" direction="in"/><arg type="s" direction="in"/>
<arg type="o" direction="out"/></method>
<method name="SetUnitProperties"><arg type="s" direction="in"/><arg type="b" direction="in"/>
<arg type="a(sv)" direction="in"/></method>
<method name="GetUnitProcesses"><arg type="s" direction="in"/>
<arg type="a(sus)" direction="out"/></method>
<signal name="JobRemoved"><arg type="u"/><arg type="o"/><arg type="s"/><arg type="s"/></signal>
</interface></node>"""
UNIT_XML = """<node><interface name="org.freedesktop.DBus.Properties">
<method name="Get"><arg type="s" direction="in"/><arg type="s" direction="in"/>
<arg type="v" direction="out"/></method>
<signal name="PropertiesChanged"><arg type="s"/><arg type="a{sv}"/><arg type="as"/></signal>
</interface><interface name="org.freedesktop.systemd1.Unit">
<property name="ActiveState" type="s" access="read"/>
<property name="SubState" type="s" access="read"/>
</interface></node>"""


FINISHED_KEPT = 256  # JobRemoved results kept for a reply or a `follow` not yet seen


class Systemd(Protocol):
    async def start_unit(self, name: str) -> str:
        """Start `name` (`START_MODE`) and wait for its job: "done", "failed", "timeout", …;
        `REFUSED` where PID 1 refused it for a stop job it would have undone."""
        ...

    async def answered(self, timeout_s: float) -> bool:
        """Wait until every StartUnit sent on this connection is answered (its job queued,
        or refused), at most `timeout_s`: whether they all are. A caller's cancel does not
        take the call back, so one cancelled meanwhile is waited for too. One a stop gave up
        on (`stop_unit`) is not waited for again: it counts as unanswered at once."""
        ...

    def answers_by(self, deadline: float) -> None:
        """Every wait for answers from now on (a stop's, `answered`'s) ends at `deadline`
        (the event loop's clock) at the latest: a leaving front's one budget for them."""
        ...

    async def follow(self, name: str, job: str) -> str:
        """Wait for `job`, a start of `name` asked for on another connection: its result as
        `start_unit`'s, "done" when it ended before this connection could see it."""
        ...

    async def stop_unit(self, name: str) -> str: ...

    async def get(self, name: str, interface: str, prop: str) -> Any:
        """One property, e.g. ("Service", "Result"). `interface` is the short name."""
        ...

    async def job_type(self, job: str) -> str:
        """The JobType of the job at path `job` ("start", "stop", "restart", …); "" when
        that job is over (PID 1 no longer has the object)."""
        ...

    async def set_properties(self, name: str, props: Sequence[tuple[str, str, Any]]) -> None:
        """SetUnitProperties(runtime=true) with (name, D-Bus signature, value) triples."""
        ...

    async def watch(self, name: str, callback: StateCallback) -> None:
        """Call `callback(active_state, sub_state)` whenever the unit's state changes."""
        ...

    async def unit_pids(self, name: str) -> list[int]: ...


class DbusSystemd:
    """The real thing: PID 1 over the system bus."""

    def __init__(self) -> None:
        self._bus: Any = None
        self._manager: Any = None
        self._waiting: dict[str, asyncio.Future[str]] = {}
        self._finished: dict[str, str] = {}
        self._units: dict[str, Any] = {}  # name -> proxy object
        self._unit_node: Any = None  # UNIT_XML, parsed once
        self._unanswered: set[asyncio.Future[Any]] = set()  # StartUnit calls sent
        self._unwanted: set[str] = set()  # jobs of starts whose caller was cancelled
        self._given_up: set[asyncio.Future[Any]] = set()  # unanswered calls a stop gave up on
        self._deadline: float | None = None  # `answers_by`

    async def connect(self) -> None:
        from dbus_next.aio.message_bus import MessageBus
        from dbus_next.constants import BusType
        from dbus_next.introspection import Node

        self._bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
        self._unit_node = Node.parse(UNIT_XML)
        obj = self._bus.get_proxy_object(SD, SD_PATH, Node.parse(MANAGER_XML))
        self._manager = obj.get_interface(SD + ".Manager")
        self._manager.on_job_removed(self._on_job_removed)
        await self._manager.call_subscribe()

    def close(self) -> None:
        if self._bus is not None:
            self._bus.disconnect()

    def _on_job_removed(self, _id: int, job: str, _unit: str, result: str) -> None:
        future = self._waiting.pop(job, None)
        if future is not None:
            if not future.done():
                future.set_result(result)
        elif job in self._unwanted:
            self._unwanted.discard(job)  # nobody waits for it any more
        else:
            # Subscribe() sends every job of the host: the latest are kept, for a reply or
            # a `follow` still to come, and the oldest let go.
            self._finished[job] = result
            if len(self._finished) > FINISHED_KEPT:
                del self._finished[next(iter(self._finished))]

    def _expect(self, job: str) -> asyncio.Future[str]:
        """`job`'s result from its JobRemoved: already done if that came first."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        if job in self._finished:
            future.set_result(self._finished.pop(job))
        else:
            self._waiting[job] = future
        return future

    async def _wait_job(self, job: str) -> str:
        try:
            return await self._expect(job)
        except asyncio.CancelledError:
            if self._waiting.pop(job, None) is not None:
                self._unwanted.add(job)  # its JobRemoved is still to come
            raise

    def _forget_job(self, call: asyncio.Future[Any]) -> None:
        """A start's caller was cancelled before PID 1 answered: the job it answers with is
        nobody's to wait for, and its JobRemoved is not kept."""
        if call.cancelled() or call.exception() is not None:
            return
        job = str(call.result())
        if self._finished.pop(job, None) is None:
            self._unwanted.add(job)

    async def _unit(self, name: str) -> Any:
        unit = self._units.get(name)
        if unit is None:
            path = await self._manager.call_load_unit(name)
            unit = self._bus.get_proxy_object(SD, path, self._unit_node)
            self._units[name] = unit
        return unit

    async def start_unit(self, name: str) -> str:
        from dbus_next.errors import DBusError

        # By name: PID 1 loads the unit itself, no LoadUnit round trip first. The call is
        # its own task: a cancel of this caller leaves it to be answered (`answered`).
        call = asyncio.ensure_future(self._manager.call_start_unit(name, START_MODE))
        self._unanswered.add(call)
        call.add_done_callback(_answer_seen)
        call.add_done_callback(self._unanswered.discard)
        call.add_done_callback(self._given_up.discard)
        try:
            job = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(self._forget_job)
            raise
        except DBusError as e:
            if e.type == UNDOES_A_STOP:
                return REFUSED
            raise
        return await self._wait_job(job)

    async def answered(self, timeout_s: float) -> bool:
        pending = self._unanswered - self._given_up
        if pending:
            if self._deadline is not None:
                timeout_s = min(timeout_s, self._deadline - asyncio.get_running_loop().time())
            _done, late = await asyncio.wait(pending, timeout=max(0.0, timeout_s))
            if late:
                return False
        return not self._unanswered

    def answers_by(self, deadline: float) -> None:
        self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)

    async def follow(self, name: str, job: str) -> str:
        """The result of a job this connection did not ask for. Its JobRemoved counts from
        `Subscribe()` on (`connect`); one sent before was not ours to see, so: when the unit
        no longer runs `job`, the job is over, and "done" lets the caller read the unit's
        state as for any finished start (active, or why not)."""
        future = self._expect(job)
        if future.done():
            return future.result()
        try:
            current = await self.get(name, "Unit", "Job")  # (id, path); (0, "/") for none
        except BaseException:
            self._waiting.pop(job, None)
            raise
        # Signals and replies keep their order on the connection: a JobRemoved sent before
        # this reply has reached the future by now.
        running = isinstance(current, (list, tuple)) and len(current) == 2 and current[1] == job
        if not running and not future.done():
            self._waiting.pop(job, None)
            return "done"
        return await future

    async def stop_unit(self, name: str) -> str:
        await self._unit(name)
        if not await self.answered(ANSWERS_BEFORE_STOP_S):  # PID 1 takes the starts first
            self._given_up |= self._unanswered  # no later stop waits for them again
        job = await self._manager.call_stop_unit(name, "replace")
        return await self._wait_job(job)

    async def get(self, name: str, interface: str, prop: str) -> Any:
        unit = await self._unit(name)
        props = unit.get_interface("org.freedesktop.DBus.Properties")
        variant = await props.call_get(f"{SD}.{interface}", prop)
        return variant.value

    async def job_type(self, job: str) -> str:
        from dbus_next.errors import DBusError

        props = self._bus.get_proxy_object(SD, job, self._unit_node).get_interface(
            "org.freedesktop.DBus.Properties"
        )
        try:
            variant = await props.call_get(f"{SD}.Job", "JobType")
        except DBusError:  # UnknownObject: the job ended since its path was read
            return ""
        return str(variant.value)

    async def set_properties(self, name: str, props: Sequence[tuple[str, str, Any]]) -> None:
        await self._manager.call_set_unit_properties(name, True, property_values(props))

    async def watch(self, name: str, callback: StateCallback) -> None:
        unit = await self._unit(name)
        props = unit.get_interface("org.freedesktop.DBus.Properties")
        iface = unit.get_interface(SD + ".Unit")

        async def refresh() -> None:
            callback(await iface.get_active_state(), await iface.get_sub_state())

        def changed(interface: str, values: dict[str, Any], _invalidated: list[str]) -> None:
            if interface == SD + ".Unit" and "ActiveState" in values:
                sub = values["SubState"].value if "SubState" in values else ""
                callback(values["ActiveState"].value, sub)

        props.on_properties_changed(changed)
        await refresh()

    async def unit_pids(self, name: str) -> list[int]:
        processes = await self._manager.call_get_unit_processes(name)
        return [int(pid) for _cgroup, pid, _cmd in processes]


def _answer_seen(call: asyncio.Future[Any]) -> None:
    """A StartUnit's error is its caller's to see, or nobody's once that caller is gone.
    Retrieved here: once the caller's `asyncio.shield` is cancelled, Python 3.11 takes its
    own callback off the call, and an error the call ends in later would be logged as
    "exception was never retrieved"."""
    if not call.cancelled():
        call.exception()


def property_values(props: Sequence[tuple[str, str, Any]]) -> list[list[Any]]:
    """SetUnitProperties' `a(sv)` argument. dbus-next wants lists for D-Bus structs, so
    tuples (a `DeviceAllow=` rule is `("/dev/nvidia0", "rw")`) become lists."""
    from dbus_next.signature import Variant

    def plain(value: Any) -> Any:
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        return value

    return [[key, Variant(sig, plain(value))] for key, sig, value in props]
