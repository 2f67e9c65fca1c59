"""Holding a worker to its VRAM budget.

`VramSampler` samples, every `interval_s`, the GPU memory of the worker's
processes: NVML's per-process usage matched to the worker's PIDs. It keeps the
peak (per card; it becomes the stored footprint) and, when usage goes over the
budget, reports an `Overage`: `enforce = "stop"` once (the front then stops the
worker), `"warn"` once per crossing (again only after usage fell back under).
Which processes are the worker's, across PID namespaces, is `agent.gpu.procs`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Literal

from agent.gpu.nvml import Nvml, format_bytes
from agent.gpu.procs import ProcFs, ProcReader, attribute
from agent.spec.provider import Enforce

log = logging.getLogger(__name__)


Action = Literal["stop", "warn"]


@dataclass(frozen=True)
class Overage:
    slug: str
    card_uuid: str
    used: int  # bytes on that card
    budget: int  # bytes per card
    action: Action

    @property
    def message(self) -> str:
        what = (
            'stopping it (enforce = "stop")'
            if self.action == "stop"
            else 'leaving it running (enforce = "warn")'
        )
        return (
            f"Worker of {self.slug} uses {format_bytes(self.used)} of VRAM on {self.card_uuid}, "
            f"over its budget of {format_bytes(self.budget)}; {what}."
        )


class Enforcer:
    """Pure: usage in, at most one action per crossing out."""

    def __init__(self, budget: int | None, enforce: Enforce) -> None:
        self.budget = budget
        self.enforce = enforce
        self._over = False
        self.stopped = False

    def observe(self, used: int) -> Action | None:
        if self.budget is None or self.stopped:
            return None
        if used <= self.budget:
            self._over = False
            return None
        if self._over:
            return None
        self._over = True
        if self.enforce == "stop":
            self.stopped = True
        return self.enforce


class VramSampler:
    """Samples one worker's VRAM while it runs; `await run()` until cancelled.

    `pids()` returns the worker's processes as the front sees them (the unit's
    cgroup, or the foreground worker's process tree). `on_over` receives each
    `Overage` (the sampler has logged it); for `"stop"` the front stops the worker.
    `on_pids`, if given, is called when the set of worker PIDs changes (the
    admission reservation records them).
    """

    def __init__(
        self,
        nvml: Nvml,
        slug: str,
        pids: Callable[[], Awaitable[Collection[int]]],
        *,
        budget_bytes: int | None,
        enforce: Enforce,
        on_over: Callable[[Overage], Awaitable[None]],
        on_pids: Callable[[frozenset[int]], None] | None = None,
        interval_s: float = 0.2,
        proc: ProcReader | None = None,
    ) -> None:
        self.nvml = nvml
        self.slug = slug
        self._pids = pids
        self.enforcer = Enforcer(budget_bytes, enforce)
        self._on_over = on_over
        self._on_pids = on_pids
        self.interval_s = interval_s
        self.proc: ProcReader = proc if proc is not None else ProcFs()
        self.peak_bytes = 0  # largest per-card use seen
        self.used: dict[str, int] = {}  # latest sample, per card
        self.samples = 0
        self._last_pids: frozenset[int] = frozenset()
        self._failing = False

    @property
    def used_bytes(self) -> int:
        """Latest per-card use (the largest card's)."""
        return max(self.used.values(), default=0)

    def sample(self, pids: Collection[int]) -> Overage | None:
        """One sample: update used/peak; the overage to act on, if any."""
        self.used = attribute(self.nvml.processes(), pids, self.proc)
        self.samples += 1
        worst = max(self.used.items(), key=lambda kv: kv[1], default=("", 0))
        self.peak_bytes = max(self.peak_bytes, worst[1])
        action = self.enforcer.observe(worst[1])
        if action is None or self.enforcer.budget is None:
            return None
        return Overage(self.slug, worst[0], worst[1], self.enforcer.budget, action)

    async def step(self) -> None:
        try:
            pids = frozenset(await self._pids())
            if pids != self._last_pids:
                if self._on_pids is not None:
                    self._on_pids(pids)
                self._last_pids = pids
            over = self.sample(pids)
        except Exception as e:  # NVML, the bus, the reservation file: the next step tries again
            if not self._failing:
                log.warning("Failed to sample VRAM of %s: %s, ignoring", self.slug, e)
                self._failing = True
            return
        self._failing = False
        if over is not None:
            if over.action == "stop":
                log.error("%s", over.message)
            else:
                log.warning("%s", over.message)
            await self._on_over(over)

    async def run(self) -> None:
        while True:
            await self.step()
            if self.enforcer.stopped:
                return
            await asyncio.sleep(self.interval_s)
