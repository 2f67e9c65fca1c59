"""The NVML boundary: the fake's model of a card, and RealNvml's translation of pynvml."""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.gpu.nvml import (
    GIB,
    MIB,
    DirNvml,
    FakeCard,
    FakeNvml,
    GpuProcess,
    NvmlUnavailable,
    RealNvml,
    format_bytes,
    gpu_status,
    open_nvml,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_fake_card_memory_follows_processes() -> None:
    nv = FakeNvml([FakeCard(0, "GPU-a", 80 * GIB, reserved=GIB), FakeCard(1, "GPU-b", 80 * GIB)])
    nv.allocate(10, "GPU-a", 20 * GIB)
    nv.allocate(11, "GPU-a", 5 * GIB)
    nv.allocate(11, "GPU-b", 7 * GIB)
    a, b = nv.cards()
    assert (a.index, a.uuid, a.minor) == (0, "GPU-a", 0)
    assert a.free == 80 * GIB - GIB - 25 * GIB
    assert a.used == 26 * GIB
    assert b.free == 73 * GIB
    assert nv.processes() == [
        GpuProcess(10, "GPU-a", 20 * GIB),
        GpuProcess(11, "GPU-a", 5 * GIB),
        GpuProcess(11, "GPU-b", 7 * GIB),
    ]


def test_fake_frees_an_exited_process_only_after_the_release_delay() -> None:
    clock = Clock()
    nv = FakeNvml([FakeCard(0, "GPU-a", 80 * GIB)], release_delay_s=0.11, clock=clock)
    nv.allocate(10, "GPU-a", 30 * GIB)
    nv.exit(10)
    clock.now += 0.10
    assert nv.cards()[0].free == 50 * GIB
    assert [p.pid for p in nv.processes()] == [10]
    clock.now += 0.02
    assert nv.cards()[0].free == 80 * GIB
    assert nv.processes() == []


def test_fake_failure_reads_as_nvml_unavailable() -> None:
    nv = FakeNvml([FakeCard(0, "GPU-a", GIB)])
    nv.fail("GPU is lost")
    with pytest.raises(NvmlUnavailable, match=r"^NVML is unavailable: GPU is lost$"):
        nv.cards()
    nv.fail(None)
    assert nv.cards()


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_pynvml(*, init_error: int | None = None, minor_error: bool = False) -> Any:
    def init() -> None:
        if init_error is not None:
            raise FakeNVMLError(init_error)

    def minor(h: int) -> int:
        if minor_error:
            raise FakeNVMLError(3)
        return h + 4

    procs = {
        0: [
            SimpleNamespace(pid=42, usedGpuMemory=3 * GIB),
            SimpleNamespace(pid=43, usedGpuMemory=None),
        ]
    }
    return SimpleNamespace(
        NVMLError=FakeNVMLError,
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}".encode(),
        nvmlDeviceGetName=lambda h: "NVIDIA H200",
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(
            total=140 * GIB, free=100 * GIB, used=40 * GIB
        ),
        nvmlDeviceGetMinorNumber=minor,
        nvmlDeviceGetPciInfo=lambda h: SimpleNamespace(busId=b"00000000:1B:00.0"),
        nvmlDeviceGetComputeRunningProcesses=lambda h: procs.get(h, []),
    )


def test_real_nvml_translates_pynvml() -> None:
    nv = RealNvml(fake_pynvml())
    cards = nv.cards()
    assert [(c.index, c.uuid, c.minor, c.free) for c in cards] == [
        (0, "GPU-0", 4, 100 * GIB),
        (1, "GPU-1", 5, 100 * GIB),
    ]
    assert cards[0].name == "NVIDIA H200" and cards[0].bus_id == "00000000:1B:00.0"
    assert nv.processes() == [GpuProcess(42, "GPU-0", 3 * GIB), GpuProcess(43, "GPU-0", 0)]
    nv.close()


def test_real_nvml_minor_number_falls_back_to_the_index() -> None:
    assert [c.minor for c in RealNvml(fake_pynvml(minor_error=True)).cards()] == [0, 1]


