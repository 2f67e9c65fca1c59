"""What each front holds on the GPU: its reservation under the runtime directory, and the
lock admissions take around reading NVML and writing one.

The reservation, `<runtime>/<slug>/gpu.json`, stays while the worker starts and runs and
is removed on release; admission (`agent.gpu.admission`) subtracts from NVML's free
memory what each reservation covers but NVML does not show yet (`need` less what its
worker PIDs use), so a worker that is still loading keeps its share.

The front's early start admits with this module on the way to its worker's StartUnit
(`agent.gpu.quick`): only `os`, `fcntl` and `time` at import, `json` once a reservation is
read or written (no `dataclasses`, `contextlib`, `typing` or `pathlib`: milliseconds each
there). Directories are strings or `Path`s.
"""

from __future__ import annotations

import fcntl
import os
import time

from agent.atomic import write_atomic
from agent.gpu.frozen import Frozen
from agent.gpu.nvml import pid_exists
from agent.gpu.placement import subtract_pending
from agent.gpu.procs import attribute
from agent.spec import locations

TYPE_CHECKING = False  # not typing's: its import costs milliseconds (mypy reads this as it)
if TYPE_CHECKING:
    from collections.abc import Collection, Sequence
    from os import PathLike
    from types import TracebackType

    from agent.gpu.nvml import Card, GpuProcess, Nvml
    from agent.gpu.placement import Placement
    from agent.gpu.procs import ProcReader

    Directory = str | PathLike[str]

RESERVATION = "gpu.json"
LOCK = "gpu.lock"


class Reservation(Frozen):
    """The content of `<runtime>/<slug>/gpu.json`."""

    __slots__ = ("cards", "need_bytes", "owner_pid", "pids", "since", "slug")
    slug: str
    cards: tuple[str, ...]  # UUIDs
    need_bytes: int  # per card, without headroom
    pids: tuple[int, ...]  # the worker's processes, once known
    owner_pid: int  # the front's PID; a reservation whose owner is gone is stale
    since: float  # wall clock

    def __init__(
        self,
        slug: str,
        cards: tuple[str, ...],
        need_bytes: int,
        pids: tuple[int, ...] = (),
        owner_pid: int = 0,
        since: float = 0.0,
    ) -> None:
        super().__init__(
            slug=slug,
            cards=cards,
            need_bytes=need_bytes,
            pids=pids,
            owner_pid=owner_pid,
            since=since,
        )

    def to_json(self) -> str:
        import json

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
        import json

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


def read_reservations(runtime_dir: Directory | None = None) -> list[Reservation]:
    """Every live reservation under the runtime directory (stale ones are skipped)."""
    root = os.fspath(runtime_dir) if runtime_dir is not None else locations.runtime_dir()
    try:
        names = sorted(n for n in os.listdir(root) if not n.startswith("."))
    except OSError:
        names = []
    out = []
    for name in names:
        try:
            with open(os.path.join(root, name, RESERVATION), encoding="utf-8") as f:
                r = Reservation.from_json(f.read())
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
    nvml: Nvml, slug: str, runtime_dir: Directory, proc: ProcReader
) -> tuple[list[Card], list[GpuProcess]]:
    """The cards as NVML shows them, less what the other fronts' reservations still hold
    back (their workers' memory that NVML does not show yet); and NVML's processes."""
    cards = nvml.cards()
    procs = nvml.processes()
    others = [r for r in read_reservations(runtime_dir) if r.slug != slug]
    return subtract_pending(cards, pending_bytes(others, procs, proc)), procs


def _open_lock(runtime_dir: Directory) -> int:
    os.makedirs(runtime_dir, exist_ok=True)
    path = os.path.join(runtime_dir, LOCK)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


class _Lock:
    """The open lock file, unlocked and closed on the way out."""

    def __init__(self, runtime_dir: Directory) -> None:
        self.runtime_dir = runtime_dir
        self.fd = -1
        self.locked = False

    def _try(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.locked = True
        return True

    def _leave(self) -> None:
        try:
            if self.locked:
                self.locked = False
                fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)


class gpu_lock_now(_Lock):  # used as a function: `with gpu_lock_now(rt) as taken`
    """The same lock, taken only if it is free at once: gives whether it was taken (False:
    another front is admitting; the caller leaves the admission to `gpu_lock`)."""

    def __enter__(self) -> bool:
        self.fd = _open_lock(self.runtime_dir)
        try:
            return self._try()
        except BaseException:
            self._leave()
            raise

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._leave()


class gpu_lock(_Lock):  # used as a function: `async with gpu_lock(rt, timeout_s)`
    """Exclusive across processes (flock on `<runtime>/gpu.lock`); polls, so the loop runs on."""

    def __init__(self, runtime_dir: Directory, timeout_s: float) -> None:
        super().__init__(runtime_dir)
        self.timeout_s = timeout_s

    async def __aenter__(self) -> None:
        import asyncio  # not at the top: admission before the event loop uses this module

        self.fd = _open_lock(self.runtime_dir)
        try:
            deadline = time.monotonic() + self.timeout_s
            # Polling is the only way here: the lock is another front's (another process),
            # Linux tells no one when a flock is let go, and a blocking flock would stop the
            # loop (or hold a thread that cannot be cancelled at the deadline).
            while not self._try():
                if time.monotonic() >= deadline:
                    where = os.path.join(self.runtime_dir, LOCK)
                    raise TimeoutError(f"{where} stayed locked")
                await asyncio.sleep(0.01)
        except BaseException:
            self._leave()
            raise

    async def __aexit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._leave()


class Admitted:
    """A yes from admission: where to start, and the reservation that holds the memory."""

    __slots__ = (
        "_reservation",
        "freed_wait_s",
        "need_bytes",
        "placement",
        "retired",
        "runtime_dir",
        "slug",
    )

    def __init__(
        self,
        slug: str,
        placement: Placement,
        need_bytes: int,  # per card, without headroom
        retired: tuple[str, ...] = (),  # providers retired to make room
        freed_wait_s: float = 0.0,  # how long NVML took to show their memory freed
        runtime_dir: Directory | None = None,
    ) -> None:
        self.slug, self.placement, self.need_bytes = slug, placement, need_bytes
        self.retired, self.freed_wait_s = retired, freed_wait_s
        self.runtime_dir = runtime_dir if runtime_dir is not None else locations.runtime_dir()
        self._reservation: Reservation | None = None

    def __repr__(self) -> str:
        return (
            f"Admitted(slug={self.slug!r}, placement={self.placement!r}, "
            f"need_bytes={self.need_bytes!r}, retired={self.retired!r})"
        )

    @property
    def file(self) -> str:
        return os.path.join(self.runtime_dir, self.slug, RESERVATION)

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
        import contextlib

        self._reservation = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.file)
