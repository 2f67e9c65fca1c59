"""Measured VRAM footprints, one small JSON file per provider.

`<state_dir>/footprints/<slug>.json`:
`{"peak_bytes": N, "last_peak_bytes": N, "runs": n, "updated": "<ISO 8601 UTC>"}`.
`peak_bytes` is the largest per-card usage seen over all runs; admission needs at
least that much. Each front writes only its own provider's file (tmp + rename), so
fronts never contend. An unreadable file counts as no measurement.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agent.spec import paths
from agent.spec.files import write_atomic

log = logging.getLogger(__name__)


class Footprints:
    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory if directory is not None else paths.state_dir() / "footprints"

    def _file(self, slug: str) -> Path:
        return self.directory / f"{slug}.json"

    def _read(self, slug: str) -> dict[str, Any] | None:
        f = self._file(slug)
        try:
            data = json.loads(f.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("Failed to read VRAM footprint %s: %s, ignoring", f, e)
            return None
        if not isinstance(data, dict) or not isinstance(data.get("peak_bytes"), int):
            log.warning("Failed to read VRAM footprint %s: no integer peak_bytes, ignoring", f)
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
        self._file(slug).unlink(missing_ok=True)
