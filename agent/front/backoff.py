"""The front's backoff after a failed start: how long, and kept from one activation to the next.

`Backoff` is the delay: 1 s, 2 s, 4 s … up to a cap, shared by every waiter, reset by a
start that succeeds.

A provider whose worker systemd starts beside the front (`Provider.starts_with_front`)
would otherwise try a broken model again on every activation, however often it failed:
the front is gone between activations, and its backoff with it. So the front writes
`<runtime>/<slug>.backoff` when a start fails (and the worker unit has
`ConditionPathExists=!` on it: no start with the next activation while it exists), and
removes it before it starts the worker itself, and when a start succeeds. The next front
reads it and goes on with the same backoff: refusing until it runs out, then one start.
A backoff belongs to the manifest it failed with: after an edit (and `providerctl
reload`) the next front starts afresh.

The time is CLOCK_MONOTONIC, which every namespace shares and which, like `/run`, does
not outlive a boot.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from agent.spec.files import write_atomic
from agent.spec.provider import Provider


class Backoff:
    """A growing delay after failures, shared by every waiter: 1 s, 2 s, 4 s … up to a cap."""

    def __init__(self, first_s: float = 1.0, cap_s: float = 60.0) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self.failures = 0  # consecutive failures
        self.until = 0.0  # time.monotonic() when the current backoff runs out
        self.last_s = 0.0  # the delay the last failure got

    def next_delay(self) -> float:
        """One more failure: the delay before the next try (and `until` moves to its end)."""
        delay = min(self.cap_s, self.first_s * float(2**self.failures))
        self.failures += 1
        self.until = time.monotonic() + delay
        self.last_s = delay
        return delay

    def left(self) -> float:
        """Seconds until the current backoff runs out (0 when it has)."""
        return max(0.0, self.until - time.monotonic())

    def resume(self, saved: Saved) -> float:
        """Go on from an earlier front's backoff; the seconds it still runs (0: over)."""
        self.failures = saved.failures
        self.until = saved.until
        return self.left()

    def reset(self) -> None:
        self.failures = 0
        self.until = 0.0


@dataclass(frozen=True)
class Saved:
    failures: int  # consecutive failed starts
    until: float  # time.monotonic() when the backoff runs out
    reason: str  # what the last failure was, for the 503s
    manifest: str  # manifest_key() of the provider that failed


def manifest_key(provider: Provider) -> str:
    """A fingerprint of the validated manifest (every field of `Provider`)."""
    return hashlib.sha256(repr(provider).encode()).hexdigest()[:16]


def load(path: Path, provider: Provider) -> Saved | None:
    """The saved backoff of this manifest, or None (none saved, unreadable, or saved for a
    manifest that has changed since: then it is not honoured)."""
    try:
        data = json.loads(path.read_text())
        saved = Saved(
            int(data["failures"]), float(data["until"]), str(data["reason"]), str(data["manifest"])
        )
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if saved.failures <= 0 or saved.manifest != manifest_key(provider):
        return None
    return saved


def save(path: Path, saved: Saved) -> None:
    data = {
        "failures": saved.failures,
        "until": saved.until,
        "reason": saved.reason,
        "manifest": saved.manifest,
    }
    write_atomic(path, json.dumps(data) + "\n")


def clear(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
