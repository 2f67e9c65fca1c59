"""Where things are: the checkout and the tests' own folders."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
WORKERS = TESTS / "workers"
MISBEHAVE = WORKERS / "misbehave.py"  # the fake worker with misbehaviour flags
