"""Writing a file so that readers see the old content or the new, never a part: a fresh
temporary name beside it, then a rename. The one atomic writer (state files, the
generator's output, exported manifests, the demo's weights)."""

from __future__ import annotations

import os

TYPE_CHECKING = False  # not typing's: the front's early start writes with this module, and
if TYPE_CHECKING:  # pathlib and tempfile (and typing) cost milliseconds to import there
    from pathlib import Path


def _temporary(directory: str, name: str) -> tuple[int, str]:
    """A new file `.NAME.XXXXXXXX` in `directory`, 0600, opened for writing (as mkstemp)."""
    for _ in range(100):
        tmp = os.path.join(directory, f".{name}.{os.urandom(6).hex()}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(tmp, flags, 0o600), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name for {name} in {directory}")


def write_atomic(
    path: Path | str,
    content: str | bytes,
    mode: int | None = None,
    *,
    durable: bool = True,
    make_parent: bool = True,
) -> None:
    """Write `content` (text as UTF-8, or bytes) at `path`. `mode` sets its permissions
    (0600 otherwise); `durable` fsyncs before the rename (output under /run, such as the
    generator's, gains nothing from it)."""
    directory, name = os.path.split(os.fspath(path))
    directory = directory or "."
    if make_parent:
        os.makedirs(directory, exist_ok=True)
    data = content.encode() if isinstance(content, str) else content
    fd, tmp = _temporary(directory, name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def link_atomic(path: Path, target: str, *, make_parent: bool = True) -> None:
    """Make `path` a symbolic link to `target`, replacing whatever is there."""
    if make_parent:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path.parent}/.#{path.name}.{os.getpid()}"
    try:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(target, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
