"""A provider's counters, kept across front restarts, for the metrics service.

Fronts come and go (an idle provider runs no process), but Prometheus counters must
not go back to zero at every idle release, nor when a front is killed outright. So
every count goes to two places:

- the live file `<runtime>/<slug>.counters` (`agent.net.counterfile`: mapped into
  memory, so each increment is in the page cache at once, with no system call):
  a front killed with SIGKILL loses nothing;
- `<state>/counters/<slug>.json`, written within `FLUSH_S` of the worker's start (the held
  requests go first), when it stops, at most every `FLUSH_S` while the front serves, and
  when it exits: it carries the counters across a reboot, which empties /run.

Each front starts from the larger of the two, value by value, and makes a fresh live
file from that. A scrape reads a running front's counters over its control socket
(`status` carries them) and an idle provider's from the files, the same way: either
way they only grow. The router's counters work alike (`router-counters`).

Pure data plus `load`/`save`; the front calls the `count_*` methods.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

from agent.net.counterfile import CounterFile
from agent.net.counterfile import read as read_live
from agent.spec import paths
from agent.spec.files import write_atomic

# Cold-start duration buckets (seconds): a model loads in well under a second or in minutes.
BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
REFUSAL_CAUSES = (
    "start_failed",
    "gpu_unavailable",
    "too_many_waiting",
    "unauthorized",
    "forbidden",
)
FLUSH_S = 10.0


def counters_file(slug: str) -> Path:
    return paths.state_dir() / "counters" / f"{slug}.json"


def live_file(slug: str) -> Path:
    """Beside, not in, the provider's runtime directory, which goes with the front."""
    return paths.runtime_dir() / f"{slug}.counters"


class _Kept:
    """What a set of counters needs to be kept: its live file's names and values (which
    load, merge and save go through alike) and its saved JSON."""

    dirty: bool
    live: CounterFile | None

    def to_live(self) -> dict[str, int]:
        raise NotImplementedError

    @classmethod
    def from_live(cls, values: dict[str, int]) -> Self:
        raise NotImplementedError

    def to_json(self) -> Any:
        raise NotImplementedError

    @classmethod
    def from_saved(cls, data: object) -> Self | None:
        """From a saved JSON document; None when it is not one of these."""
        raise NotImplementedError

    def merged(self, other: Self) -> Self:
        """The larger of the two, value by value (two snapshots of counters that only grow)."""
        mine, theirs = self.to_live(), other.to_live()
        return self.from_live(
            {k: max(mine.get(k, 0), theirs.get(k, 0)) for k in mine.keys() | theirs.keys()}
        )


K = TypeVar("K", bound=_Kept)


@dataclass
class Counters(_Kept):
    served: int = 0  # requests answered by the worker (leases ended)
    refused: dict[str, int] = field(default_factory=dict)  # cause -> requests refused
    cold_starts: int = 0  # worker starts that became ready
    start_failures: int = 0
    idle_releases: int = 0
    gpu_retirements: int = 0  # times this provider gave its card to another
    start_buckets: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))  # cumulative
    start_seconds_sum: float = 0.0
    dirty: bool = False
    live: CounterFile | None = field(default=None, repr=False, compare=False)

    def _add(self, name: str, n: int = 1) -> None:
        self.dirty = True
        if self.live is not None:
            self.live.add(name, n)

    def count_served(self) -> None:
        self.served += 1
        self._add("served")

    def count_refused(self, cause: str) -> None:
        self.refused[cause] = self.refused.get(cause, 0) + 1
        self._add(f"refused.{cause}")

    def count_start(self, seconds: float) -> None:
        self.cold_starts += 1
        self.start_seconds_sum += seconds
        self._add("cold_starts")
        self._add("start_us", max(0, round(seconds * 1e6)))
        for i, bound in enumerate(BUCKETS):
            if seconds <= bound:
                self.start_buckets[i] += 1
                self._add(f"start_bucket.{bound:g}")

    def count_start_failure(self) -> None:
        self.start_failures += 1
        self._add("start_failures")

    def count_idle_release(self) -> None:
        self.idle_releases += 1
        self._add("idle_releases")

    def count_retirement(self) -> None:
        self.gpu_retirements += 1
        self._add("gpu_retirements")

    def to_live(self) -> dict[str, int]:
        """The live file's names and values for these counters."""
        out = {
            "served": self.served,
            "cold_starts": self.cold_starts,
            "start_failures": self.start_failures,
            "idle_releases": self.idle_releases,
            "gpu_retirements": self.gpu_retirements,
            "start_us": round(self.start_seconds_sum * 1e6),
        }
        out.update((f"refused.{c}", n) for c, n in self.refused.items())
        out.update(
            (f"start_bucket.{b:g}", n) for b, n in zip(BUCKETS, self.start_buckets, strict=True)
        )
        return out

    @classmethod
    def from_live(cls, values: dict[str, int]) -> Counters:
        return cls(
            served=values.get("served", 0),
            refused={k[8:]: v for k, v in values.items() if k.startswith("refused.")},
            cold_starts=values.get("cold_starts", 0),
            start_failures=values.get("start_failures", 0),
            idle_releases=values.get("idle_releases", 0),
            gpu_retirements=values.get("gpu_retirements", 0),
            start_buckets=[values.get(f"start_bucket.{b:g}", 0) for b in BUCKETS],
            start_seconds_sum=values.get("start_us", 0) / 1e6,
        )

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
    def from_saved(cls, data: object) -> Counters | None:
        return cls.from_json(data) if isinstance(data, dict) else None

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


