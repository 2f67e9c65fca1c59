"""The VM tier: qemu (TCG), the Debian cloud kernel, pure cgroup v2, systemd as PID 1.

One boot runs the whole payload (tests/vm/payload/run_tests.py), which prints one
JSON object per check to the second serial port; the tests here assert on them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from support.paths import ROOT

from tests.vm.qemu import QEMU_TIMEOUT_S, keep, run_payload

HERE = Path(__file__).resolve().parent
REPO = ROOT


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
    files = [
        HERE / "payload" / "run-tests",
        HERE / "payload" / "run_tests.py",
        REPO / "tests/system/probe_worker.py",
        REPO / "tests/gpu/cuda_worker.py",
        REPO / "tests/support",  # the helpers run_tests.py imports
        deb,
    ]
    try:
        boot = run_payload(deb, files, work, QEMU_TIMEOUT_S)
        checks = boot.checks
        if "done" not in checks:
            pytest.fail(
                f"the VM payload did not finish (qemu exit {boot.qemu_rc}, {boot.vm_s:.0f} s):\n"
                f"--- results (ttyS1)\n{boot.results[-6000:]}\n--- console (ttyS0)\n"
                f"{boot.console}\n{boot.qemu_err}"
            )
        checks["_timing"] = {"image_s": round(boot.image_s, 1), "vm_s": round(boot.vm_s, 1)}
        return checks
    finally:
        if not keep():
            shutil.rmtree(work, ignore_errors=True)
