"""The front's GPU admission: the `Admission` a GPU provider's front uses.

Before each worker start: admit (`agent.gpu.admission.admit`, retiring idle providers
over their control sockets), hand the worker its `CUDA_VISIBLE_DEVICES` and device
rules, and start sampling its VRAM. When the worker is gone: store the measured
peak as the footprint and drop the reservation. (`cards_status()`, for
`providerctl status`, lives in `agent.gpu.admission`, which does not import the front.)

The hook sees the front only as an `agent.front.hooks.Host` (its log, and a way to
release the worker): the front imports this module, never the other way round.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from agent.front.hooks import Admission, Host
from agent.gpu.admission import (
    AdmissionRefused,
    ControlPeers,
    Peers,
    admit,
    cards_status,
)
from agent.gpu.footprint import Footprints
from agent.gpu.nvml import Nvml, NvmlUnavailable, open_nvml
from agent.gpu.placement import DEFAULT_HEADROOM, Refusal, budget_bytes, device_allow, worker_env
from agent.gpu.reservations import Admitted
from agent.gpu.vram import Overage, VramSampler
from agent.spec import paths
from agent.spec.provider import Provider
from agent.worker.control import DeviceRules, StartFailed, WorkerControl

log = logging.getLogger(__name__)

__all__ = ["ControlPeers", "GpuAdmission", "GpuRefused", "cards_status"]


class GpuRefused(StartFailed):
    """Admission could not fit the provider; `body()` is the JSON for the 503."""

    code = "gpu_unavailable"  # as Refusal.body()'s "error"

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal

    def body(self) -> dict[str, Any]:
        return self.refusal.body()


class GpuAdmission(Admission):
    def __init__(
        self,
        provider: Provider,
        worker: WorkerControl,
        *,
        nvml: Nvml | None = None,
        peers: Peers | None = None,
        footprints: Footprints | None = None,
        headroom_bytes: int | None = None,  # None: DEFAULT_HEADROOM
        runtime_dir: Path | None = None,
        interval_s: float = 0.2,
        admitted: Admitted | None = None,
    ) -> None:
        self.provider = provider
        self.worker = worker
        self._nvml = nvml
        self.runtime_dir = runtime_dir if runtime_dir is not None else paths.runtime_dir()
        self.peers: Peers = peers or ControlPeers(provider.slug, self.runtime_dir)
        self.footprints = footprints or Footprints()
        self.headroom_bytes = DEFAULT_HEADROOM if headroom_bytes is None else headroom_bytes
        self.interval_s = interval_s
        self.admitted: Admitted | None = None
        # Admitted before the front's start (agent.front.early): the first admit() takes it.
        self._early: Admitted | None = admitted
        self.sampler: VramSampler | None = None
        self._task: asyncio.Task[None] | None = None
        self.last_overage: Overage | None = None

    def nvml(self) -> Nvml:
        if self._nvml is None:
            self._nvml = open_nvml()
        return self._nvml

    async def admit(self, host: Host) -> tuple[dict[str, str], DeviceRules | None]:
        early, self._early = self._early, None
        try:
            nvml = self.nvml()
            self.admitted = early or await admit(
                self.provider,
                nvml,
                self.peers,
                self.footprints,
                timeout_s=self.provider.start_timeout_s,
                headroom_bytes=self.headroom_bytes,
                runtime_dir=self.runtime_dir,
            )
        except NvmlUnavailable as e:
            raise StartFailed(str(e)) from None
        except AdmissionRefused as e:
            raise GpuRefused(e.refusal) from None
        a = self.admitted
        if a.retired:
            host.log.info(
                "Retired %s to make room on the GPU; NVML showed the memory free after %.2f s",
                ", ".join(a.retired),
                a.freed_wait_s,
            )
        host.log.info(
            "Placed on GPU %s (%s)",
            ",".join(str(i) for i in a.placement.indices),
            ",".join(a.placement.uuids),
        )
        self._start_sampler(host, nvml, a)
        return worker_env(a.placement), device_allow(a.placement)

    def _start_sampler(self, host: Host, nvml: Nvml, admitted: Admitted) -> None:
        async def over(o: Overage) -> None:
            self.last_overage = o
            if o.action == "stop":
                host.release_worker(o.message)

        self.sampler = VramSampler(
            nvml,
            self.provider.slug,
            self.worker.pids,
            budget_bytes=budget_bytes(self.provider),
            enforce=self.provider.enforce,
            on_over=over,
            on_pids=admitted.set_pids,
            interval_s=self.interval_s,
        )
        self._task = asyncio.get_running_loop().create_task(self.sampler.run())

    async def started(self, host: Host) -> None:
        # The sampler runs from admission on, so loading is measured too. One more
        # sample now puts the ready worker's PIDs in its reservation at once: until
        # they are there, another admission counts this worker's memory twice (in
        # NVML and as still to come) and would retire a provider for nothing.
        # step() never raises: a failed sample is logged and the loop tries again.
        if self.sampler is not None:
            await self.sampler.step()

    async def released(self, host: Host) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception as e:  # never in the way of the release
                host.log.error("Failed to sample VRAM: %s", e)
            self._task = None
        if self.sampler is not None and self.sampler.peak_bytes > 0:
            try:
                self.footprints.record(self.provider.slug, self.sampler.peak_bytes)
            except OSError as e:
                host.log.warning("Failed to store the VRAM footprint: %s, ignoring", e)
        if self.admitted is not None:
            self.admitted.release()
            self.admitted = None

    def status(self, host: Host) -> dict[str, Any]:
        stored = self.footprints.peak(self.provider.slug)
        current = self.sampler.peak_bytes if self.sampler is not None else 0
        a = self.admitted
        return {
            "uuids": list(a.placement.uuids) if a else [],
            "indices": list(a.placement.indices) if a else [],
            "used_bytes": self.sampler.used_bytes if (a and self.sampler) else None,
            "need_bytes": a.need_bytes if a else None,
            "budget_bytes": budget_bytes(self.provider),
            "peak_bytes": max(stored or 0, current) or None,
            "enforce": self.provider.enforce,
            "priority": self.provider.gpu_priority,
        }
