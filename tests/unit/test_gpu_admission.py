"""Admission across fronts: retirement (LRU, never busy), freed-memory delay, reservations, lock."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent.front.gpu_hooks import GpuAdmission
from agent.gpu.admission import (
    AdmissionRefused,
    ControlPeers,
    admit,
    cards_status,
    holder_from_status,
)
from agent.gpu.footprint import Footprints
from agent.gpu.nvml import GIB, FakeCard, FakeNvml
from agent.gpu.placement import Holder
from agent.gpu.reservations import Reservation, gpu_lock, read_reservations
from agent.net import rpc
from agent.spec.provider import Provider

CARD = "GPU-0000"


def provider(slug: str, budget_gib: float | None = 36, **kw: Any) -> Provider:
    kw.setdefault("gpu_devices", "auto")
    return Provider(slug=slug, source=Path(f"/m/{slug}.toml"), vram_budget_gb=budget_gib, **kw)


class FakePeers:
    """Other providers as the fake GPU sees them; retiring ends their process."""

    def __init__(self, nvml: FakeNvml, rt: Path, list_delay_s: float = 0.0) -> None:
        self.nvml = nvml
        self.rt = rt
        self.holders: dict[str, Holder] = {}
        self.pids: dict[str, int] = {}
        self.refuse: set[str] = set()
        self.retired: list[str] = []
        self.list_delay_s = list_delay_s

    def run(self, slug: str, pid: int, gib: float, *, busy: int = 0, last: float = 0) -> None:
        self.nvml.allocate(pid, CARD, int(gib * GIB))
        self.holders[slug] = Holder(slug, (CARD,), int(gib * GIB), busy, last)
        self.pids[slug] = pid

    async def list(self) -> list[Holder]:
        if self.list_delay_s:
            await asyncio.sleep(self.list_delay_s)
        return list(self.holders.values())

    async def retire(self, slug: str) -> bool:
        if slug in self.refuse or self.holders[slug].busy:
            return False
        self.retired.append(slug)
        del self.holders[slug]
        self.nvml.exit(self.pids.pop(slug))
        return True


def setup(tmp_path: Path, delay: float = 0.11) -> tuple[FakeNvml, FakePeers, Footprints]:
    nv = FakeNvml([FakeCard(0, CARD, 80 * GIB)], release_delay_s=delay)
    return nv, FakePeers(nv, tmp_path / "run"), Footprints(tmp_path / "state")


def run_admit(p: Provider, nv: FakeNvml, peers: FakePeers, fp: Footprints, **kw: Any) -> Any:
    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("headroom_bytes", 0)
    kw.setdefault("poll_s", 0.02)
    return asyncio.run(admit(p, nv, peers, fp, runtime_dir=peers.rt, **kw))


def test_admits_and_reserves_then_releases(tmp_path: Path) -> None:
    nv, peers, fp = setup(tmp_path)
    a = run_admit(provider("esm"), nv, peers, fp)
    assert a.placement.uuids == (CARD,)
    assert a.retired == ()
    r = read_reservations(peers.rt)
    assert [(x.slug, x.cards, x.need_bytes, x.owner_pid) for x in r] == [
        ("esm", (CARD,), 36 * GIB, os.getpid())
    ]
    a.set_pids({12, 11})
    assert read_reservations(peers.rt)[0].pids == (11, 12)
    a.release()
    assert read_reservations(peers.rt) == []


def test_third_provider_retires_the_least_recently_used_idle_one(tmp_path: Path) -> None:
    nv, peers, fp = setup(tmp_path)
    peers.run("first", 101, 36, last=10)
    peers.run("second", 102, 36, last=20)
    a = run_admit(provider("third"), nv, peers, fp)
    assert peers.retired == ["first"]
    assert a.retired == ("first",)
    # NVML showed the freed memory only after the release delay, and admission waited for it.
    assert a.freed_wait_s >= 0.1
    assert nv.cards()[0].free == 44 * GIB  # the third has reserved, not yet allocated


def test_a_busy_provider_is_never_retired(tmp_path: Path) -> None:
    nv, peers, fp = setup(tmp_path)
    peers.run("first", 101, 36, busy=1, last=10)
    peers.run("second", 102, 36, last=20)
    a = run_admit(provider("third"), nv, peers, fp)
    assert peers.retired == ["second"]
    assert a.retired == ("second",)
    assert "first" in peers.holders


def test_a_request_that_raced_in_keeps_the_victim_and_admission_plans_again(tmp_path: Path) -> None:
    nv, peers, fp = setup(tmp_path)
    peers.run("first", 101, 36, last=10)
    peers.run("second", 102, 36, last=20)
    peers.refuse.add("first")  # its front saw a request arrive before retiring

    original = peers.retire

    async def retire(slug: str) -> bool:
        ok = await original(slug)
        if not ok:  # from now on its status says busy
            h = peers.holders[slug]
            peers.holders[slug] = Holder(h.slug, h.gpus, h.vram_bytes, 1, h.last_used)
        return ok

    peers.retire = retire  # type: ignore[method-assign]
    a = run_admit(provider("third"), nv, peers, fp)
    assert a.retired == ("second",)
    assert "first" in peers.holders


def test_waits_for_a_busy_holder_to_finish(tmp_path: Path) -> None:
    nv, peers, fp = setup(tmp_path)
    peers.run("first", 101, 36, busy=1, last=10)
    peers.run("second", 102, 36, busy=1, last=20)

    async def main() -> Any:
        async def finish() -> None:
            await asyncio.sleep(0.2)
            h = peers.holders["second"]
            peers.holders["second"] = Holder(h.slug, h.gpus, h.vram_bytes, 0, 30)

        asyncio.get_running_loop().create_task(finish())
        return await admit(
            provider("third"),
            nv,
            peers,
            fp,
            timeout_s=3,
            headroom_bytes=0,
            poll_s=0.02,
            runtime_dir=peers.rt,
        )

    began = time.monotonic()
    a = asyncio.run(main())
    assert a.retired == ("second",)
    assert time.monotonic() - began >= 0.2


def test_refuses_after_the_timeout_naming_the_busy_holders(tmp_path: Path) -> None:
    nv, peers, fp = setup(tmp_path)
    peers.run("first", 101, 36, busy=2, last=10)
    peers.run("second", 102, 36, busy=1, last=20)
    with pytest.raises(AdmissionRefused) as e:
        run_admit(provider("third"), nv, peers, fp, timeout_s=0.2)
    body = e.value.refusal.body()
    assert body["holders"] == [
        {"slug": "first", "busy": True, "requests_in_flight": 2, "kept": "busy, 2 in flight"},
        {"slug": "second", "busy": True, "requests_in_flight": 1, "kept": "busy, 1 in flight"},
    ]
    assert "Not enough GPU memory for third" in body["message"]
    assert peers.retired == []
    assert read_reservations(peers.rt) == []


def test_a_provider_that_can_never_fit_is_refused_at_once(tmp_path: Path) -> None:
    nv, peers, fp = setup(tmp_path)
    peers.run("first", 101, 36, last=10)
    began = time.monotonic()
    with pytest.raises(AdmissionRefused) as e:
        run_admit(provider("huge", 100), nv, peers, fp, timeout_s=5)
    assert e.value.refusal.permanent
    assert time.monotonic() - began < 1
    assert peers.retired == []


def test_the_measured_footprint_raises_the_need(tmp_path: Path) -> None:
    nv, peers, fp = setup(tmp_path)
    peers.run("first", 101, 40, last=10)
    fp.record("esm", 45 * GIB)  # declared 36, measured 45: only fits after retiring
    a = run_admit(provider("esm"), nv, peers, fp)
    assert a.need_bytes == 45 * GIB
    assert a.retired == ("first",)


def test_a_starting_workers_reservation_counts_until_nvml_shows_it(tmp_path: Path) -> None:
    nv, peers, fp = setup(tmp_path)
    # reserved, loading, not on the card yet
    first = run_admit(provider("first", 45), nv, peers, fp)
    with pytest.raises(AdmissionRefused):
        run_admit(provider("second", 45), nv, peers, fp, timeout_s=0.1)
    # Once it shows on the card, the reservation covers only what it has not used yet.
    nv.allocate(555, CARD, 20 * GIB)
    first.set_pids({555})
    with pytest.raises(AdmissionRefused):
        run_admit(provider("second", 45), nv, peers, fp, timeout_s=0.1)
    first.release()
    nv.exit(555)
    assert run_admit(provider("second", 45), nv, peers, fp).placement.uuids == (CARD,)


def test_a_stale_reservation_of_a_dead_front_is_ignored(tmp_path: Path) -> None:
    nv, peers, fp = setup(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    f = peers.rt / "ghost" / "gpu.json"
    f.parent.mkdir(parents=True)
    f.write_text(Reservation("ghost", (CARD,), 70 * GIB, (), dead.pid, 0).to_json())
    assert read_reservations(peers.rt) == []
    assert run_admit(provider("esm", 60), nv, peers, fp).retired == ()


def test_two_fronts_admitting_at_once_do_not_share_the_free_memory(tmp_path: Path) -> None:
    nv, peers, fp = setup(tmp_path)
    peers.list_delay_s = 0.05  # both are between reading NVML and reserving at the same time

    async def main() -> list[Any]:
        return await asyncio.gather(
            *(
                admit(
                    provider(s, 45),
                    nv,
                    peers,
                    fp,
                    timeout_s=0.4,
                    headroom_bytes=0,
                    runtime_dir=peers.rt,
                )
                for s in ("one", "two")
            ),
            return_exceptions=True,
        )

    results = asyncio.run(main())
    assert sorted(type(r).__name__ for r in results) == ["AdmissionRefused", "Admitted"]


def test_the_lock_is_held_across_processes(tmp_path: Path) -> None:
    nv, peers, fp = setup(tmp_path)
    peers.rt.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(peers.rt / 'gpu.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(30)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(AdmissionRefused, match="held the GPU lock"):
            run_admit(provider("esm"), nv, peers, fp, timeout_s=0.2)
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()

    async def locked() -> None:
        async with gpu_lock(peers.rt, 1):
            pass

    asyncio.run(locked())
    assert run_admit(provider("esm"), nv, peers, fp).placement.uuids == (CARD,)


def test_cpu_provider_is_admitted_without_touching_nvml(tmp_path: Path) -> None:
    nv, peers, fp = setup(tmp_path)
    nv.fail("no driver")
    a = run_admit(provider("cpu", None, gpu_devices="none"), nv, peers, fp)
    assert a.placement.cards == ()
    assert nv.calls == 0


def test_holder_from_a_front_status() -> None:
    status = {
        "slug": "x",
        "in_flight": 1,
        "waiting": 2,
        "last_used": 123.5,
        "gpu": {"uuids": [CARD], "used_bytes": 3 * GIB, "need_bytes": 5 * GIB},
    }
    assert holder_from_status("x", status) == Holder("x", (CARD,), 5 * GIB, 3, 123.5)
    status["pinned"] = True
    status["gpu"]["priority"] = -3  # type: ignore[index]
    assert holder_from_status("x", status) == Holder("x", (CARD,), 5 * GIB, 3, 123.5, -3, True)
    assert holder_from_status("y", {"gpu": {"uuids": []}}) is None
    assert holder_from_status("z", {"gpu": {}}) is None


def test_control_peers_over_real_control_sockets(tmp_path: Path) -> None:
    rt = tmp_path / "run"
    answers: list[str] = []

    def front(slug: str, busy: int, uuids: list[str]) -> Any:
        async def handle(request: dict[str, Any]) -> dict[str, Any]:
            answers.append(f"{slug}:{request['op']}")
            if request["op"] == "retire":
                return {"retired": False, "busy": busy} if busy else {"retired": True}
            return {
                "slug": slug,
                "in_flight": busy,
                "waiting": 0,
                "last_used": 5.0,
                "gpu": {"uuids": uuids, "used_bytes": GIB, "need_bytes": None},
            }

        return handle

    async def main() -> tuple[list[Holder], bool, bool]:
        servers = [
            await rpc.serve(rt / "me" / "control.sock", front("me", 0, [CARD])),
            await rpc.serve(rt / "busy" / "control.sock", front("busy", 2, [CARD])),
            await rpc.serve(rt / "idle" / "control.sock", front("idle", 0, [CARD])),
            await rpc.serve(rt / "cpu" / "control.sock", front("cpu", 0, [])),
        ]
        (rt / "gone").mkdir()
        (rt / "gone" / "control.sock").touch()  # a stale socket file: skipped
        peers = ControlPeers("me", rt)
        try:
            return await peers.list(), await peers.retire("busy"), await peers.retire("idle")
        finally:
            for s in servers:
                s.close()

    holders, busy_retired, idle_retired = asyncio.run(main())
    assert holders == [Holder("busy", (CARD,), GIB, 2, 5.0), Holder("idle", (CARD,), GIB, 0, 5.0)]
    assert (busy_retired, idle_retired) == (False, True)
    assert "me:status" not in answers


def test_cards_status_names_who_holds_each_card(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "nvml"
    fake.mkdir()
    (fake / "cards.json").write_text(
        json.dumps([{"uuid": CARD, "total": 80 * GIB, "name": "Fake"}])
    )
    monkeypatch.setenv("PROVIDERD_NVML_FAKE", str(fake))
    rt = tmp_path / "run"
    (rt / "esm").mkdir(parents=True)
    (rt / "esm" / "gpu.json").write_text(
        Reservation("esm", (CARD,), GIB, (), os.getpid()).to_json()
    )
    [card] = cards_status(rt)
    assert card["held_by"] == ["esm"]
    assert card["free_bytes"] == 80 * GIB
    monkeypatch.setenv("PROVIDERD_NVML_FAKE", str(tmp_path / "missing"))
    assert cards_status(rt) == []


def test_a_ready_workers_memory_is_not_counted_twice_by_the_next_admission(
    tmp_path: Path,
) -> None:
    """Right after a worker is ready, its reservation names its PIDs (not only at the
    sampler's next tick), so the next start sees its memory once and retires nobody."""
    nv, peers, fp = setup(tmp_path)

    class Worker:
        def __init__(self) -> None:
            self.running: list[int] = []

        async def pids(self) -> list[int]:
            return self.running

    class FrontStub:
        log = logging.getLogger("test")

        def release_worker(self, why: str) -> None:
            raise AssertionError(why)

    async def main() -> tuple[tuple[int, ...], tuple[str, ...]]:
        worker, front = Worker(), FrontStub()
        ga = GpuAdmission(
            provider("first"), worker, nvml=nv, peers=peers, footprints=fp,
            headroom_bytes=0, runtime_dir=peers.rt, interval_s=60,
        )  # fmt: skip
        await ga.admit(front)  # type: ignore[arg-type]
        await asyncio.sleep(0.01)  # the sampler's first tick: no worker process yet
        worker.running = [os.getpid()]  # the worker starts, loads 30 GiB, answers
        nv.allocate(os.getpid(), CARD, 30 * GIB)
        peers.holders["first"] = Holder("first", (CARD,), 36 * GIB, 0, 1.0)
        peers.pids["first"] = os.getpid()
        await ga.started(front)  # type: ignore[arg-type]
        (mine,) = read_reservations(peers.rt)
        second = await admit(
            provider("second"), nv, peers, fp, timeout_s=1, headroom_bytes=0,
            runtime_dir=peers.rt, poll_s=0.02,
        )  # fmt: skip
        await ga.released(front)  # type: ignore[arg-type]
        second.release()
        return mine.pids, second.retired

    pids, retired = asyncio.run(main())
    assert pids == (os.getpid(),)
    assert retired == ()  # 80 GiB card: 30 used by first (need 36) + 36 for second fit
