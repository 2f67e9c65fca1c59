"""GPU admission across fronts: lock, plan, retire, wait for NVML, reserve.

Fronts are separate processes. Two of them admitting at once must not both take
the same free memory, so `admit()` holds an `flock` on `<runtime>/gpu.lock` from
reading NVML until its reservation is written. The reservation,
`<runtime>/<slug>/gpu.json`, stays while the worker starts and runs and is removed
on release; admission subtracts from NVML's free memory what each reservation
covers but NVML does not show yet (`need` less what its worker PIDs use), so a
worker that is still loading keeps its share (the reservations and the lock are
`agent.gpu.reservations`). Releasing never takes the lock, so a retiring front cannot
deadlock with the front that asked it to retire.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from agent.errors import ProviderdError
from agent.gpu.footprint import Footprints
from agent.gpu.nvml import (
    MIB,
    Nvml,
    NvmlUnavailable,
    gpu_status,
    open_nvml,
)
from agent.gpu.placement import (
    DEFAULT_HEADROOM,
    Holder,
    Placement,
    Plan,
    Refusal,
    need_bytes,
    plan_admission,
)
from agent.gpu.procs import ProcFs, ProcReader
from agent.gpu.quick import reserve_if_fits
from agent.gpu.reservations import Admitted, effective_cards, gpu_lock, read_reservations
from agent.net import rpc
from agent.spec import paths
from agent.spec.provider import Provider

log = logging.getLogger(__name__)

FREED_SLACK = 64 * MIB  # NVML may show a little less freed than the retired provider held


class Peers(Protocol):
    """The other providers, as the front reaches them over their control sockets."""

    async def list(self) -> list[Holder]:
        """Providers that hold or reserve GPU memory, with requests in flight and last use.

        `vram_bytes` should be the larger of the provider's reservation and its
        measured use: what retiring it frees on each of its cards.
        """
        ...

    async def retire(self, slug: str) -> bool:
        """Ask `slug` to retire (`{"op": "retire"}`); True once its worker is stopped."""
        ...


class AdmissionRefused(ProviderdError):
    code = "gpu_unavailable"  # as Refusal.body()'s "error"

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


async def admit(
    provider: Provider,
    nvml: Nvml,
    peers: Peers,
    footprints: Footprints,
    *,
    timeout_s: float,
    headroom_bytes: int = DEFAULT_HEADROOM,
    release_wait_s: float = 5.0,
    poll_s: float = 0.25,
    runtime_dir: Path | None = None,
    proc: ProcReader | None = None,
) -> Admitted:
    """Admit `provider` to the GPU(s) within `timeout_s`, retiring idle providers if needed.

    Returns `Admitted` (placement + reservation written); the caller writes
    `worker_env(placement)`, sets `device_allow(placement)`, starts the worker,
    and calls `release()` when the worker is gone. Raises `AdmissionRefused` (its
    `refusal.body()` is the 503's JSON) when it cannot fit in time or ever, and
    `NvmlUnavailable` when NVML fails.
    """
    rt = runtime_dir if runtime_dir is not None else paths.runtime_dir()
    pr = proc if proc is not None else ProcFs()
    need = need_bytes(provider, footprints.peak(provider.slug))
    if not provider.uses_gpu:
        return Admitted(provider.slug, Placement(), 0, runtime_dir=rt)
    deadline = time.monotonic() + timeout_s
    retired: list[str] = []
    freed_wait = 0.0
    while True:
        try:
            async with gpu_lock(rt, max(0.0, deadline - time.monotonic())):
                outcome = await _attempt(
                    provider, nvml, peers, need, headroom_bytes, rt, pr, deadline, release_wait_s
                )
        except TimeoutError:
            raise AdmissionRefused(
                Refusal(
                    f"Not admitted to the GPU within {timeout_s:g} s: "
                    "other providers' admissions held the GPU lock."
                )
            ) from None
        if isinstance(outcome, Refusal):
            if outcome.permanent or time.monotonic() >= deadline:
                raise AdmissionRefused(outcome)
            # Polling is the only way here: what frees the memory is another process (a
            # request ending in another front, a process outside providerd), and NVML
            # sends no event when memory is freed.
            await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
            continue
        admitted, now_retired, waited = outcome
        retired += now_retired
        freed_wait += waited
        admitted.retired = tuple(retired)
        admitted.freed_wait_s = freed_wait
        return admitted


async def _attempt(
    provider: Provider,
    nvml: Nvml,
    peers: Peers,
    need: int,
    headroom: int,
    rt: Path,
    proc: ProcReader,
    deadline: float,
    release_wait_s: float,
) -> tuple[Admitted, list[str], float] | Refusal:
    """One pass under the lock: plan, retire, wait for freed memory, re-plan, reserve."""
    retired: list[str] = []
    waited = 0.0
    for _ in range(4):
        cards, _procs = effective_cards(nvml, provider.slug, rt, proc)
        holders = [h for h in await peers.list() if h.slug != provider.slug]
        plan = reserve_if_fits(provider, need, cards, holders, headroom, rt)
        if isinstance(plan, Refusal):
            return plan
        if isinstance(plan, Admitted):
            return plan, retired, waited
        now_retired = []
        for slug in plan.victims:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                ok = await asyncio.wait_for(peers.retire(slug), left)
            except TimeoutError:
                ok = False
            if not ok:
                log.info("%s did not retire (a request raced in); planning again", slug)
                break
            log.info("Retired %s to make room on the GPU for %s", slug, provider.slug)
            now_retired.append(slug)
        if not now_retired:
            return Refusal(
                f"Not enough GPU memory for {provider.slug}: "
                f"{', '.join(plan.victims)} could not be retired.",
                tuple((h.slug, h.busy) for h in holders if h.slug in plan.victims),
            )
        retired += now_retired
        gone = [h for h in holders if h.slug in now_retired]
        expect = {c.uuid: c.free for c in cards}
        for h in gone:
            for uuid in h.gpus:
                if uuid in expect:
                    expect[uuid] += h.vram_bytes - FREED_SLACK
        remaining = [h for h in holders if h.slug not in now_retired]
        until = min(deadline, time.monotonic() + release_wait_s)
        waited += await _wait_freed(
            provider, nvml, need, headroom, remaining, expect, rt, proc, until
        )
    return Refusal(f"Not enough GPU memory for {provider.slug}: retiring did not free enough.")


async def _wait_freed(
    provider: Provider,
    nvml: Nvml,
    need: int,
    headroom: int,
    holders: Sequence[Holder],
    expect: dict[str, int],
    rt: Path,
    proc: ProcReader,
    until: float,
) -> float:
    """Poll NVML until the retired memory shows as free (or `until`); the seconds waited.

    Done when the provider fits without further victims, or when every card shows
    the free memory expected once the retired providers' share is back.
    """
    start = time.monotonic()
    # Polling is the only way here: the retired worker was another process, its memory
    # is freed by the driver some time after it has gone, and NVML sends no event then.
    while True:
        cards, _ = effective_cards(nvml, provider.slug, rt, proc)
        plan = plan_admission(provider, need, cards, holders, headroom)
        fits = isinstance(plan, Plan) and not plan.victims
        back = all(c.free >= expect.get(c.uuid, 0) for c in cards)
        if fits or back or time.monotonic() >= until:
            return time.monotonic() - start
        await asyncio.sleep(0.01)


# --- the other fronts, over their control sockets ---------------------------------


class ControlPeers:
    """`Peers` over the other fronts' control sockets under the runtime directory."""

    def __init__(self, me: str, runtime_dir: Path | None = None, timeout_s: float = 5.0) -> None:
        self.me = me
        self.runtime_dir = runtime_dir if runtime_dir is not None else paths.runtime_dir()
        self.timeout_s = timeout_s
        self.retire_timeout_s = 120.0

    async def list(self) -> list[Holder]:
        holders = []
        for sock in sorted(self.runtime_dir.glob("*/control.sock")):
            slug = sock.parent.name
            if slug == self.me:
                continue
            try:
                st = await rpc.acall(sock, {"op": "status"}, self.timeout_s)
            except (rpc.RpcError, ValueError):
                continue
            holder = holder_from_status(slug, st)
            if holder is not None:
                holders.append(holder)
        return holders

    async def retire(self, slug: str) -> bool:
        sock = self.runtime_dir / slug / "control.sock"
        try:
            answer = await rpc.acall(sock, {"op": "retire"}, self.retire_timeout_s)
        except (rpc.RpcError, ValueError) as e:
            log.warning("Failed to retire %s: %s", slug, e)
            return False
        return answer.get("retired") is True


def holder_from_status(slug: str, status: dict[str, Any]) -> Holder | None:
    """A `Holder` from a front's status object; None if it holds no GPU."""
    gpu = status.get("gpu") or {}
    uuids = gpu.get("uuids") or []
    if not uuids:
        return None
    vram = max(int(gpu.get("used_bytes") or 0), int(gpu.get("need_bytes") or 0))
    busy = int(status.get("in_flight") or 0) + int(status.get("waiting") or 0)
    return Holder(
        slug,
        tuple(str(u) for u in uuids),
        vram,
        busy,
        float(status.get("last_used") or 0),
        int(gpu.get("priority") or 0),
        status.get("pinned") is True,
    )


def cards_status(runtime_dir: Path | None = None) -> list[dict[str, Any]]:
    """Per card: index, uuid, name, total/free/used bytes, processes, held_by (slugs)."""
    try:
        nvml = open_nvml()
    except NvmlUnavailable:
        return []
    try:
        cards = gpu_status(nvml, read_reservations(runtime_dir))
    except NvmlUnavailable:
        return []
    finally:
        nvml.close()
    for card in cards:
        card["held_by"] = [h["slug"] for h in card["held_by"]]
    return cards
