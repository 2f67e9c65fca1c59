"""A provider's counters, kept across front restarts, for the metrics service.

Fronts come and go (an idle provider runs no process), but Prometheus counters must
not go back to zero at every idle release. So each front starts from what the last
one left in `<state>/counters/<slug>.json`, counts in memory, and writes the file
again when its worker starts or stops, at most every `FLUSH_S` while it serves, and
when it exits. A scrape reads a running front's counters over its control socket
(`status` carries them) and an idle provider's from the file: either way they only
grow. Only a front killed outright loses what it counted since its last write.

Pure data plus `load`/`save`; the front calls the `count_*` methods.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.spec import paths
from agent.spec.files import write_atomic

# Cold-start duration buckets (seconds): a model loads in well under a second or in minutes.
BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
REFUSAL_CAUSES = ("start_failed", "gpu_unavailable", "too_many_waiting")
FLUSH_S = 10.0


def counters_file(slug: str) -> Path:
    return paths.state_dir() / "counters" / f"{slug}.json"


@dataclass
class Counters:
    served: int = 0  # requests answered by the worker (leases ended)
    refused: dict[str, int] = field(default_factory=dict)  # cause -> requests refused
    cold_starts: int = 0  # worker starts that became ready
    start_failures: int = 0
    idle_releases: int = 0
    gpu_retirements: int = 0  # times this provider gave its card to another
    start_buckets: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))  # cumulative
    start_seconds_sum: float = 0.0
    dirty: bool = False

    def count_served(self) -> None:
        self.served += 1
        self.dirty = True

    def count_refused(self, cause: str) -> None:
        self.refused[cause] = self.refused.get(cause, 0) + 1
        self.dirty = True

    def count_start(self, seconds: float) -> None:
        self.cold_starts += 1
        self.start_seconds_sum += seconds
        for i, bound in enumerate(BUCKETS):
            if seconds <= bound:
                self.start_buckets[i] += 1
        self.dirty = True

    def count_start_failure(self) -> None:
        self.start_failures += 1
        self.dirty = True

    def count_idle_release(self) -> None:
        self.idle_releases += 1
        self.dirty = True

    def count_retirement(self) -> None:
        self.gpu_retirements += 1
        self.dirty = True

    def to_json(self) -> dict[str, Any]:
        return {
            "served": self.served,
            "refused": {
                c: self.refused.get(c, 0) for c in sorted({*REFUSAL_CAUSES, *self.refused})
            },
            "cold_starts": self.cold_starts,
            "start_failures": self.start_failures,
            "idle_releases": self.idle_releases,
            "gpu_retirements": self.gpu_retirements,
            "start_seconds": {
                "buckets": [[b, n] for b, n in zip(BUCKETS, self.start_buckets, strict=True)],
                "count": self.cold_starts,
                "sum": round(self.start_seconds_sum, 6),
            },
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Counters:
        """From `to_json()`; anything malformed counts as zero (never raises)."""

        def num(v: object) -> int:
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0

        refused = d.get("refused")
        starts = d.get("start_seconds")
        starts = starts if isinstance(starts, dict) else {}
        by_bound = {}
        for item in starts.get("buckets") or []:
            if isinstance(item, list) and len(item) == 2 and isinstance(item[0], (int, float)):
                by_bound[float(item[0])] = num(item[1])
        total = starts.get("sum")
        return cls(
            served=num(d.get("served")),
            refused={str(k): num(v) for k, v in refused.items()}
            if isinstance(refused, dict)
            else {},
            cold_starts=num(d.get("cold_starts")),
            start_failures=num(d.get("start_failures")),
            idle_releases=num(d.get("idle_releases")),
            gpu_retirements=num(d.get("gpu_retirements")),
            start_buckets=[by_bound.get(b, 0) for b in BUCKETS],
            start_seconds_sum=float(total)
            if isinstance(total, (int, float)) and total >= 0
            else 0.0,
        )


def read(slug: str) -> dict[str, Any] | None:
    """The persisted counters' JSON, or None when this provider never ran."""
    try:
        data = json.loads(counters_file(slug).read_text())
    except (OSError, ValueError):
        return None
    return Counters.from_json(data).to_json() if isinstance(data, dict) else None


def load(slug: str) -> Counters:
    """Where the last front of `slug` left off (zeros the first time)."""
    data = read(slug)
    return Counters.from_json(data) if data is not None else Counters()


def save(slug: str, counters: Counters, log: logging.Logger) -> None:
    """Persist if anything changed; a failure is logged, never raised into the front."""
    if not counters.dirty:
        return
    try:
        write_atomic(counters_file(slug), json.dumps(counters.to_json()) + "\n")
        counters.dirty = False
    except OSError as e:
        log.warning("Failed to save the counters to %s: %s, ignoring", counters_file(slug), e)


# -- the router's ------------------------------------------------------------------------

ROUTER_FILE = "router-counters.json"  # beside the providers' directory: no slug can take it
ROUTER_FLUSH_S = 5.0


def router_file() -> Path:
    return paths.state_dir() / ROUTER_FILE


@dataclass
class RouterCounters:
    """The router's requests by provider, model and answer status, across its restarts.

    Labels stay bounded whatever clients send: `model` is a declared exact name or ""
    (a name matched by a pattern, an unknown name, no name), `provider` a slug or "".
    """

    requests: dict[tuple[str, str, int], int] = field(default_factory=dict)
    dirty: bool = False

    def count(self, provider: str, model: str, status: int) -> None:
        k = (provider, model, status)
        self.requests[k] = self.requests.get(k, 0) + 1
        self.dirty = True

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {"provider": p, "model": m, "status": s, "requests": n}
            for (p, m, s), n in sorted(self.requests.items())
        ]

    @classmethod
    def from_json(cls, data: object) -> RouterCounters:
        out = cls()
        for item in data if isinstance(data, list) else []:
            if not isinstance(item, dict):
                continue
            p, m, s, n = (item.get(k) for k in ("provider", "model", "status", "requests"))
            if (
                isinstance(p, str)
                and isinstance(m, str)
                and isinstance(s, int)
                and isinstance(n, int)
                and not isinstance(n, bool)
                and 100 <= s <= 599
                and n >= 0
            ):
                out.requests[(p, m, s)] = n
        return out


def load_router() -> RouterCounters:
    try:
        return RouterCounters.from_json(json.loads(router_file().read_text()))
    except (OSError, ValueError):
        return RouterCounters()


def save_router(c: RouterCounters, log: logging.Logger) -> None:
    if not c.dirty:
        return
    try:
        write_atomic(router_file(), json.dumps(c.to_json()) + "\n")
        c.dirty = False
    except OSError as e:
        log.warning("Failed to save the router's counters to %s: %s, ignoring", router_file(), e)
