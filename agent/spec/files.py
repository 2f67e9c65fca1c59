"""Reading one file an operator wrote (a manifest, providerd.toml), and the boundary
around it.

Whatever such a file is or holds, it may cost only itself: `read_regular` opens it
without blocking (a FIFO never stalls the generator) and refuses anything but a
regular file of bounded size; `mode_problem` refuses owners other than root and
modes that let others rewrite it; `contained` turns anything unexpected raised
while reading, parsing or checking one file into a problem of that file; and
`printable` makes any name or message safe to print on one line. `write_atomic` (from
agent.atomic) is the one way providerd writes a file others read (state, records, exports).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from agent.atomic import write_atomic
from agent.errors import ProviderdError
from agent.spec import paths
from agent.spec.provider import Problem, printable
from agent.spec.sizes import format_size

__all__ = [
    "FileProblem",
    "contained",
    "describe",
    "mode_problems",
    "printable",
    "read_regular",
    "write_atomic",
]

T = TypeVar("T")


class FileProblem(ProviderdError):
    """A file that cannot be read; `message` is the line to print, `missing` tells a
    file that does not exist from one that cannot be used."""

    code = "unusable_file"

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


def _size_text(n: int) -> str:
    return format_size(n, ((" MiB", 20),), "{} bytes")


def read_regular(path: Path, limit: int, what: str) -> bytes:
    """The bytes of `path` (a `what`, such as "manifest"), at most `limit` of them.
    Raises FileProblem for a missing, special, oversized or unreadable file."""

    def failed(e: OSError) -> FileProblem:
        missing = e.errno in (errno.ENOENT, errno.ENOTDIR)
        return FileProblem(f"Failed to read {what}: {e.strerror or e}", missing)

    def refuse(st: os.stat_result) -> None:
        if stat.S_ISDIR(st.st_mode):
            raise FileProblem(f"is a directory, expected a {what} file")
        if not stat.S_ISREG(st.st_mode):
            raise FileProblem("is not a regular file")
        if st.st_size > limit:
            raise FileProblem(f"is {st.st_size} bytes; a {what} may be at most {_size_text(limit)}")

    try:
        refuse(os.stat(path))  # no open() of a device or a FIFO at all
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise failed(e) from None
    try:
        refuse(os.fstat(fd))  # what was opened, should it have been swapped meanwhile
        chunks: list[bytes] = []
        total = 0
        while total <= limit:
            chunk = os.read(fd, limit + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise failed(e) from None
    finally:
        os.close(fd)
    if total > limit:
        raise FileProblem(
            f"grew beyond {_size_text(limit)} while being read; a {what} may be at most that"
        )
    return b"".join(chunks)


def mode_problem(
    what: str, st: os.stat_result, uids: frozenset[int], is_dir: bool, why: str
) -> str | None:
    """Why `what` (a file or a directory above it) may not be trusted, or None.
    `why` says what the file controls, such as "manifests run commands on the host"."""
    if st.st_uid not in uids:
        trusted = " or ".join(str(u) for u in sorted(uids))
        return (
            f"{what} is owned by uid {st.st_uid}, not by root (uid {trusted}); {why}, "
            "so only root may own them"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (is_dir and st.st_mode & stat.S_ISVTX):
        return (
            f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"{why}: chmod go-w {what}"
        )
    return None


def mode_problems(
    file: Path, checks: list[tuple[Path, bool]], uids: frozenset[int], why: str
) -> list[Problem]:
    """`mode_problem` for each (path, is_dir) in `checks`, as problems of `file`."""
    out: list[Problem] = []
    for p, is_dir in checks:
        try:
            st = p.stat()
        except OSError:
            continue  # reported by the read
        if (msg := mode_problem(str(p), st, uids, is_dir, why)) is not None:
            out.append(Problem(str(file), "", msg))
    return out


_MAX_DETAIL = 200


def parse_trusted(
    path: Path,
    limit: int,
    what: str,
    checks: list[tuple[Path, bool]],
    why: str,
    parse: Callable[[bytes], T | list[Problem]],
) -> T | list[Problem]:
    """Read a file an operator wrote (`read_regular`), check the owners and modes of
    `checks` (`mode_problems`, trusting `paths.trusted_uids()`), and `parse` its bytes:
    the result, or every problem of both. Raises FileProblem when it cannot be read."""
    raw = read_regular(path, limit, what)
    problems = mode_problems(path, checks, paths.trusted_uids(), why)
    result = parse(raw)
    if isinstance(result, list):
        return problems + result
    return problems or result


def describe(e: BaseException) -> str:
    """An unexpected exception in words, one line, bounded."""
    if isinstance(e, RecursionError):
        return "it is nested too deeply"
    if isinstance(e, MemoryError):
        return "it needs too much memory"
    text = re.sub(r"\s+", " ", str(e)).strip()
    if len(text) > _MAX_DETAIL:
        text = text[: _MAX_DETAIL - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def contained(file: str, what: str, work: Callable[[], T]) -> T | list[Problem]:
    """`work()`, or, if it raises anything at all, one problem of `file` saying so.

    The boundary of one file: whatever its bytes, size, type or name make the
    parser or a check raise, the caller gets a problem of that file and goes on
    with the others."""
    try:
        return work()
    except Exception as e:
        return [Problem(file, "", f"Failed to read {what}: {describe(e)}")]
