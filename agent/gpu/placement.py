"""GPU placement and admission planning. Pure: no I/O, no clock.

Given the cards as NVML shows them (less what starting workers have reserved),
the other providers that hold GPU memory, and what this provider needs, decide:
start now on these cards, retire these idle providers first, or refuse with who
holds the cards and why each was not retired.

Who may be retired (`retirable`): a provider with nothing in flight, not pinned,
whose `[gpu] priority` is not above the asking provider's. Lowest priority goes
first, least recently used first among equals.

Memory figures are per card: a provider with `count = 2` needs `need` bytes on
each of its two cards. `vram_budget_gb` is in GiB (2**30 bytes).

What a provider asks for is a `GpuRequest`: a validated manifest's `Provider`, or the
`Request` the front's early start reads from the generator's record, which places the
worker on the way to its StartUnit with this module: so nothing here imports
`dataclasses`, `typing` or the manifest's validation (milliseconds each there).
"""

from __future__ import annotations

from agent.gpu.frozen import Frozen
from agent.gpu.nvml import GIB, MIB, Card, format_bytes

TYPE_CHECKING = False  # not typing's: its import costs milliseconds (mypy reads this as it)
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any, Literal, Protocol

    Devices = Literal["auto", "none"] | tuple[int | str, ...]

    class GpuRequest(Protocol):
        """What placement reads of a provider: its `[gpu]` table."""

        @property
        def slug(self) -> str: ...
        @property
        def gpu_devices(self) -> Devices: ...
        @property
        def gpu_count(self) -> int: ...
        @property
        def vram_budget_gb(self) -> float | None: ...
        @property
        def gpu_priority(self) -> int: ...
        @property
        def uses_gpu(self) -> bool: ...


DEFAULT_HEADROOM = 1024 * MIB  # kept free on a card beyond a provider's need (providerd.toml)


class Request(Frozen):
    """A provider's GPU request without its manifest: as the generator's record carries
    it (`agent.systemd.early_record`), for the early start's placement."""

    __slots__ = ("gpu_count", "gpu_devices", "gpu_priority", "slug", "vram_budget_gb")
    slug: str
    gpu_devices: Devices
    gpu_count: int
    vram_budget_gb: float | None
    gpu_priority: int

    def __init__(
        self,
        slug: str,
        gpu_devices: Devices,
        gpu_count: int = 1,
        vram_budget_gb: float | None = None,
        gpu_priority: int = 0,
    ) -> None:
        super().__init__(
            slug=slug,
            gpu_devices=gpu_devices,
            gpu_count=gpu_count,
            vram_budget_gb=vram_budget_gb,
            gpu_priority=gpu_priority,
        )

    @property
    def uses_gpu(self) -> bool:
        return self.gpu_devices != "none"


class Holder(Frozen):
    """Another provider that holds (or is starting on) GPU memory."""

    __slots__ = ("busy", "gpus", "last_used", "pinned", "priority", "slug", "vram_bytes")
    slug: str
    gpus: tuple[str, ...]  # card UUIDs
    vram_bytes: int  # bytes it holds on each of those cards
    busy: int  # requests in flight; > 0 means it is never retired
    last_used: float  # when it last served a request; any clock, the same for all holders
    priority: int  # `[gpu] priority`: only a provider of equal or higher priority retires it
    pinned: bool  # `[runtime] pinned`: never retired

    def __init__(
        self,
        slug: str,
        gpus: tuple[str, ...],
        vram_bytes: int,
        busy: int,
        last_used: float,
        priority: int = 0,
        pinned: bool = False,
    ) -> None:
        super().__init__(
            slug=slug,
            gpus=gpus,
            vram_bytes=vram_bytes,
            busy=busy,
            last_used=last_used,
            priority=priority,
            pinned=pinned,
        )


class Placement(Frozen):
    """The card(s) a worker runs on; empty for `devices = "none"`."""

    __slots__ = ("cards",)
    cards: tuple[Card, ...]

    def __init__(self, cards: tuple[Card, ...] = ()) -> None:
        super().__init__(cards=cards)

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(c.uuid for c in self.cards)

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(c.index for c in self.cards)


class Plan(Frozen):
    """Admission says yes: retire `victims` (in order) first, then start on `placement`."""

    __slots__ = ("need_bytes", "placement", "victims")
    placement: Placement
    victims: tuple[str, ...]  # slugs, least recently used first; empty: start now
    need_bytes: int  # per card, headroom included

    def __init__(self, placement: Placement, victims: tuple[str, ...], need_bytes: int) -> None:
        super().__init__(placement=placement, victims=victims, need_bytes=need_bytes)


