"""Preload at boot: the record of the boot-time load that `providerctl status` shows.

A provider with `[runtime] preload = true` has its front linked into
`multi-user.target.wants/` by the generator, so systemd starts it at boot, after
its socket (the front `Requires=` and is `After=` it). The front's first start
since boot is the preload: it is told apart from a later activation by the record
under /run (a tmpfs, empty at every boot), which the front writes once that start
has succeeded or failed, and which outlives the front's idle exit.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from agent.spec import paths
from agent.spec.files import write_atomic
from agent.spec.provider import Provider

CAUSE = "preload"


def activation_cause(provider: Provider) -> str:
    """Why the front starts the worker as it comes up: the preload, or an activation."""
    if provider.preload and not paths.preload_record(provider.slug).exists():
        return CAUSE
    return "activation"


def record(slug: str, last_start: dict[str, Any], log: logging.Logger) -> None:
    """Keep what the preload did (the front's `last_start`) until the next boot."""
    try:
        write_atomic(paths.preload_record(slug), json.dumps(last_start) + "\n")
    except OSError as e:
        log.warning("Failed to record the preload: %s, ignoring", e)


def read(slug: str) -> dict[str, Any] | None:
    """The record, or None when the provider was not preloaded since boot."""
    try:
        data = json.loads(paths.preload_record(slug).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return {k: data.get(k) for k in ("at", "took_s", "result")}
