"""The GPU tier's own scenarios, run without a GPU against the fake card.

`tests/gpu/` drives real CUDA processes on a real card. Here the same test functions
run with PROVIDERD_NVML_FAKE set: NVML is `agent.gpu.nvml.DirNvml` and the workers
(`tests/gpu/cuda_worker.py`) write what they hold to its directory, so every line of
the scenarios (admission retiring real processes, enforcement, `providerctl serve`
with five GPU providers, the measurement of memory coming back after an idle
deadline) runs in CI. The fake card is sized so that no scenario has a reason to
skip: a skip here is a failure.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.paths import TESTS

GPU_TIER = TESTS / "gpu"
sys.path.insert(0, str(GPU_TIER))

import gpu_tier  # noqa: E402

from agent.gpu.nvml import FAKE_ENV, GIB  # noqa: E402

SCENARIOS = [
    t for name in ("test_layer", "test_serve") for t in gpu_tier.tests_in(GPU_TIER / f"{name}.py")
]


@pytest.fixture
def fake_card(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = tmp_path / "nvml"
    d.mkdir()
    card: dict[str, object] = {"uuid": "GPU-fa4e0000-0000-4000-8000-000000000000"}
    card |= {"name": "Fake H200", "total": int(140.4 * GIB), "bus_id": "00000000:00:06.0"}
    (d / "cards.json").write_text(json.dumps([card]))
    monkeypatch.setenv(FAKE_ENV, str(d))
    monkeypatch.setenv("OUT", str(tmp_path))
    gpu_tier._nvml = None
    yield d
    gpu_tier._nvml = None


def test_the_scenarios_are_all_here() -> None:
    names = [n for n, _ in SCENARIOS]
    assert len(names) >= 8, names
    assert "test_serve::test_three_providers_over_budget_idle_release_and_placement" in names


@pytest.mark.parametrize("scenario", [fn for _, fn in SCENARIOS], ids=[n for n, _ in SCENARIOS])
def test_gpu_tier_scenario_on_the_fake_card(fake_card: Path, scenario: Callable[[], None]) -> None:
    try:
        scenario()
    except pytest.skip.Exception as e:
        pytest.fail(f"skipped on the fake card, which is sized for every scenario: {e}")
