"""Which GPU memory is a worker's: its PIDs as the front sees them, matched to NVML's.

PID namespaces: NVML may report a process by its PID in another namespace than
the one the front sees. Each worker PID's `/proc/<pid>/status` `NSpid:` line gives
its PID in every namespace from the front's inwards; an NVML PID matches a worker
process if it is the front's view of it, or one of its inner-namespace PIDs that is
not itself a live process in the front's view (so memory is never attributed to the
wrong worker; a collision under-counts instead).

No asyncio here: admission before the front's event loop (`agent.gpu.quick`) reads it too,
and only `os` at import (no `typing` or `pathlib`: milliseconds each on that way).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # not typing's: its import costs milliseconds (mypy reads this as it)
if TYPE_CHECKING:
    from collections.abc import Collection, Iterable
    from pathlib import Path
    from typing import Protocol

    from agent.gpu.nvml import GpuProcess
else:
    Protocol = object  # ProcReader's method, for mypy; at run time a plain base

__all__ = ["ProcFs", "ProcReader", "attribute"]


class ProcReader(Protocol):
    def nspids(self, pid: int) -> tuple[int, ...] | None:
        """The `NSpid:` PIDs of `pid`, the reader's namespace first; None if no such process."""
        ...


class ProcFs:
    """`ProcReader` over a proc filesystem."""

    def __init__(self, root: Path | str = "/proc") -> None:
        self.root = root

    def nspids(self, pid: int) -> tuple[int, ...] | None:
        try:
            with open(os.path.join(self.root, str(pid), "status"), encoding="utf-8") as f:
                text = f.read()
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            return None
        except OSError:
            return (pid,)
        for line in text.splitlines():
            if line.startswith("NSpid:"):
                try:
                    return tuple(int(x) for x in line.split()[1:]) or (pid,)
                except ValueError:
                    break
        return (pid,)  # kernels before 4.1 have no NSpid line


def attribute(
    processes: Iterable[GpuProcess], pids: Collection[int], proc: ProcReader
) -> dict[str, int]:
    """Bytes used by the processes `pids` (the front's view), per card UUID."""
    direct = set(pids)
    inner: set[int] = set()
    for pid in direct:
        ns = proc.nspids(pid)
        if ns is not None:
            inner.update(ns[1:])
    inner -= direct
    used: dict[str, int] = {}
    for p in processes:
        ours = p.pid in direct or (p.pid in inner and proc.nspids(p.pid) is None)
        if ours:
            used[p.card_uuid] = used.get(p.card_uuid, 0) + p.used
    return used
