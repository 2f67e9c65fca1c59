"""NVML behind one small interface.

Everything providerd asks of the GPUs goes through `Nvml`: the cards (index, UUID,
name, memory) and the compute processes on them with their memory. `RealNvml`
talks to the driver through `pynvml` (a system copy first, else the one vendored
in `agent._vendor`); `FakeNvml` models cards, processes, and the delay before the
memory of an exited process shows as free, for hosts without a GPU.

`open_nvml()` is what the rest of providerd calls. It returns a `DirNvml` instead
when `PROVIDERD_NVML_FAKE` names a directory (see docs/gpu.md), so foreground tests
with real worker processes can exercise admission and enforcement without a GPU.

CPU providers never call any of this; for GPU providers a host without a usable
driver gives `NvmlUnavailable("NVML is unavailable: <why>")`.

The front's early start reads the cards with this module on the way to its worker's
StartUnit (`agent.front.early`): only `os`, `time` and `agent.errors` at import (no
`dataclasses`, `typing`, `pathlib` or `json`: milliseconds each there).
"""

from __future__ import annotations

import os
import time

from agent.errors import ProviderdError
from agent.gpu.frozen import Frozen

TYPE_CHECKING = False  # not typing's: its import costs milliseconds (mypy reads this as it)
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path
    from types import ModuleType
    from typing import Any, Protocol
else:
    Protocol = object  # Nvml's methods, for mypy; at run time a plain base

GIB = 1 << 30
MIB = 1 << 20

FAKE_ENV = "PROVIDERD_NVML_FAKE"


class NvmlUnavailable(ProviderdError, RuntimeError):
    """NVML cannot be used on this host; the message says why."""

    code = "nvml_unavailable"

    def __init__(self, why: str) -> None:
        super().__init__(f"NVML is unavailable: {why}")
        self.why = why


class Card(Frozen):
    """One GPU as NVML reports it. Memory in bytes."""

    __slots__ = ("bus_id", "free", "index", "minor", "name", "total", "uuid")
    index: int  # NVML index (PCI bus order)
    uuid: str  # "GPU-…"; what CUDA_VISIBLE_DEVICES names
    name: str
    total: int
    free: int
    minor: int  # N of /dev/nvidiaN
    bus_id: str  # PCI bus id, e.g. "00000000:1B:00.0"

    def __init__(
        self, index: int, uuid: str, name: str, total: int, free: int, minor: int, bus_id: str = ""
    ) -> None:
        super().__init__(
            index=index, uuid=uuid, name=name, total=total, free=free, minor=minor, bus_id=bus_id
        )

    @property
    def used(self) -> int:
        return self.total - self.free

    def with_free(self, free: int) -> Card:
        """The same card with `free` bytes free."""
        return Card(self.index, self.uuid, self.name, self.total, free, self.minor, self.bus_id)


class GpuProcess(Frozen):
    """One compute process on one card, as NVML reports it."""

    __slots__ = ("card_uuid", "pid", "used")
    pid: int  # as NVML reports it (which PID namespace: see agent.gpu.vram)
    card_uuid: str
    used: int  # bytes; 0 when NVML cannot tell

    def __init__(self, pid: int, card_uuid: str, used: int) -> None:
        super().__init__(pid=pid, card_uuid=card_uuid, used=used)


class Nvml(Protocol):
    def cards(self) -> list[Card]: ...

    def processes(self) -> list[GpuProcess]: ...

    def close(self) -> None: ...


def format_bytes(n: int) -> str:
    """Bytes for people: GiB with one decimal, MiB below one GiB."""
    from agent.spec.sizes import HUMAN_MEBI, approx_size  # re, fractions: only for messages

    return approx_size(n, HUMAN_MEBI)


# --- the real thing -------------------------------------------------------------

# NVML return codes (nvml.h); pynvml exposes the same names.
_ERR_NO_PERMISSION = 4
_ERR_DRIVER_NOT_LOADED = 9
_ERR_LIBRARY_NOT_FOUND = 12
_ERR_NOT_SUPPORTED = 3

_WHY = {
    _ERR_LIBRARY_NOT_FOUND: "libnvidia-ml.so.1 was not found; install the NVIDIA driver",
    _ERR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded (is there an NVIDIA GPU?)",
    _ERR_NO_PERMISSION: "permission denied opening the NVIDIA devices",
}