class Refusal(Frozen):
    """Admission says no, for now or (`permanent`) for good."""

    __slots__ = ("holders", "kept", "message", "permanent")
    message: str
    holders: tuple[tuple[str, int], ...]  # (slug, requests in flight) on the cards wanted
    permanent: bool  # waiting cannot help (no such card, card too small)
    kept: tuple[tuple[str, str], ...]  # (slug, why it was not retired), for those that say

    def __init__(
        self,
        message: str,
        holders: tuple[tuple[str, int], ...] = (),
        permanent: bool = False,
        kept: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message=message, holders=holders, permanent=permanent, kept=kept)

    def body(self) -> dict[str, Any]:
        """The JSON of the 503 for held requests: names and busy counts, no paths or addresses."""
        why = dict(self.kept)
        return {
            "error": "gpu_unavailable",
            "message": self.message,
            "holders": [
                {"slug": slug, "busy": busy > 0, "requests_in_flight": busy}
                | ({"kept": why[slug]} if slug in why else {})
                for slug, busy in self.holders
            ],
        }


Admission = Plan | Refusal


def budget_bytes(provider: GpuRequest) -> int | None:
    """The manifest's `vram_budget_gb` in bytes, or None."""
    if provider.vram_budget_gb is None:
        return None
    return round(provider.vram_budget_gb * GIB)


def need_bytes(provider: GpuRequest, measured_peak: int | None) -> int:
    """Per card: the larger of the declared budget and the largest measured footprint."""
    return max(budget_bytes(provider) or 0, measured_peak or 0)


def subtract_pending(cards: Sequence[Card], pending: Mapping[str, int]) -> list[Card]:
    """Cards with memory reserved by starting workers (not yet shown by NVML) taken off."""
    return [c.with_free(max(0, c.free - pending.get(c.uuid, 0))) for c in cards]


def device_allow(placement: Placement) -> list[tuple[str, str]]:
    """The worker's `DeviceAllow=` entries for its cards (send an empty list first to replace).

    Paths, not the `char-nvidia` class, which matches every card. `/dev/nvidia-uvm` is
    shared by all cards; the class `char-nvidia-uvm` is listed as well because its node
    may be created after the worker's cgroup is set up, and path rules for missing nodes
    are skipped. Empty for `devices = "none"`: with the unit's `DevicePolicy=closed` the
    worker sees no GPU.
    """
    if not placement.cards:
        return []
    rules = [("/dev/nvidiactl", "rw"), ("/dev/nvidia-uvm", "rw"), ("char-nvidia-uvm", "rw")]
    rules += [(f"/dev/nvidia{c.minor}", "rw") for c in placement.cards]
    return rules


def worker_env(placement: Placement) -> dict[str, str]:
    """The worker's GPU environment (written to worker.env before each start).

    `devices = "none"` gives `CUDA_VISIBLE_DEVICES=` (empty): CUDA then sees no device,
    also in foreground mode where no device rules apply.
    """
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(placement.uuids),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }


def _resolve(provider: GpuRequest, cards: Sequence[Card]) -> tuple[list[Card], int, bool] | Refusal:
    """Candidate cards, how many to take, and whether all candidates must be taken."""
    devices = provider.gpu_devices
    if devices == "auto":
        if provider.gpu_count > len(cards):
            return Refusal(
                f"{provider.slug} asks for {provider.gpu_count} GPUs but this host has {len(cards)}.",
                permanent=True,
            )
        return list(cards), provider.gpu_count, False
    assert devices != "none"
    pinned: list[Card] = []
    for want in devices:
        if isinstance(want, int):
            match = [c for c in cards if c.index == want]
        else:
            match = [c for c in cards if c.uuid.lower() == want.lower()]
        if not match:
            have = ", ".join(str(c.index) for c in cards) or "none"
            return Refusal(
                f"{provider.slug} is pinned to GPU {want}, which this host does not have (cards: {have}).",
                permanent=True,
            )
        if match[0] not in pinned:
            pinned.append(match[0])
    return pinned, len(pinned), True


def _choose(
    candidates: Sequence[Card], free: Mapping[str, int], need: int, k: int, take_all: bool
) -> tuple[Card, ...] | None:
    fitting = [c for c in candidates if free[c.uuid] >= need]
    if take_all:
        return tuple(candidates) if len(fitting) == len(candidates) else None
    if len(fitting) < k:
        return None
    fitting.sort(key=lambda c: (-free[c.uuid], c.index))
    return tuple(sorted(fitting[:k], key=lambda c: c.index))


