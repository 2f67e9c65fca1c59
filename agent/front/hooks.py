"""What a front asks before and after each worker start, and what those hooks may ask back.

`Admission` is the hook: the GPU's say on where (and whether) a worker may start
(`agent.front.gpu_hooks.GpuAdmission`); a CPU provider's front uses the base, which always
admits. `Host` is the little of the front a hook may use: its log, and a way to release
the worker (over its VRAM budget, say). The front and the GPU hooks both import this
module and not each other, so the hooks never need the front's class.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from agent.worker.control import DeviceRules


class Host(Protocol):
    """The front, as an admission hook sees it."""

    @property
    def log(self) -> logging.Logger: ...

    def release_worker(self, reason: str) -> None:
        """Stop the worker now; the next request starts it again."""
        ...


class Admission:
    """Decides where (and whether) a worker may start: the GPU's say. CPU providers: always."""

    async def admit(self, host: Host) -> tuple[dict[str, str], DeviceRules | None]:
        """Environment for the worker and its device rules (None: leave them alone)."""
        return {}, None

    async def started(self, host: Host) -> None:
        """The worker answers: start watching it."""

    async def released(self, host: Host) -> None:
        """The worker is gone: give back what admission reserved."""

    def status(self, host: Host) -> dict[str, Any]:
        return {}