def load_pynvml() -> ModuleType:
    """The system `pynvml`, else the vendored copy; NvmlUnavailable if neither."""
    try:
        import pynvml

        return pynvml  # type: ignore[no-any-return,unused-ignore]
    except ImportError:
        pass
    try:
        from agent._vendor import pynvml as vendored  # type: ignore[attr-defined,unused-ignore]

        return vendored  # type: ignore[no-any-return,unused-ignore]
    except ImportError:
        raise NvmlUnavailable(
            "the pynvml module is not installed (install python3-pynvml or nvidia-ml-py)"
        ) from None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RealNvml:
    """NVML through pynvml. Construct once per process that needs it; `close()` at the end."""

    def __init__(self, module: ModuleType | None = None) -> None:
        self._nv = module if module is not None else load_pynvml()
        try:
            self._nv.nvmlInit()
        except self._nv.NVMLError as e:
            raise NvmlUnavailable(self._why(e)) from None
        except OSError as e:  # a broken library file
            raise NvmlUnavailable(f"loading libnvidia-ml.so.1 failed: {e}") from None
        self._open = True

    def _why(self, error: Exception) -> str:
        code = getattr(error, "value", None)
        return _WHY.get(code, str(error)) if isinstance(code, int) else str(error)

    def _handles(self) -> list[Any]:
        try:
            return [
                self._nv.nvmlDeviceGetHandleByIndex(i) for i in range(self._nv.nvmlDeviceGetCount())
            ]
        except self._nv.NVMLError as e:
            raise NvmlUnavailable(f"listing the GPUs failed: {self._why(e)}") from None

    def cards(self) -> list[Card]:
        nv = self._nv
        out = []
        for i, h in enumerate(self._handles()):
            try:
                uuid = _text(nv.nvmlDeviceGetUUID(h))
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                name = _text(nv.nvmlDeviceGetName(h))
            except nv.NVMLError as e:
                raise NvmlUnavailable(f"reading GPU {i} failed: {self._why(e)}") from None
            try:
                minor = int(nv.nvmlDeviceGetMinorNumber(h))
            except nv.NVMLError:
                minor = i
            try:
                bus_id = _text(nv.nvmlDeviceGetPciInfo(h).busId)
            except nv.NVMLError:
                bus_id = ""
            total = int(mem.total)
            out.append(Card(i, uuid, name, total, int(mem.free), minor, bus_id))
        return out

    def processes(self) -> list[GpuProcess]:
        nv = self._nv
        out = []
        for i, h in enumerate(self._handles()):
            try:
                uuid = _text(nv.nvmlDeviceGetUUID(h))
                procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
            except nv.NVMLError as e:
                raise NvmlUnavailable(
                    f"listing the processes on GPU {i} failed: {self._why(e)}"
                ) from None
            for p in procs:
                used = p.usedGpuMemory
                out.append(GpuProcess(int(p.pid), uuid, int(used) if used is not None else 0))
        return out

    def close(self) -> None:
        if self._open:
            self._open = False
            import contextlib

            with contextlib.suppress(self._nv.NVMLError):
                self._nv.nvmlShutdown()


def pid_exists(pid: int) -> bool:
    """Whether a process exists, also one this process may not see in /proc or signal."""
    if pid <= 0:
        return False  # kill() would mean a process group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_nvml() -> Nvml:
    """The NVML providerd uses: `DirNvml` when PROVIDERD_NVML_FAKE is set, else `RealNvml`."""
    fake = os.environ.get(FAKE_ENV)
    if fake:
        return DirNvml(fake)
    return RealNvml()


# --- fakes ----------------------------------------------------------------------


class FakeCard(Frozen):
    __slots__ = ("bus_id", "index", "minor", "name", "reserved", "total", "uuid")
    index: int
    uuid: str
    total: int
    name: str
    minor: int | None  # defaults to the index
    reserved: int  # memory the driver keeps (never free)
    bus_id: str

    def __init__(
        self,
        index: int,
        uuid: str,
        total: int,
        name: str = "Fake GPU",
        minor: int | None = None,
        reserved: int = 0,
        bus_id: str = "",
    ) -> None:
        super().__init__(
            index=index,
            uuid=uuid,
            total=total,
            name=name,
            minor=minor,
            reserved=reserved,
            bus_id=bus_id,
        )


