"""One provider's status as a typed record: the shape of `providerctl status --json`
(docs/status.md, version 1), built here and nowhere else.

A running front makes one with `running(...)` and answers it over its control socket as
JSON; `providerctl` reads that back with `from_json`, or makes `inactive(...)` when no
front answers, and adds what the manifest and systemd say (`with_manifest`). Pure.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

# `providerctl status --json` (docs/status.md): fields are only added within a version;
# a field removed or changed in meaning raises it.
STATUS_VERSION = 1

# Set by providerctl from the manifest; absent from the JSON for a provider without one.
_FROM_MANIFEST = ("listen", "description", "socket")


@dataclass(frozen=True)
class Memory:
    current: int | None = None  # bytes
    max: int | None = None


@dataclass(frozen=True)
class ProviderStatus:
    slug: str
    state: str  # front.state.State's value, or "inactive"
    in_flight: int = 0
    waiting: int = 0
    to_worker: int = 0
    served: int | None = None
    idle_for_s: float | None = None
    last_used: float | None = None
    last_start: dict[str, Any] | None = None  # at, took_s, result
    failure: str | None = None
    retry_after_s: float | None = None
    memory: Memory = field(default_factory=Memory)
    gpu: dict[str, Any] = field(default_factory=dict)  # the admission's own status
    pinned: bool = False
    counters: dict[str, Any] | None = None
    # Added by providerctl:
    front: str | None = None  # "running" or "inactive"
    preloaded: dict[str, Any] | None = None
    listen: list[str] | None = None
    description: str | None = None
    socket: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The documented object; the manifest's fields only where there is a manifest."""
        out = asdict(self)
        for name in _FROM_MANIFEST:
            if out[name] is None:
                del out[name]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProviderStatus:
        """A record from a front's answer (fields it does not know are dropped)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        memory = values.get("memory") or {}
        values["memory"] = Memory(memory.get("current"), memory.get("max"))
        return cls(**values)

    def with_manifest(self, listen: list[str], description: str, socket: str) -> ProviderStatus:
        return replace(self, listen=listen, description=description, socket=socket)


def inactive(slug: str, pinned: bool, counters: dict[str, Any] | None) -> ProviderStatus:
    """A provider whose front does not run: what the manifest and the kept counters say."""
    return ProviderStatus(slug, "inactive", pinned=pinned, counters=counters, front="inactive")
