"""VRAM sampling: PID matching across namespaces, enforcement once per crossing, peaks."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Collection
from pathlib import Path

import pytest

from agent.gpu.nvml import GIB, FakeCard, FakeNvml, GpuProcess, NvmlUnavailable
from agent.gpu.vram import Enforcer, Overage, ProcFs, VramSampler, attribute


class FakeProc:
    """`/proc` as a table: pid (front's view) -> NSpid."""

    def __init__(self, table: dict[int, tuple[int, ...]]) -> None:
        self.table = table

    def nspids(self, pid: int) -> tuple[int, ...] | None:
        return self.table.get(pid)


def test_matches_pids_seen_from_the_front() -> None:
    procs = [
        GpuProcess(100, "GPU-a", 5 * GIB),
        GpuProcess(200, "GPU-a", 7 * GIB),
        GpuProcess(101, "GPU-b", GIB),
    ]
    proc = FakeProc({100: (100,), 101: (101,), 200: (200,)})
    assert attribute(procs, {100, 101}, proc) == {"GPU-a": 5 * GIB, "GPU-b": GIB}


def test_matches_pids_nvml_reports_from_the_workers_namespace() -> None:
    # The worker runs in a child PID namespace: the front sees 4242, inside it is 7.
    procs = [GpuProcess(7, "GPU-a", 9 * GIB)]
    proc = FakeProc({4242: (4242, 7)})
    assert attribute(procs, {4242}, proc) == {"GPU-a": 9 * GIB}


def test_never_attributes_an_unrelated_live_process_with_a_colliding_pid() -> None:
    # NVML's 7 is also a live process in the front's view (not ours): not counted.
    procs = [GpuProcess(7, "GPU-a", 9 * GIB)]
    proc = FakeProc({4242: (4242, 7), 7: (7,)})
    assert attribute(procs, {4242}, proc) == {}


def test_procfs_reads_nspid(tmp_path: Path) -> None:
    (tmp_path / "55").mkdir()
    (tmp_path / "55" / "status").write_text("Name:\tx\nPid:\t55\nNSpid:\t55\t3\t1\n")
    (tmp_path / "56").mkdir()
    (tmp_path / "56" / "status").write_text("Name:\told kernel\nPid:\t56\n")
    fs = ProcFs(tmp_path)
    assert fs.nspids(55) == (55, 3, 1)
    assert fs.nspids(56) == (56,)
    assert fs.nspids(57) is None
    assert ProcFs().nspids(os.getpid()) is not None


def test_stop_acts_once() -> None:
    e = Enforcer(10, "stop")
    assert e.observe(5) is None
    assert e.observe(11) == "stop"
    assert e.observe(12) is None
    assert e.observe(5) is None
    assert e.observe(12) is None


def test_warn_acts_once_per_crossing() -> None:
    e = Enforcer(10, "warn")
    assert [e.observe(n) for n in (11, 12, 13, 9, 10, 11, 15, 1, 20)] == [
        "warn",
        None,
        None,
        None,
        None,
        "warn",
        None,
        None,
        "warn",
    ]


def test_no_budget_never_acts() -> None:
    assert Enforcer(None, "stop").observe(10**15) is None


def sampler(nv: FakeNvml, pids: Collection[int], **kw: object) -> tuple[VramSampler, list[Overage]]:
    seen: list[Overage] = []

    async def on_over(o: Overage) -> None:
        seen.append(o)

    async def get_pids() -> Collection[int]:
        return pids

    proc = FakeProc({p: (p,) for p in pids})
    s = VramSampler(nv, "esm", get_pids, on_over=on_over, proc=proc, interval_s=0.001, **kw)  # type: ignore[arg-type]
    return s, seen


def test_sampler_stops_an_over_budget_worker_with_the_numbers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nv = FakeNvml([FakeCard(0, "GPU-a", 80 * GIB)])
    nv.allocate(10, "GPU-a", 4 * GIB)
    nv.allocate(11, "GPU-a", 4 * GIB)
    nv.allocate(99, "GPU-a", 50 * GIB)  # someone else's
    s, seen = sampler(nv, {10, 11}, budget_bytes=10 * GIB, enforce="stop")

    async def main() -> None:
        task = asyncio.create_task(s.run())
        await asyncio.sleep(0.02)
        assert not seen and s.used_bytes == 8 * GIB
        nv.allocate(11, "GPU-a", 7 * GIB)
        await asyncio.wait_for(task, 1)  # returns once it has stopped the worker

    asyncio.run(main())
    assert len(seen) == 1
    assert (seen[0].used, seen[0].budget, seen[0].action) == (11 * GIB, 10 * GIB, "stop")
    assert seen[0].message == (
        "Worker of esm uses 11.0 GiB of VRAM on GPU-a, over its budget of 10.0 GiB; "
        'stopping it (enforce = "stop").'
    )
    assert s.peak_bytes == 11 * GIB
    assert seen[0].message in caplog.text


def test_sampler_warns_once_per_crossing() -> None:
    nv = FakeNvml([FakeCard(0, "GPU-a", 80 * GIB)])
    s, seen = sampler(nv, {10}, budget_bytes=10 * GIB, enforce="warn")
    for n in (5, 11, 12, 9, 13):
        nv.allocate(10, "GPU-a", n * GIB)
        asyncio.run(s.step())
    assert [o.used for o in seen] == [11 * GIB, 13 * GIB]
    assert all(o.action == "warn" for o in seen)
    assert "leaving it running" in seen[0].message
    assert s.peak_bytes == 13 * GIB


def test_peak_is_per_card() -> None:
    nv = FakeNvml([FakeCard(0, "GPU-a", 80 * GIB), FakeCard(1, "GPU-b", 80 * GIB)])
    nv.allocate(10, "GPU-a", 6 * GIB)
    nv.allocate(10, "GPU-b", 5 * GIB)
    s, _ = sampler(nv, {10}, budget_bytes=None, enforce="stop")
    asyncio.run(s.step())
    assert s.used == {"GPU-a": 6 * GIB, "GPU-b": 5 * GIB}
    assert s.peak_bytes == 6 * GIB


def test_sampler_reports_pid_changes_and_survives_nvml_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nv = FakeNvml([FakeCard(0, "GPU-a", 80 * GIB)])
    changes: list[frozenset[int]] = []
    s, _ = sampler(nv, {10, 11}, budget_bytes=GIB, enforce="stop", on_pids=changes.append)
    nv.fail("GPU is lost")
    asyncio.run(s.step())
    asyncio.run(s.step())
    assert (
        caplog.text.count(
            "Failed to sample VRAM of esm: NVML is unavailable: GPU is lost, ignoring"
        )
        == 1
    )
    assert changes == [frozenset({10, 11})]
    assert isinstance(NvmlUnavailable("x"), RuntimeError)


def test_sampler_survives_a_failing_pid_lookup_and_reservation_write(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The unit's PIDs come over D-Bus and go to a file: either may fail for a while.
    The step logs once and the next one tries again; it never raises into the front."""
    nv = FakeNvml([FakeCard(0, "GPU-a", 80 * GIB)])
    nv.allocate(10, "GPU-a", 3 * GIB)
    failures = {"pids": 2, "write": 1}
    written: list[frozenset[int]] = []

    async def pids() -> list[int]:
        if failures["pids"]:
            failures["pids"] -= 1
            raise RuntimeError("org.freedesktop.DBus.Error.NoReply")
        return [10]

    def on_pids(p: frozenset[int]) -> None:
        if failures["write"]:
            failures["write"] -= 1
            raise OSError(28, "No space left on device")
        written.append(p)

    async def on_over(o: Overage) -> None:
        raise AssertionError(o)

    s = VramSampler(
        nv, "esm", pids, budget_bytes=8 * GIB, enforce="stop", on_over=on_over,
        on_pids=on_pids, proc=FakeProc({10: (10,)}),
    )  # fmt: skip
    for _ in range(4):
        asyncio.run(s.step())
    assert written == [frozenset({10})]  # the failed write was tried again
    assert s.used_bytes == 3 * GIB
    assert caplog.text.count("Failed to sample VRAM of esm") == 1
