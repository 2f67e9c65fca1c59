"""Admission at once, before the front's event loop exists: the common case, decided in
the time of one NVML read.

`admit_now()` takes the GPU lock only if it is free, reads the cards less the other
fronts' reservations, and admits when the provider fits as things are (no provider to
retire). Everything else (the lock held by another front's admission, a fit that needs a
provider retired, a refusal) it leaves to `agent.gpu.admission.admit`, which waits,
retires and explains: it returns None then, having changed nothing. `reserve_if_fits` is
the step both take under the lock: the plan, and the reservation when it retires no one.
No asyncio here: this runs on the way to the worker's StartUnit, and so does nothing that
imports logging, `dataclasses`, `typing`, `pathlib` or the manifest's validation: it takes
the provider's GPU request as a `GpuRequest` (a manifest's `Provider`, or the generator's
record's `Request`).
"""

from __future__ import annotations

from agent.gpu.placement import DEFAULT_HEADROOM, Refusal, need_bytes, plan_admission
from agent.gpu.procs import ProcFs
from agent.gpu.reservations import Admitted, effective_cards, gpu_lock_now
from agent.spec import locations

TYPE_CHECKING = False  # not typing's: its import costs milliseconds (mypy reads this as it)
if TYPE_CHECKING:
    from collections.abc import Sequence

    from agent.gpu.footprint import Footprints
    from agent.gpu.nvml import Card, Nvml
    from agent.gpu.placement import GpuRequest, Holder, Plan
    from agent.gpu.procs import ProcReader
    from agent.gpu.reservations import Directory


def admit_now(
    provider: GpuRequest,
    nvml: Nvml,
    footprints: Footprints,
    *,
    headroom_bytes: int | None = None,
    runtime_dir: Directory | None = None,
    proc: ProcReader | None = None,
) -> Admitted | None:
    """Admitted (placement, reservation written) when `provider` fits at once; else None.
    NVML's errors (`NvmlUnavailable`) are raised, as by `admit`. `headroom_bytes` None:
    the default."""
    headroom = DEFAULT_HEADROOM if headroom_bytes is None else headroom_bytes
    rt = runtime_dir if runtime_dir is not None else locations.runtime_dir()
    need = need_bytes(provider, footprints.peak(provider.slug))
    with gpu_lock_now(rt) as taken:
        if not taken:
            return None
        cards, _procs = effective_cards(nvml, provider.slug, rt, proc or ProcFs())
        # No holders: a provider that fits as things are needs none; one that does not is
        # `admit`'s to plan, with every holder's status.
        outcome = reserve_if_fits(provider, need, cards, (), headroom, rt)
        return outcome if isinstance(outcome, Admitted) else None


def reserve_if_fits(
    provider: GpuRequest,
    need: int,
    cards: Sequence[Card],
    holders: Sequence[Holder],
    headroom: int,
    runtime_dir: Directory,
) -> Admitted | Plan | Refusal:
    """Under the GPU lock: the plan for `provider` on `cards`; when it retires no one, its
    reservation written and the `Admitted`; else the plan (its victims) or the refusal."""
    plan = plan_admission(provider, need, cards, holders, headroom)
    if isinstance(plan, Refusal) or plan.victims:
        return plan
    admitted = Admitted(provider.slug, plan.placement, need, runtime_dir=runtime_dir)
    admitted._write(())
    return admitted
