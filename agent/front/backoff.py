"""The front's backoff after a failed start, kept from one activation to the next.

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
from dataclasses import dataclass
from pathlib import Path

from agent.spec.files import write_atomic
from agent.spec.provider import Provider


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
