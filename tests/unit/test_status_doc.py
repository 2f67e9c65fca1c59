"""`providerctl status --json` is a documented, stable interface: docs/status.md lists
every field of every object, and this test keeps the two equal (a field added in the
code and not in the doc, or the other way round, fails here)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.paths import ROOT

from agent.cli import main as cli
from agent.front.front import Front
from agent.front.gpu_hooks import GpuAdmission, cards_status
from agent.gpu.nvml import FAKE_ENV, GIB
from tests.unit.test_front import InProcessWorker, provider

DOC = ROOT / "docs" / "status.md"


def documented() -> dict[str, set[str]]:
    """Section title → the fields of its table (`| \\`name\\` | …`)."""
    out: dict[str, set[str]] = {}
    section = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        elif m := re.match(r"\| `(\w+)` \|", line):
            out.setdefault(section, set()).add(m.group(1))
    return out


def front_status() -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        worker = InProcessWorker()
        front = Front(provider(), worker, [sock], exit_on_idle=False)
        front.warm()
        while front.last_start is None:
            await asyncio.sleep(0.01)
        status = await front.status()
        front.stop_accepting()
        sock.close()
        await worker.stop()
        return status

    return asyncio.run(go())


def test_every_provider_field_is_documented_and_both_paths_agree(tmp_path: Path) -> None:
    doc = documented()
    running = front_status() | {"front": "running", "preloaded": None}  # what the CLI adds
    inactive = cli.provider_status("nothing_runs_here", None).to_json()
    assert set(running) == set(inactive)  # a running front and an inactive one: one shape
    from_manifest = {"listen", "description", "socket"}
    assert set(running) | from_manifest == doc["providers"]
    assert set(running["last_start"]) == doc["last_start"]
    assert set(running["memory"]) == doc["memory"]
    assert set(running["counters"]) == doc["counters"]


def test_every_gpu_field_is_documented(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = documented()
    ga = GpuAdmission(provider(gpu_devices="auto", vram_budget_gb=4.0), InProcessWorker())
    assert set(ga.status(None)) == doc["gpu"]  # type: ignore[arg-type]
    fake = tmp_path / "nvml"
    (fake / "procs").mkdir(parents=True)
    (fake / "cards.json").write_text(json.dumps([{"uuid": "GPU-1", "total": 80 * GIB}]))
    (fake / "procs" / "1.json").write_text(json.dumps({"uuid": "GPU-1", "bytes": GIB}))
    monkeypatch.setenv(FAKE_ENV, str(fake))
    (card,) = cards_status(tmp_path / "run")
    assert set(card) == doc["gpus"]
    assert set(card["processes"][0]) == {"pid", "used_bytes"}


def test_the_document_has_a_version(tmp_path: Path) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "PROVIDERD_RUNTIME_DIR": str(tmp_path / "run"),
        "PROVIDERD_MANIFEST_DIRS": str(tmp_path / "none"),
        "PYTHONPATH": str(ROOT),
    }
    out = subprocess.run(
        [sys.executable, "-m", "agent", "status", "--json"],
        env=env, capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc) == {"version", "providers", "gpus"}
    assert doc["version"] == cli.STATUS_VERSION == 1
    assert '{"version": 1, "providers": [ … ], "gpus": [ … ]}' in DOC.read_text()


def _status(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/bin:/bin",
        "PROVIDERD_RUNTIME_DIR": str(tmp_path / "run"),
        "PROVIDERD_MANIFEST_DIRS": f"{tmp_path / 'etc'}:{tmp_path / 'lib'}",
        "PROVIDERD_TRUSTED_UID": str(os.getuid()),
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.run(
        [sys.executable, "-m", "agent", "status", *args],
        env=env, capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip


def test_no_providers_says_so_and_names_where_manifests_go(tmp_path: Path) -> None:
    out = _status(tmp_path)
    assert out.returncode == 0, out.stderr
    etc, lib = tmp_path / "etc", tmp_path / "lib"
    assert out.stdout.splitlines() == [
        f"No providers: no manifests in {etc} or {lib}.",
        f"Hint: declare one in {etc}/<slug>.toml (see provider.toml(5)), "
        "then run 'providerctl reload'.",
    ]
    doc = json.loads(_status(tmp_path, "--json").stdout)
    assert doc == {"version": 1, "providers": [], "gpus": doc["gpus"]}


def test_no_valid_providers_points_at_check(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir(mode=0o755)
    (tmp_path / "etc" / "broken.toml").write_text("listen = 3\n")
    os.chmod(tmp_path / "etc" / "broken.toml", 0o644)
    out = _status(tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith("No providers: 1 manifest(s) in ")
    assert "'providerctl check' lists them" in out.stdout


def test_status_shows_the_preload_and_pinning_after_the_front_is_gone(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir(mode=0o755)
    (etc / "emb.toml").write_text(
        '[listen]\naddress = "127.0.0.1:1"\n[runtime]\ncommand = ["/bin/true"]\n'
        "preload = true\npinned = true\n"
    )
    os.chmod(etc / "emb.toml", 0o644)
    (tmp_path / "run").mkdir()
    record = {"at": 1764500000.0, "took_s": 2.5, "result": "ready"}
    (tmp_path / "run" / "emb.preloaded").write_text(json.dumps(record))
    doc = json.loads(_status(tmp_path, "--json").stdout)
    (emb,) = doc["providers"]
    assert emb["state"] == "inactive"
    assert emb["preloaded"] == record and emb["pinned"] is True
    text = _status(tmp_path, "emb")
    assert text.returncode == 3
    assert "   Preloaded: at boot, " in text.stdout and "took 2.5 s (ready)" in text.stdout
    assert "      Pinned: never released when idle" in text.stdout
