"""Footprints: the largest measured peak per provider, stored atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agent.gpu.footprint import Footprints
from agent.gpu.nvml import GIB
from agent.spec.files import write_atomic


def test_keeps_the_largest_peak_over_runs(tmp_path: Path) -> None:
    fp = Footprints(tmp_path)
    assert fp.peak("esm") is None
    fp.record("esm", 10 * GIB)
    fp.record("esm", 14 * GIB)
    fp.record("esm", 12 * GIB)
    assert fp.peak("esm") == 14 * GIB
    data = fp.get("esm")
    assert data is not None
    assert data["last_peak_bytes"] == 12 * GIB
    assert data["runs"] == 3
    assert json.loads((tmp_path / "esm.json").read_text())["peak_bytes"] == 14 * GIB


def test_a_run_that_measured_nothing_is_not_recorded(tmp_path: Path) -> None:
    fp = Footprints(tmp_path)
    fp.record("esm", 0)
    assert not (tmp_path / "esm.json").exists()


def test_default_location_is_under_the_state_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROVIDERD_STATE_DIR", str(tmp_path))
    Footprints().record("esm", GIB)
    assert (tmp_path / "footprints" / "esm.json").exists()


def test_unreadable_file_counts_as_no_measurement(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "esm.json").write_text("{not json")
    (tmp_path / "bert.json").write_text('{"peak_bytes": "lots"}')
    fp = Footprints(tmp_path)
    assert fp.peak("esm") is None
    assert fp.peak("bert") is None
    assert "Failed to read VRAM footprint" in caplog.text
    fp.record("esm", GIB)
    assert fp.peak("esm") == GIB


def test_forget(tmp_path: Path) -> None:
    fp = Footprints(tmp_path)
    fp.record("esm", GIB)
    fp.forget("esm")
    assert fp.peak("esm") is None


def test_atomic_write_leaves_no_temporary_files(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "f.json"
    write_atomic(target, "one")
    write_atomic(target, "two")
    assert target.read_text() == "two"
    assert os.listdir(target.parent) == ["f.json"]
