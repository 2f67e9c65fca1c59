"""Writing a file so that readers see the old content or the new, never a part: a fresh
temporary name beside it, then a rename. The one atomic writer (state files, the
generator's output, exported manifests, the demo's weights)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(
    path: Path,
    content: str | bytes,
    mode: int | None = None,
    *,
    durable: bool = True,
    make_parent: bool = True,
) -> None:
    """Write `content` (text as UTF-8, or bytes) at `path`. `mode` sets its permissions
    (0600 from mkstemp otherwise); `durable` fsyncs before the rename (output under /run,
    such as the generator's, gains nothing from it)."""
    if make_parent:
        path.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode() if isinstance(content, str) else content
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
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
        Path(tmp).unlink(missing_ok=True)
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
