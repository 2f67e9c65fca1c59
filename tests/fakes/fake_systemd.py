"""A faithful in-memory stand-in for systemd's D-Bus API (the `agent.systemd.bus.Systemd` interface).

It models what the callers depend on: start jobs that end "done" only once a
Type=notify unit is ready, "failed" with a Result when it is not, conditions that
make a start a no-op, state-change signals (delivered from the event loop, possibly
before the caller resumes), stop jobs, and runtime properties.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.systemd.bus import REFUSED, StateCallback, property_values


@dataclass
class Behaviour:
    """What happens when the unit is started."""

    delay_s: float = 0.0
    result: str = "success"  # "success" | "exit-code" | "timeout" | "oom-kill" | "signal"
    status: int = 0
    condition_path: str | None = None  # ConditionPathExists=
    # How long PID 1 takes to answer a StartUnit (polkit's check): a stop job queued
    # meanwhile (`queue_stop`) makes it refused, as job mode "fail" does.
    answer_s: float = 0.0


@dataclass
class Unit:
    name: str
    active: str = "inactive"
    sub: str = "dead"
    result: str = "success"
    status: int = 0
    properties: dict[str, list[Any]] = field(default_factory=dict)
    watchers: list[StateCallback] = field(default_factory=list)
    behaviour: Behaviour = field(default_factory=Behaviour)
    starts: int = 0
    pids: list[int] = field(default_factory=list)
    memory_current: int = 2**64 - 1
    memory_max: int = 2**64 - 1
    job: int = 0  # the id of the unit's pending job, 0 for none
    condition_result: bool = False  # ConditionResult: its last condition check passed
    # Monotonic µs of its last entry into "active" and exit from "inactive"/"failed".
    active_enter_us: int = 0
    inactive_exit_us: int = 0


class FakeSystemd:
    def __init__(self) -> None:
        self.units: dict[str, Unit] = {}
        self.calls: list[tuple[str, str]] = []
        self._jobs: dict[str, asyncio.Task[str]] = {}
        self._next_job = 0
        self._cancelled: set[int] = set()  # start jobs a stop replaced before they ran
        self._job_types: dict[int, str] = {}  # JobType by job id
        self._unanswered: set[asyncio.Future[str]] = set()  # StartUnit calls not answered
        self.deadline: float | None = None  # `answers_by`

    def unit(self, name: str) -> Unit:
        return self.units.setdefault(name, Unit(name))

    def _set(self, unit: Unit, active: str, sub: str) -> None:
        now = time.monotonic_ns() // 1000
        if active == "active":
            unit.active_enter_us = now
        elif unit.active in ("inactive", "failed") and active not in ("inactive", "failed"):
            unit.inactive_exit_us = now
        unit.active, unit.sub = active, sub
        loop = asyncio.get_running_loop()
        for callback in list(unit.watchers):
            loop.call_soon(callback, active, sub)

    async def start_unit(self, name: str) -> str:
        self.calls.append(("start", name))
        unit = self.unit(name)
        if unit.behaviour.answer_s:
            held = asyncio.ensure_future(asyncio.sleep(unit.behaviour.answer_s, "answered"))
            self._unanswered.add(held)
            held.add_done_callback(self._unanswered.discard)
            await asyncio.shield(held)  # a cancel of the caller does not take the call back
        if self._job_types.get(unit.job) == "stop":
            self.calls.append(("refused", name))
            return REFUSED  # job mode "fail": it would have undone the stop
        job = self._jobs.get(name)
        if job is not None:  # a start job is under way: systemd merges the new one into it
            return await asyncio.shield(job)
        return await self._start_job(name)

    async def answered(self, timeout_s: float) -> bool:
        pending = set(self._unanswered)
        if not pending:
            return True
        if self.deadline is not None:
            timeout_s = min(timeout_s, self.deadline - asyncio.get_running_loop().time())
        _done, left = await asyncio.wait(pending, timeout=max(0.0, timeout_s))
        return not left

    def answers_by(self, deadline: float) -> None:
        self.deadline = deadline

    def start_with_front(self, name: str) -> asyncio.Task[str]:
        """What an activation does for a worker the front Wants=: a start job nobody waits for."""
        return self._start_job_task(name)

    def start_elsewhere(self, name: str) -> str:
        """A StartUnit sent on another connection (the front's early start): its job's path."""
        self.calls.append(("start-elsewhere", name))
        self._start_job_task(name)
        return f"/org/freedesktop/systemd1/job/{self.unit(name).job}"

    async def follow(self, name: str, job: str) -> str:
        self.calls.append(("follow", name))
        task = self._jobs.get(name)
        if task is None or job != f"/org/freedesktop/systemd1/job/{self.unit(name).job}":
            return "done"  # over before this connection saw it: the unit's state tells
        return await asyncio.shield(task)

    def queue_stop(self, name: str) -> str:
        """A stop job PID 1 has queued for the unit (a Type=exec worker's, behind its front's
        own stop) and not run yet: the unit stays as it is. Its job's path."""
        unit = self.unit(name)
        unit.job = self._next_job = self._next_job + 1
        self._job_types[unit.job] = "stop"
        return f"/org/freedesktop/systemd1/job/{unit.job}"

    async def job_type(self, job: str) -> str:
        for unit in self.units.values():
            if unit.job and job == f"/org/freedesktop/systemd1/job/{unit.job}":
                return self._job_types[unit.job]
        return ""  # over: PID 1 no longer has the object

    def _start_job_task(self, name: str) -> asyncio.Task[str]:
        unit = self.unit(name)
        unit.job = self._next_job = self._next_job + 1
        self._job_types[unit.job] = "start"
        task = asyncio.get_running_loop().create_task(self._run_start(name, unit.job))
        self._jobs[name] = task
        job = unit.job

        def removed(t: asyncio.Task[str]) -> None:
            if self._jobs.get(name) is t:
                self._jobs.pop(name, None)
            if unit.job == job:
                unit.job = 0

        task.add_done_callback(removed)
        return task

    async def _start_job(self, name: str) -> str:
        return await asyncio.shield(self._start_job_task(name))

    async def _run_start(self, name: str, job: int = 0) -> str:
        unit = self.unit(name)
        b = unit.behaviour
        if job in self._cancelled:
            return "canceled"  # a stop replaced it before it ran
        if unit.active == "active":
            return "done"
        unit.condition_result = b.condition_path is None or os.path.exists(b.condition_path)
        if not unit.condition_result:
            return "done"  # condition unmet: the job is done, the unit stays inactive
        unit.starts += 1
        self._set(unit, "activating", "start")
        await asyncio.sleep(b.delay_s)
        if unit.active != "activating" or job in self._cancelled:
            return "canceled"  # stopped while starting
        unit.result, unit.status = b.result, b.status
        if b.result == "success":
            self._set(unit, "active", "running")
            return "done"
        self._set(unit, "failed", "failed")
        return "timeout" if b.result == "timeout" else "failed"

    async def stop_unit(self, name: str) -> str:
        self.calls.append(("stop", name))
        unit = self.unit(name)
        if name in self._jobs:  # "replace": the pending start job is cancelled
            self._cancelled.add(unit.job)
            self._jobs.pop(name)
            unit.job = 0
        if self._job_types.get(unit.job) == "stop":  # the queued stop runs now
            unit.job = 0
        if unit.active in ("inactive", "failed"):
            return "done"
        self._set(unit, "deactivating", "stop-sigterm")
        await asyncio.sleep(0)
        self._set(unit, "inactive", "dead")
        return "done"

    def crash(self, name: str, result: str = "exit-code", status: int = 1) -> None:
        """The unit's main process dies on its own."""
        unit = self.unit(name)
        unit.result, unit.status = result, status
        self._set(unit, "failed", "failed")

    async def get(self, name: str, interface: str, prop: str) -> Any:
        unit = self.unit(name)
        values: dict[tuple[str, str], Any] = {
            ("Unit", "ActiveState"): unit.active,
            ("Unit", "SubState"): unit.sub,
            ("Unit", "ActiveEnterTimestampMonotonic"): unit.active_enter_us,
            ("Unit", "InactiveExitTimestampMonotonic"): unit.inactive_exit_us,
            ("Unit", "ConditionResult"): unit.condition_result,
            ("Unit", "Job"): [
                unit.job,
                f"/org/freedesktop/systemd1/job/{unit.job}" if unit.job else "/",
            ],
            ("Service", "Result"): unit.result,
            ("Service", "ExecMainStatus"): unit.status,
            ("Service", "MemoryCurrent"): unit.memory_current,
            ("Service", "MemoryMax"): unit.memory_max,
            ("Service", "DeviceAllow"): [list(r) for r in unit.properties.get("DeviceAllow", [])],
        }
        return values[(interface, prop)]

    async def set_properties(self, name: str, props: Sequence[tuple[str, str, Any]]) -> None:
        self.calls.append(("set-property", name))
        property_values(props)  # what the real adapter sends: raises if D-Bus would refuse it
        unit = self.unit(name)
        for key, _sig, value in props:
            if key == "DeviceAllow" and value == []:
                unit.properties[key] = []  # an empty list resets, as systemd does
            else:
                unit.properties.setdefault(key, []).extend(
                    value if isinstance(value, list) else [value]
                )

    async def watch(self, name: str, callback: StateCallback) -> None:
        unit = self.unit(name)
        unit.watchers.append(callback)
        callback(unit.active, unit.sub)

    async def unit_pids(self, name: str) -> list[int]:
        return list(self.unit(name).pids)