@pytest.mark.parametrize(
    ("code", "why"),
    [
        (12, "NVML is unavailable: libnvidia-ml.so.1 was not found; install the NVIDIA driver"),
        (
            9,
            "NVML is unavailable: the NVIDIA kernel driver is not loaded (is there an NVIDIA GPU?)",
        ),
        (4, "NVML is unavailable: permission denied opening the NVIDIA devices"),
        (999, "NVML is unavailable: NVML error 999"),
    ],
)
def test_real_nvml_init_failures_say_why(code: int, why: str) -> None:
    with pytest.raises(NvmlUnavailable) as e:
        RealNvml(fake_pynvml(init_error=code))
    assert str(e.value) == why


def test_without_pynvml_the_message_says_what_to_install(tmp_path: Path) -> None:
    # A Python that finds neither a system pynvml nor the vendored copy.
    shadow = tmp_path / "shadow"
    (shadow / "pynvml").mkdir(parents=True)
    (shadow / "pynvml" / "__init__.py").write_text("raise ImportError('no pynvml here')\n")
    code = (
        "import sys, agent\n"
        "sys.modules['agent._vendor'] = None\n"
        "from agent.gpu.nvml import RealNvml, NvmlUnavailable\n"
        "try:\n    RealNvml()\nexcept NvmlUnavailable as e:\n    print(e)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{shadow}:{Path(__file__).parents[2]}"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == (
        "NVML is unavailable: the pynvml module is not installed "
        "(install python3-pynvml or nvidia-ml-py)"
    )


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None, reason="this host has an NVIDIA driver"
)
def test_real_nvml_on_a_host_without_the_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("agent._vendor.pynvml")
    monkeypatch.delenv("PROVIDERD_NVML_FAKE", raising=False)
    with pytest.raises(NvmlUnavailable, match=r"libnvidia-ml\.so\.1 was not found"):
        open_nvml()


def test_dir_nvml_reads_cards_and_live_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cards.json").write_text(json.dumps([{"uuid": "GPU-x", "total": 10 * GIB}]))
    (tmp_path / "procs").mkdir()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / "procs" / f"{child.pid}.json").write_text(
            json.dumps({"uuid": "GPU-x", "bytes": 4 * GIB})
        )
        monkeypatch.setenv("PROVIDERD_NVML_FAKE", str(tmp_path))
        nv = open_nvml()
        assert isinstance(nv, DirNvml)
        assert nv.cards()[0].free == 6 * GIB
        assert nv.processes() == [GpuProcess(child.pid, "GPU-x", 4 * GIB)]
    finally:
        child.kill()
        child.wait()
    nv.release_delay_s = 0.0
    nv.cards()  # notices the exit
    assert nv.cards()[0].free == 10 * GIB
    assert not (tmp_path / "procs" / f"{child.pid}.json").exists()


def test_dir_nvml_without_cards_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(NvmlUnavailable, match=r"fake NVML .* unreadable"):
        DirNvml(tmp_path)


def test_gpu_status_lists_cards_processes_and_holders() -> None:
    nv = FakeNvml([FakeCard(0, "GPU-a", 80 * GIB, name="H200"), FakeCard(1, "GPU-b", 80 * GIB)])
    nv.allocate(7, "GPU-a", 10 * GIB)
    reservation = SimpleNamespace(slug="esm", cards=("GPU-a",), need_bytes=12 * GIB)
    status = gpu_status(nv, [reservation])
    assert status[0] == {
        "index": 0,
        "uuid": "GPU-a",
        "name": "H200",
        "total_bytes": 80 * GIB,
        "free_bytes": 70 * GIB,
        "used_bytes": 10 * GIB,
        "processes": [{"pid": 7, "used_bytes": 10 * GIB}],
        "held_by": [{"slug": "esm", "need_bytes": 12 * GIB}],
    }
    assert status[1]["held_by"] == [] and status[1]["processes"] == []


def test_format_bytes() -> None:
    assert format_bytes(int(18.5 * GIB)) == "18.5 GiB"
    assert format_bytes(300 * MIB) == "300 MiB"