class FakeNvml:
    """Cards and processes in memory, with the delay before freed memory shows.

    `allocate(pid, uuid, nbytes)` sets a process's usage on a card; `exit(pid)`
    ends it: its memory and its entry stay visible for `release_delay_s` (the
    H200 showed 0.11 s), as NVML does. `clock` is injectable for tests.
    """

    def __init__(
        self,
        cards: Sequence[FakeCard],
        *,
        release_delay_s: float = 0.11,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cards = list(cards)
        self.release_delay_s = release_delay_s
        self._clock = clock
        self._usage: dict[tuple[int, str], int] = {}
        self._exited: dict[int, float] = {}
        self.failure: str | None = None
        self.calls = 0
        self.closed = False

    def allocate(self, pid: int, uuid: str, nbytes: int) -> None:
        if not any(c.uuid == uuid for c in self._cards):
            raise KeyError(uuid)
        self._usage[(pid, uuid)] = nbytes
        self._exited.pop(pid, None)

    def exit(self, pid: int) -> None:
        if any(p == pid for p, _ in self._usage):
            self._exited.setdefault(pid, self._clock())

    def fail(self, why: str | None) -> None:
        """Make every later call raise NvmlUnavailable(why); None heals."""
        self.failure = why

    def _live(self) -> dict[tuple[int, str], int]:
        now = self._clock()
        for pid, at in list(self._exited.items()):
            if now - at >= self.release_delay_s:
                del self._exited[pid]
                for key in [k for k in self._usage if k[0] == pid]:
                    del self._usage[key]
        return self._usage

    def _check(self) -> None:
        self.calls += 1
        if self.failure is not None:
            raise NvmlUnavailable(self.failure)

    def cards(self) -> list[Card]:
        self._check()
        usage = self._live()
        out = []
        for c in self._cards:
            used = c.reserved + sum(n for (_, u), n in usage.items() if u == c.uuid)
            minor = c.index if c.minor is None else c.minor
            free = max(0, c.total - used)
            out.append(Card(c.index, c.uuid, c.name, c.total, free, minor, c.bus_id))
        return out

    def processes(self) -> list[GpuProcess]:
        self._check()
        return [GpuProcess(pid, uuid, n) for (pid, uuid), n in sorted(self._live().items())]

    def close(self) -> None:
        self.closed = True


class DirNvml:
    """A fake NVML kept in a directory, shared by separate processes.

    `<dir>/cards.json`: `[{"uuid": "GPU-…", "total": bytes, "name": "…", "bus_id": "…"}, …]`
    (name and bus_id optional).
    A process "allocates" by writing `<dir>/procs/<pid>.json`:
    `{"uuid": "GPU-…", "bytes": n}` (write it atomically). Memory of a process that
    no longer exists shows as freed `release_delay_s` after this reader first
    notices, as on a real card.
    """

    def __init__(self, directory: Path | str, *, release_delay_s: float = 0.11) -> None:
        import json

        self.directory = directory
        self._dir = os.fspath(directory)
        self.release_delay_s = release_delay_s
        self._dead_since: dict[int, float] = {}
        try:
            raw = json.loads(_read(os.path.join(self._dir, "cards.json")))
            self._cards = [
                FakeCard(
                    i,
                    str(c["uuid"]),
                    int(c["total"]),
                    str(c.get("name", "Fake GPU")),
                    bus_id=str(c.get("bus_id", "")),
                )
                for i, c in enumerate(raw)
            ]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise NvmlUnavailable(f"the fake NVML in {directory} is unreadable: {e}") from None

    def _usage(self) -> list[GpuProcess]:
        out = []
        now = time.monotonic()
        procs = os.path.join(self._dir, "procs")
        try:
            names = sorted(n for n in os.listdir(procs) if n.endswith(".json") and n[0] != ".")
        except OSError:
            names = []
        for name in names:
            f = os.path.join(procs, name)
            try:
                import json

                pid = int(name[: -len(".json")])
                data = json.loads(_read(f))
                proc = GpuProcess(pid, str(data["uuid"]), int(data["bytes"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if not pid_exists(pid):
                since = self._dead_since.setdefault(pid, now)
                if now - since >= self.release_delay_s:
                    import contextlib

                    with contextlib.suppress(OSError):  # another user's file: just skip it
                        os.unlink(f)
                    continue
            out.append(proc)
        return out

    def cards(self) -> list[Card]:
        usage = self._usage()
        out = []
        for c in self._cards:
            used = sum(p.used for p in usage if p.card_uuid == c.uuid)
            free = max(0, c.total - used)
            out.append(Card(c.index, c.uuid, c.name, c.total, free, c.index, c.bus_id))
        return out

    def processes(self) -> list[GpuProcess]:
        return self._usage()

    def close(self) -> None:
        pass


def gpu_status(nvml: Nvml, reservations: Sequence[Any] = ()) -> list[dict[str, Any]]:
    """Card-level facts for `providerctl status`: one dict per card.

    `reservations` are `agent.gpu.reservations.Reservation`-like objects (`slug`,
    `cards`, `need_bytes`) read from the runtime directory; they say which
    provider holds or is starting on which card.
    """
    cards = nvml.cards()
    procs = nvml.processes()
    out = []
    for c in cards:
        out.append(
            {
                "index": c.index,
                "uuid": c.uuid,
                "name": c.name,
                "total_bytes": c.total,
                "free_bytes": c.free,
                "used_bytes": c.used,
                "processes": [
                    {"pid": p.pid, "used_bytes": p.used} for p in procs if p.card_uuid == c.uuid
                ],
                "held_by": [
                    {"slug": r.slug, "need_bytes": r.need_bytes}
                    for r in reservations
                    if c.uuid in r.cards
                ],
            }
        )
    return out


def with_free(card: Card, free: int) -> Card:
    return card.with_free(max(0, free))


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()
