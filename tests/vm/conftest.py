"""The VM tier: qemu (TCG), the Debian cloud kernel, pure cgroup v2, systemd as PID 1.

One boot runs the whole payload (tests/vm/payload/run_tests.py), which prints one
JSON object per check to the second serial port; the tests here assert on them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
QEMU_TIMEOUT_S = 420


@pytest.fixture(scope="session")
def vm(pytestconfig: pytest.Config) -> dict[str, dict[str, Any]]:
    if os.geteuid() != 0:
        pytest.fail("the VM tier needs root (debootstrap, systemd-nspawn)")
    value = pytestconfig.getoption("--deb")
    if not value or not Path(value).is_file():
        pytest.fail(
            f"the VM tier needs --deb=dist/providerd_<version>_all.deb (got {value!r}; make vm builds it)"
        )
    deb = Path(value).resolve()
    work = Path(f"/var/tmp/providerd-vm-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    (work / "payload").mkdir(parents=True)
    try:
        t0 = time.monotonic()
        r = subprocess.run(
            [str(HERE / "mkimage.sh"), str(work / "img"), str(deb)], capture_output=True, text=True
        )
        assert r.returncode == 0, f"cannot build the VM image:\n{r.stdout}{r.stderr}"
        t_image = time.monotonic() - t0
        for src in (
            HERE / "payload" / "run-tests",
            HERE / "payload" / "run_tests.py",
            REPO / "tests/system/probe_worker.py",
            REPO / "tests/gpu/cuda_worker.py",
            deb,
        ):
            shutil.copy2(src, work / "payload" / src.name)
        subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-d", str(work / "payload"), str(work / "payload.img"), "64M"],
            check=True, capture_output=True,
        )  # fmt: skip
        console, results = work / "console.log", work / "results.log"
        cmd = [
            "timeout", "--kill-after=10", str(QEMU_TIMEOUT_S),
            "qemu-system-x86_64", "-accel", "tcg,thread=multi", "-cpu", "max", "-machine", "q35",
            "-m", "2048", "-smp", "2", "-nodefaults", "-no-user-config", "-display", "none",
            "-no-reboot", "-nic", "none",
            "-kernel", str(work / "img" / "vmlinuz"),
            "-append", "console=ttyS0 root=/dev/nvme0n1 rw panic=-1 quiet systemd.unified_cgroup_hierarchy=1",
            "-drive", f"file={work / 'img' / 'disk.img'},if=none,id=root,format=raw,snapshot=on",
            "-device", "nvme,drive=root,serial=root",
            "-drive", f"file={work / 'payload.img'},if=none,id=pay,format=raw,readonly=on",
            "-device", "nvme,drive=pay,serial=payload",
            "-serial", f"file:{console}", "-serial", f"file:{results}", "-monitor", "none",
        ]  # fmt: skip
        t1 = time.monotonic()
        q = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        t_vm = time.monotonic() - t1
        text = results.read_text(errors="replace") if results.exists() else ""
        checks: dict[str, dict[str, Any]] = {}
        for line in text.replace("\r", "").splitlines():
            if line.startswith('{"check"'):
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                checks[doc["check"]] = doc
        tail = (
            "\n".join(console.read_text(errors="replace").splitlines()[-40:])
            if console.exists()
            else ""
        )
        if "done" not in checks:
            pytest.fail(
                f"the VM payload did not finish (qemu exit {q.returncode}, {t_vm:.0f} s):\n"
                f"--- results (ttyS1)\n{text[-6000:]}\n--- console (ttyS0)\n{tail}\n{q.stderr}"
            )
        checks["_timing"] = {"image_s": round(t_image, 1), "vm_s": round(t_vm, 1)}
        return checks
    finally:
        if not os.environ.get("PROVIDERD_KEEP_VM"):
            shutil.rmtree(work, ignore_errors=True)
