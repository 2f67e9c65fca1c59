"""The GPU layer on a real card: NVML, placement → CUDA, per-PID VRAM, enforcement,
the freed-memory delay, and admission retiring real CUDA processes."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from gpu_tier import (
    GIB,
    MIB,
    Held,
    card,
    card_by_uuid,
    fake,
    figure,
    norm_bus,
    nvml,
    skip,
    wait_free,
)

from agent.gpu.admission import AdmissionRefused, admit
from agent.gpu.footprint import Footprints
from agent.gpu.placement import Holder, Plan, device_allow, plan_admission, worker_env
from agent.gpu.vram import Overage, ProcFs, VramSampler, attribute
from agent.spec.provider import Provider


def gpu_provider(slug: str, budget: int, **kw: object) -> Provider:
    return Provider(
        slug=slug,
        source=Path(f"/m/{slug}.toml"),
        gpu_devices="auto",
        vram_budget_gb=budget / GIB,
        **kw,  # type: ignore[arg-type]
    )


def test_nvml_lists_the_cards() -> None:
    cards = nvml().cards()
    for c in cards:
        figure(
            f"card {c.index}",
            f"{c.name} {c.uuid} minor {c.minor} bus {c.bus_id} "
            f"total {c.total / GIB:.1f} GiB free {c.free / GIB:.1f} GiB",
        )
        assert c.uuid.startswith(("GPU-", "MIG-"))
        assert 0 < c.free <= c.total
        assert fake() or Path(f"/dev/nvidia{c.minor}").exists()
    t0 = time.perf_counter()
    for _ in range(200):
        nvml().processes()
    figure("nvml processes() call", f"{(time.perf_counter() - t0) / 200 * 1e6:.0f} us")
    t0 = time.perf_counter()
    for _ in range(200):
        nvml().cards()
    figure("nvml cards() call", f"{(time.perf_counter() - t0) / 200 * 1e6:.0f} us")


def test_placement_reaches_cuda() -> None:
    c = card()
    plan = plan_admission(gpu_provider("p", GIB), GIB, nvml().cards(), [], 512 * MIB)
    assert isinstance(plan, Plan)
    env = worker_env(plan.placement)
    assert env["CUDA_VISIBLE_DEVICES"] == plan.placement.uuids[0]
    rules = device_allow(plan.placement)
    assert (f"/dev/nvidia{plan.placement.cards[0].minor}", "rw") in rules
    held = Held(256 * MIB, env)
    try:
        chosen = plan.placement.cards[0]
        figure("placement", f"chose GPU {chosen.index}; CUDA saw bus {held.info['bus_id']}")
        assert held.info["CUDA_VISIBLE_DEVICES"] == chosen.uuid
        if chosen.bus_id:
            assert norm_bus(held.info["bus_id"]) == norm_bus(chosen.bus_id)
    finally:
        held.kill()
    # devices = "none": CUDA sees no device at all.
    import json
    import subprocess
    import sys

    from gpu_tier import WORKER

    out = subprocess.run(
        [sys.executable, str(WORKER), "probe"],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    probe = json.loads(out.stdout)
    figure("CUDA_VISIBLE_DEVICES= (none)", json.dumps(probe))
    assert probe.get("devices", 0) == 0
    del c


def test_per_process_vram_matches_the_workers_pid() -> None:
    c = card()
    held = Held(4 * GIB, {"CUDA_VISIBLE_DEVICES": c.uuid})
    try:
        time.sleep(0.2)
        procs = nvml().processes()
        nvml_pids = sorted(p.pid for p in procs if p.card_uuid == c.uuid)
        direct = held.pid in nvml_pids
        ns = ProcFs().nspids(held.pid)
        figure(
            "NVML pid view",
            f"worker pid {held.pid} NSpid {ns}; NVML lists {nvml_pids}; "
            f"{'same namespace' if direct else 'other namespace'}",
        )
        used = attribute(procs, {held.pid}, ProcFs()).get(c.uuid, 0)
        figure("per-process VRAM of a 4 GiB worker", f"{used / GIB:.2f} GiB")
        if not nvml_pids:
            skip("NVML lists no processes here (PID namespace of a container?)")
        assert used >= 4 * GIB
        assert used < 6 * GIB
    finally:
        held.kill()


def test_over_budget_worker_is_stopped_and_warn_warns_once() -> None:
    c = card()
    held = Held(3 * GIB, {"CUDA_VISIBLE_DEVICES": c.uuid})
    seen: list[Overage] = []
    stopped_at: list[float] = []

    async def pids() -> list[int]:
        return [held.pid] if held.proc.poll() is None else []

    async def on_over(o: Overage) -> None:
        seen.append(o)
        if o.action == "stop":
            stopped_at.append(held.kill(signal.SIGTERM))

    async def main(enforce: str) -> VramSampler:
        s = VramSampler(
            nvml(),
            "over",
            pids,
            budget_bytes=2 * GIB,
            enforce=enforce,  # type: ignore[arg-type]
            on_over=on_over,
            interval_s=0.1,
        )
        if enforce == "warn":
            for _ in range(5):
                await s.step()
                await asyncio.sleep(0.02)
        else:
            await asyncio.wait_for(s.run(), 10)
        return s

    try:
        t0 = time.monotonic()
        s = asyncio.run(main("warn"))
        assert [o.action for o in seen] == ["warn"]
        s = asyncio.run(main("stop"))
        assert [o.action for o in seen] == ["warn", "stop"]
        figure("enforcement", seen[-1].message)
        figure("over-budget stop after", f"{stopped_at[0] - t0:.2f} s (sampling every 0.1 s)")
        figure("measured peak", f"{s.peak_bytes / GIB:.2f} GiB")
        assert held.proc.poll() is not None
    finally:
        held.kill()


def test_freed_memory_shows_in_nvml_after() -> None:
    c = card()
    delays: dict[str, list[float]] = {"SIGKILL": [], "SIGTERM": []}
    for sig in (signal.SIGKILL, signal.SIGTERM) * 3:
        before = card_by_uuid(c.uuid).free
        held = Held(10 * GIB, {"CUDA_VISIBLE_DEVICES": c.uuid})
        assert card_by_uuid(c.uuid).free < before - 9 * GIB
        at = held.kill(sig)
        freed = wait_free(c.uuid, before - 256 * MIB)
        delays[signal.Signals(sig).name].append(freed - at)
    for name, d in delays.items():
        figure(
            f"10 GiB freed in NVML after {name}",
            f"median {statistics.median(d):.3f} s, max {max(d):.3f} s ({len(d)} runs)",
        )
        assert max(d) < 5


class KillPeers:
    """Peers whose retirement ends a real CUDA process."""

    def __init__(self) -> None:
        self.held: dict[str, Held] = {}
        self.holders: dict[str, Holder] = {}
        self.retired: list[str] = []

    async def list(self) -> list[Holder]:
        return list(self.holders.values())

    async def retire(self, slug: str) -> bool:
        if self.holders[slug].busy:
            return False
        self.held.pop(slug).kill(signal.SIGTERM)
        del self.holders[slug]
        self.retired.append(slug)
        return True


def test_admission_retires_the_lru_idle_process_never_a_busy_one() -> None:
    c = card()
    share = int(c.total * 0.45)
    if c.free < 2 * share + 2 * GIB:
        skip(f"GPU {c.index} has only {c.free / GIB:.0f} GiB free; needs 2 x 45% free")
    peers = KillPeers()
    env = {"CUDA_VISIBLE_DEVICES": c.uuid}
    rt = Path(tempfile.mkdtemp(prefix="providerd-gpu-"))
    fp = Footprints(rt / "state")
    alloc = share - GIB  # plus the CUDA context, still within the share

    def run(slug: str, busy: int, last: float) -> None:
        peers.held[slug] = Held(alloc, env)
        peers.holders[slug] = Holder(slug, (c.uuid,), share, busy, last)

    try:
        run("oldest_busy", 1, 1.0)
        run("newer_idle", 0, 2.0)
        t0 = time.monotonic()
        a = asyncio.run(
            admit(
                gpu_provider("third", share),
                nvml(),
                peers,
                fp,
                timeout_s=30,
                runtime_dir=rt / "run",
            )
        )
        took = time.monotonic() - t0
        assert peers.retired == ["newer_idle"]
        figure(
            "admission, 2 x 45% held, third 45%",
            f"retired {a.retired} (the busy LRU kept); NVML showed it freed after "
            f"{a.freed_wait_s:.3f} s; admit took {took:.2f} s",
        )
        peers.held["third"] = Held(alloc, env)  # it really fits now
        peers.holders["third"] = Holder("third", (c.uuid,), share, 0, 3.0)
        a.set_pids({peers.held["third"].pid})

        # The busy one finishes; it is now the least recently used idle provider.
        peers.holders["oldest_busy"] = Holder("oldest_busy", (c.uuid,), share, 0, 1.0)
        b = asyncio.run(
            admit(
                gpu_provider("fourth", share),
                nvml(),
                peers,
                fp,
                timeout_s=30,
                runtime_dir=rt / "run",
            )
        )
        assert b.retired == ("oldest_busy",)
        assert "third" in peers.holders
        figure("admission, LRU", f"retired {b.retired}; freed after {b.freed_wait_s:.3f} s")
        b.release()
        a.release()

        # Everything busy: refused after the timeout, naming the holders.
        peers.holders = {s: Holder(s, (c.uuid,), share, 1, 0.0) for s in peers.holders}
        peers.held["fourth"] = Held(alloc, env)
        peers.holders["fourth"] = Holder("fourth", (c.uuid,), share, 1, 0.0)
        try:
            asyncio.run(
                admit(
                    gpu_provider("fifth", share),
                    nvml(),
                    peers,
                    fp,
                    timeout_s=1,
                    runtime_dir=rt / "run",
                )
            )
            raise AssertionError("admitted although every holder is busy")
        except AdmissionRefused as e:
            figure("refusal body", str(e.refusal.body()))
            assert {h["slug"] for h in e.refusal.body()["holders"]} == {"third", "fourth"}
    finally:
        for h in peers.held.values():
            h.kill()


def test_concurrent_admissions_do_not_share_free_memory() -> None:
    c = card()
    share = int(c.free * 0.6)
    rt = Path(tempfile.mkdtemp(prefix="providerd-gpu-"))

    class NoPeers:
        async def list(self) -> list[Holder]:
            await asyncio.sleep(0.05)  # both between reading NVML and reserving
            return []

        async def retire(self, slug: str) -> bool:
            return False

    async def main() -> list[object]:
        return await asyncio.gather(
            *(
                admit(
                    gpu_provider(s, share),
                    nvml(),
                    NoPeers(),
                    Footprints(rt / "state"),
                    timeout_s=0.5,
                    headroom_bytes=0,
                    runtime_dir=rt / "run",
                )
                for s in ("one", "two")
            ),
            return_exceptions=True,
        )

    results = asyncio.run(main())
    names = sorted(type(r).__name__ for r in results)
    figure("two admissions of 60% at once", ", ".join(names))
    assert names == ["AdmissionRefused", "Admitted"]