def plan_admission(
    provider: GpuRequest,
    need: int,
    cards: Sequence[Card],
    holders: Sequence[Holder],
    headroom: int,
) -> Admission:
    """Decide where `provider` starts and whom to retire first.

    `need`: bytes per card (see `need_bytes`); `cards`: as NVML shows them, less pending
    reservations; `holders`: the other providers holding GPU memory. `devices = "auto"`
    takes the `count` cards with the most free memory that fit; pinned devices must all fit.
    """
    if not provider.uses_gpu:
        return Plan(Placement(), (), 0)
    want = need + headroom
    resolved = _resolve(provider, cards)
    if isinstance(resolved, Refusal):
        return resolved
    candidates, k, take_all = resolved
    big_enough = [c for c in candidates if c.total >= want]
    if len(big_enough) < (len(candidates) if take_all else k):
        largest = max((c.total for c in candidates), default=0)
        return Refusal(
            f"{provider.slug} needs {format_bytes(want)} of GPU memory per card "
            f"({format_bytes(need)} + {format_bytes(headroom)} headroom), "
            f"more than its card{'s' if k > 1 else ''} hold{'' if k > 1 else 's'} "
            f"({format_bytes(largest)}).",
            permanent=True,
        )

    free = {c.uuid: c.free for c in candidates}
    chosen = _choose(candidates, free, want, k, take_all)
    if chosen is not None:
        return Plan(Placement(chosen), (), want)

    wanted = {c.uuid for c in candidates}
    on_cards = [h for h in holders if wanted.intersection(h.gpus)]
    why = {h.slug: kept_because(provider, h) for h in on_cards}  # once per holder
    idle = sorted(
        (h for h in on_cards if why[h.slug] is None),
        key=lambda h: (h.priority, h.last_used, h.slug),
    )
    projected = dict(free)
    taken: list[Holder] = []
    for h in idle:
        taken.append(h)
        for g in h.gpus:
            if g in projected:
                projected[g] += h.vram_bytes
        chosen = _choose(candidates, projected, want, k, take_all)
        if chosen is not None:
            return Plan(Placement(chosen), _prune(taken, chosen, free, want), want)

    kept = tuple(
        (h.slug, reason)
        for h in sorted(on_cards, key=lambda h: h.slug)
        if (reason := why[h.slug]) is not None
    )
    return Refusal(
        _busy_message(provider, want, candidates, on_cards, why), _summary(on_cards), kept=kept
    )


def kept_because(provider: GpuRequest, holder: Holder) -> str | None:
    """Why `holder` may not be retired to make room for `provider`; None when it may."""
    if holder.busy:
        return f"busy, {holder.busy} in flight"
    if holder.pinned:
        return "pinned"
    if holder.priority > provider.gpu_priority:
        return f"priority {holder.priority}, above {provider.gpu_priority}"
    return None


def _prune(
    taken: Sequence[Holder], chosen: Sequence[Card], free: Mapping[str, int], want: int
) -> tuple[str, ...]:
    """The fewest victims that still make `chosen` fit, dropping the most recently used first."""
    uuids = {c.uuid for c in chosen}
    victims = [h for h in taken if uuids.intersection(h.gpus)]

    def fits(vs: Sequence[Holder]) -> bool:
        return all(free[u] + sum(h.vram_bytes for h in vs if u in h.gpus) >= want for u in uuids)

    for h in reversed(list(victims)):
        rest = [v for v in victims if v is not h]
        if fits(rest):
            victims = rest
    return tuple(h.slug for h in victims)


def _summary(holders: Sequence[Holder]) -> tuple[tuple[str, int], ...]:
    return tuple((h.slug, h.busy) for h in sorted(holders, key=lambda h: h.slug))


def _busy_message(
    provider: GpuRequest,
    want: int,
    candidates: Sequence[Card],
    holders: Sequence[Holder],
    why: Mapping[str, str | None],
) -> str:
    parts = []
    for c in candidates:
        on = [h for h in holders if c.uuid in h.gpus]
        who = ", ".join(f"{h.slug} ({why[h.slug] or 'idle'})" for h in on)
        parts.append(
            f"GPU {c.index} has {format_bytes(c.free)} free"
            + (f", held by {who}" if who else ", used by processes outside providerd")
        )
    return (
        f"Not enough GPU memory for {provider.slug}: it needs {format_bytes(want)} per card; "
        + "; ".join(parts)
        + "."
    )
