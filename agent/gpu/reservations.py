"""What each front holds on the GPU: its reservation under the runtime directory, and the
lock admissions take around reading NVML and writing one.

The reservation, `<runtime>/<slug>/gpu.json`, stays while the worker starts and runs and
is removed on release; admission (`agent.gpu.admission`) subtracts from NVML's free
memory what each reservation covers but NVML does not show yet (`need` less what its
worker PIDs use), so a worker that is still loading keeps its share.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import AsyncIterator, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.gpu.nvml import Card, GpuProcess, Nvml, pid_exists
from agent.gpu.placement import Placement, subtract_pending
from agent.gpu.procs import ProcReader, attribute
from agent.spec import paths
from agent.spec.files import write_atomic

RESERVATION = "gpu.json"
LOCK = "gpu.lock"


@dataclass(frozen=True)
class Reservation:
    """The content of `<runtime>/<slug>/gpu.json`."""

    slug: str
    cards: tuple[str, ...]  # UUIDs
    need_bytes: int  # per card, without headroom
    pids: tuple[int, ...] = ()  # the worker's processes, once known
    owner_pid: int = 0  # the front's PID; a reservation whose owner is gone is stale
    since: float = 0.0  # wall clock

    def to_json(self) -> str:
        return json.dumps(
            {
                "slug": self.slug,
                "cards": list(self.cards),
                "need_bytes": self.need_bytes,
                "pids": list(self.pids),
                "owner_pid": self.owner_pid,
                "since": self.since,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Reservation:
        d = json.loads(text)
        return cls(
            str(d["slug"]),
            tuple(str(u) for u in d["cards"]),
            int(d["need_bytes"]),
            tuple(int(p) for p in d.get("pids", ())),
            int(d.get("owner_pid", 0)),
            float(d.get("since", 0.0)),
        )


def _alive(pid: int) -> bool:
    return pid <= 0 or pid_exists(pid)  # an unknown owner (0): keep


def read_reservations(runtime_dir: Path | None = None) -> list[Reservation]:
    """Every live reservation under the runtime directory (stale ones are skipped)."""
    root = runtime_dir if runtime_dir is not None else paths.runtime_dir()
    out = []
    for f in sorted(root.glob(f"*/{RESERVATION}")):
        try:
            r = Reservation.from_json(f.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(r.owner_pid):
            out.append(r)
    return out


def pending_bytes(
    reservations: Sequence[Reservation], processes: Sequence[GpuProcess], proc: ProcReader
) -> dict[str, int]:
    """Per card UUID: memory reserved by workers that NVML does not show yet."""
    pending: dict[str, int] = {}
    for r in reservations:
        seen = attribute(processes, r.pids, proc) if r.pids else {}
        for uuid in r.cards:
            pending[uuid] = pending.get(uuid, 0) + max(0, r.need_bytes - seen.get(uuid, 0))
    return pending


def effective_cards(
    nvml: Nvml, slug: str, runtime_dir: Path, proc: ProcReader
) -> tuple[list[Card], list[GpuProcess]]:
    """The cards as NVML shows them, less what the other fronts' reservations still hold
    back (their workers' memory that NVML does not show yet); and NVML's processes."""
    cards = nvml.cards()
    procs = nvml.processes()
    others = [r for r in read_reservations(runtime_dir) if r.slug != slug]
    return subtract_pending(cards, pending_bytes(others, procs, proc)), procs


def _open_lock(runtime_dir: Path) -> int:
    runtime_dir.mkdir(parents=True, exist_ok=True)
    return os.open(runtime_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


@contextlib.contextmanager
def gpu_lock_now(runtime_dir: Path) -> Iterator[bool]:
    """The same lock, taken only if it is free at once: yields whether it was taken (False:
    another front is admitting; the caller leaves the admission to `gpu_lock`)."""
    fd = _open_lock(runtime_dir)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def gpu_lock(runtime_dir: Path, timeout_s: float) -> AsyncIterator[None]:
    """Exclusive across processes (flock on `<runtime>/gpu.lock`); polls, so the loop runs on."""
    import asyncio  # not at the top: admission before the event loop uses this module

    fd = _open_lock(runtime_dir)
    try:
        deadline = time.monotonic() + timeout_s
        # Polling is the only way here: the lock is another front's (another process),
        # Linux tells no one when a flock is let go, and a blocking flock would stop the
        # loop (or hold a thread that cannot be cancelled at the deadline).
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{runtime_dir / LOCK} stayed locked") from None
                await asyncio.sleep(0.01)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@dataclass
class Admitted:
    """A yes from admission: where to start, and the reservation that holds the memory."""

    slug: str
    placement: Placement
    need_bytes: int  # per card, without headroom
    retired: tuple[str, ...] = ()  # providers retired to make room
    freed_wait_s: float = 0.0  # how long NVML took to show their memory freed
    runtime_dir: Path = field(default_factory=paths.runtime_dir)
    _reservation: Reservation | None = None

    @property
    def file(self) -> Path:
        return self.runtime_dir / self.slug / RESERVATION

    def _write(self, pids: Collection[int]) -> None:
        self._reservation = Reservation(
            self.slug,
            self.placement.uuids,
            self.need_bytes,
            tuple(sorted(pids)),
            os.getpid(),
            time.time(),
        )
        write_atomic(self.file, self._reservation.to_json() + "\n")

    def set_pids(self, pids: Collection[int]) -> None:
        """Record the worker's PIDs (call when they change; `VramSampler(on_pids=…)` does)."""
        if self._reservation is not None:
            self._write(pids)

    def release(self) -> None:
        """The worker is gone: drop the reservation. Never blocks on the lock."""
        self._reservation = None
        self.file.unlink(missing_ok=True)
