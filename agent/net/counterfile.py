"""Counters in a small file mapped into memory, so that a process killed outright
(`kill -9`, an OOM kill) loses none of what it counted.

An increment is a store into a shared mapping of a file under /run/providerd (tmpfs):
the page cache holds every increment the moment it is made, with no system call per
increment, and whoever opens the file next (the next front, the metrics service) reads
it whatever became of the writer. /run does not survive a reboot; the JSON files under
/var/lib/providerd (`agent.net.counters`) carry the counters across one.

Layout (little-endian): a 64-byte header, `PDCOUNT1` then the number of record bytes in
use (u64); then records, each `u16 name length, name (UTF-8), padding to 8 bytes, u64
value`. Records are only ever appended, and the length in use is updated after a
record is complete, so a reader running beside the writer sees each value as it was
before or after an increment, never a record half-written. One writer per file.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import tempfile
from pathlib import Path

MAGIC = b"PDCOUNT1"
HEADER = 64
PAGE = 4096
MAX_FILE = 16 << 20  # what a reader accepts
MAX_NAME = 1024


def _record_size(name_len: int) -> int:
    return ((2 + name_len + 7) & ~7) + 8


def parse(data: bytes) -> dict[str, int] | None:
    """The counters in `data` (a whole file), or None when it is not such a file."""
    if len(data) < HEADER or data[:8] != MAGIC:
        return None
    (used,) = struct.unpack_from("<Q", data, 8)
    end = HEADER + used
    if end > len(data):
        return None
    out: dict[str, int] = {}
    pos = HEADER
    while pos < end:
        (n,) = struct.unpack_from("<H", data, pos)
        size = _record_size(n)
        if n == 0 or pos + size > end:
            return None
        name = data[pos + 2 : pos + 2 + n].decode("utf-8", "replace")
        (out[name],) = struct.unpack_from("<Q", data, pos + size - 8)
        pos += size
    return out


def read(path: Path) -> dict[str, int] | None:
    """The counters in the file at `path`, or None (no file, or not a counters file)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE + 1)
    except OSError:
        return None
    return parse(data) if len(data) <= MAX_FILE else None


class CounterFile:
    """The writer's side: `add(name, n)` is a store into the mapping."""

    def __init__(self, path: Path, values: dict[str, int]) -> None:
        """A fresh file at `path` holding `values` (replacing, atomically, what was there).
        Raises OSError."""
        self.path = path
        self._slots: dict[str, int] = {}  # name -> index of its value in `words`
        body = bytearray()
        for name, value in values.items():
            raw = name.encode()[:MAX_NAME]
            size = _record_size(len(raw))
            record = bytearray(size)
            struct.pack_into("<H", record, 0, len(raw))
            record[2 : 2 + len(raw)] = raw
            struct.pack_into("<Q", record, size - 8, min(max(value, 0), 2**64 - 1))
            self._slots[name] = (HEADER + len(body) + size - 8) // 8
            body += record
        head = bytearray(HEADER)
        head[:8] = MAGIC
        struct.pack_into("<Q", head, 8, len(body))
        size = (HEADER + len(body)) // PAGE * PAGE + PAGE
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            os.write(fd, bytes(head + body))
            os.ftruncate(fd, size)
            os.fchmod(fd, 0o644)
            self._map = mmap.mmap(fd, size)  # keeps its own descriptor of the file
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self._used = len(body)
        self.words = memoryview(self._map).cast("Q")  # the file as u64 words: the values

    def add(self, name: str, n: int = 1) -> None:
        slot = self._slots.get(name)
        if slot is None:
            slot = self._append(name)
        self.words[slot] += n

    def slot(self, name: str) -> int:
        """Where `name`'s value is in `words` (a record at 0 made for a new name), for a
        writer that adds to it directly: `file.words[slot] += 1`. `words` is replaced as
        the file grows (read it anew each time); a slot stays."""
        slot = self._slots.get(name)
        return slot if slot is not None else self._append(name)

    def set_max(self, name: str, value: int) -> None:
        """Raise `name` to `value` if it is lower (never lowers a counter)."""
        slot = self._slots.get(name)
        if slot is None:
            slot = self._append(name)
        if value > self.words[slot]:
            self.words[slot] = value

    def _append(self, name: str) -> int:
        raw = name.encode()[:MAX_NAME]
        size = _record_size(len(raw))
        at = HEADER + self._used
        if at + size > len(self._map):  # a system call only when a new name needs a page
            grown = (at + size) // PAGE * PAGE + PAGE
            self.words.release()
            self._map.resize(grown)  # the file too
            self.words = memoryview(self._map).cast("Q")
        struct.pack_into("<H", self._map, at, len(raw))
        self._map[at + 2 : at + 2 + len(raw)] = raw
        self.words[(at + size - 8) // 8] = 0
        self._used += size
        self.words[1] = self._used  # the record is complete: publish it
        slot = (at + size - 8) // 8
        self._slots[name] = slot
        return slot

    def values(self) -> dict[str, int]:
        return {name: self.words[slot] for name, slot in self._slots.items()}

    def close(self) -> None:
        """Unmap (the file stays, for whoever comes next)."""
        self.words.release()
        with contextlib.suppress(BufferError):
            self._map.close()