def _found(kind: type[K], file: Path, live_path: Path) -> K | None:
    """What the last writer left: the saved JSON in `file` and the live file at
    `live_path`, the larger of each value; None when neither holds any."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        data = None
    saved = kind.from_saved(data)
    values = read_live(live_path)
    if values is None:
        return saved
    live = kind.from_live(values)
    return live if saved is None else live.merged(saved)


def _load(kind: type[K], file: Path, live_path: Path, log: logging.Logger | None) -> K:
    """Where the last writer left off (zeros the first time). With `log` (the writer
    itself), counting goes on in a fresh live file; failing that, only in memory."""
    found = _found(kind, file, live_path) or kind()
    if log is not None:
        try:
            found.live = CounterFile(live_path, found.to_live())
        except OSError as e:
            log.warning(
                "Failed to create %s: %s; counters survive only a clean exit",
                live_path,
                e.strerror or e,
            )
    return found


def _save(counters: _Kept, file: Path, log: logging.Logger) -> None:
    """Persist if anything changed; a failure is logged, never raised into the writer."""
    if not counters.dirty:
        return
    try:
        write_atomic(file, json.dumps(counters.to_json()) + "\n")
        counters.dirty = False
    except OSError as e:
        log.warning("Failed to save the counters to %s: %s, ignoring", file, e)


def read(slug: str) -> dict[str, Any] | None:
    """The counters the last front of `slug` left (its live file and its saved JSON,
    the larger of each), or None when this provider never ran."""
    found = _found(Counters, counters_file(slug), live_file(slug))
    return found.to_json() if found is not None else None


def load(slug: str, log: logging.Logger | None = None) -> Counters:
    """Where the last front of `slug` left off (zeros the first time). With `log` (a
    front), counting goes on in a fresh live file; failing that, only in memory."""
    return _load(Counters, counters_file(slug), live_file(slug), log)


def save(slug: str, counters: Counters, log: logging.Logger) -> None:
    """Persist if anything changed; a failure is logged, never raised into the front."""
    _save(counters, counters_file(slug), log)


# -- the router's ------------------------------------------------------------------------

ROUTER_FILE = "router-counters.json"  # beside the providers' directory: no slug can take it
ROUTER_LIVE = "router-counters"  # no slug has a "-"
ROUTER_FLUSH_S = 5.0


def router_file() -> Path:
    return paths.state_dir() / ROUTER_FILE


def router_live_file() -> Path:
    return paths.runtime_dir() / ROUTER_LIVE


def _router_key(provider: str, model: str, status: int) -> str:
    return json.dumps([provider, model, status])


@dataclass
class RouterCounters(_Kept):
    """The router's requests by provider, model and answer status, across its restarts.

    Labels stay bounded whatever clients send: `model` is a declared exact name or ""
    (a name matched by a pattern, an unknown name, no name), `provider` a slug or "".
    """

    requests: dict[tuple[str, str, int], int] = field(default_factory=dict)
    dirty: bool = False
    live: CounterFile | None = field(default=None, repr=False, compare=False)
    # Each label set's slot in the live file, found once (the labels are bounded).
    _slots: dict[tuple[str, str, int], int] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def count(self, provider: str, model: str, status: int) -> None:
        """One answer: in memory, and in the live file at once, at the slot found the
        first time (`live` is made at load, for good; a slot stays as the file grows)."""
        k = (provider, model, status)
        requests = self.requests
        requests[k] = requests.get(k, 0) + 1
        self.dirty = True
        live = self.live
        if live is not None:
            slot = self._slots.get(k)
            if slot is None:
                slot = self._slots[k] = live.slot(_router_key(*k))
            live.words[slot] += 1

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {"provider": p, "model": m, "status": s, "requests": n}
            for (p, m, s), n in sorted(self.requests.items())
        ]

    def to_live(self) -> dict[str, int]:
        return {_router_key(*k): n for k, n in self.requests.items()}

    @classmethod
    def from_live(cls, values: dict[str, int]) -> RouterCounters:
        items = []
        for name, n in values.items():
            try:
                p, m, s = json.loads(name)
            except (ValueError, TypeError):
                continue
            items.append({"provider": p, "model": m, "status": s, "requests": n})
        return cls.from_json(items)

    @classmethod
    def from_saved(cls, data: object) -> RouterCounters | None:
        return cls.from_json(data) if isinstance(data, list) else None

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


def load_router(log: logging.Logger | None = None) -> RouterCounters:
    """Where the last router left off: its live file and its saved JSON, the larger of
    each. With `log` (the router itself), counting goes on in a fresh live file."""
    return _load(RouterCounters, router_file(), router_live_file(), log)


def save_router(c: RouterCounters, log: logging.Logger) -> None:
    _save(c, router_file(), log)
