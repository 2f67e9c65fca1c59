"""Measured VRAM footprints, one small JSON file per provider.

`<state_dir>/footprints/<slug>.json`:
`{"peak_bytes": N, "last_peak_bytes": N, "runs": n, "updated": "<ISO 8601 UTC>"}`.
`peak_bytes` is the largest per-card usage seen over all runs; admission needs at
least that much. Each front writes only its own provider's file (tmp + rename), so
fronts never contend. An unreadable file counts as no measurement, and is said once
per read (a warning in the provider's log; the front's early start, which has no logging
yet, passes its own `warn`).

The early start reads a peak with this module on the way to its worker's StartUnit: only
`os` at import (`json` once there is a file to read).
"""

from __future__ import annotations

import os

from agent.atomic import write_atomic
from agent.spec import locations

TYPE_CHECKING = False  # not typing's: its import costs milliseconds (mypy reads this as it)
if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path
    from typing import Any


def _warn(message: str) -> None:
    import logging

    logging.getLogger(__name__).warning("%s", message)


class Footprints:
    def __init__(
        self, directory: Path | str | None = None, warn: Callable[[str], None] | None = None
    ) -> None:
        if directory is None:
            directory = os.path.join(locations.state_dir(), "footprints")
        self.directory = directory
        self.warn = warn or _warn  # says what is wrong with a file it reads

    def _file(self, slug: str) -> str:
        return os.path.join(self.directory, f"{slug}.json")

    def _read(self, slug: str) -> dict[str, Any] | None:
        f = self._file(slug)
        try:
            with open(f, encoding="utf-8") as stream:
                text = stream.read()
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self.warn(f"Failed to read VRAM footprint {f}: {e}, ignoring")
            return None
        import json

        try:
            data = json.loads(text)
        except ValueError as e:
            self.warn(f"Failed to read VRAM footprint {f}: {e}, ignoring")
            return None
        if not isinstance(data, dict) or not isinstance(data.get("peak_bytes"), int):
            self.warn(f"Failed to read VRAM footprint {f}: no integer peak_bytes, ignoring")
            return None
        return data

    def peak(self, slug: str) -> int | None:
        """The largest per-card VRAM use measured on earlier runs, or None."""
        data = self._read(slug)
        return None if data is None else int(data["peak_bytes"])

    def get(self, slug: str) -> dict[str, Any] | None:
        """The whole record, for `providerctl status`."""
        return self._read(slug)

    def record(self, slug: str, peak_bytes: int) -> None:
        """Add one run's measured peak (bytes, per card). Runs that measured nothing are skipped."""
        import json
        from datetime import UTC, datetime

        if peak_bytes <= 0:
            return
        old = self._read(slug) or {}
        data = {
            "peak_bytes": max(int(old.get("peak_bytes", 0)), peak_bytes),
            "last_peak_bytes": peak_bytes,
            "runs": int(old.get("runs", 0)) + 1,
            "updated": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        write_atomic(self._file(slug), json.dumps(data, sort_keys=True) + "\n")

    def forget(self, slug: str) -> None:
        """Drop the measurements (after the model changed)."""
        import contextlib

        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file(slug))
