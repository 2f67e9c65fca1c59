"""One boot of the VM tier's image: qemu (TCG), the Debian cloud kernel, pure cgroup v2.

`run_payload` builds the image (mkimage.sh), puts the given files on a second disk that
the image's ci-payload.service mounts at /ci and runs (`/ci/run-tests`, output on ttyS1),
and returns the JSON objects the payload printed there, one per `{"check": NAME, ...}`
line. The VM tier (conftest.py) and bench/bench_cold_vm.py share it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
QEMU_TIMEOUT_S = 420


@dataclass
class Boot:
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    results: str = ""  # what ttyS1 received
    console: str = ""  # the last lines of ttyS0
    qemu_rc: int = 0
    qemu_err: str = ""
    image_s: float = 0.0
    vm_s: float = 0.0


def run_payload(
    deb: Path, files: list[Path], work: Path, timeout_s: float = QEMU_TIMEOUT_S
) -> Boot:
    """Build the image with `deb` downloadable, boot it once with `files` (among them an
    executable `run-tests`) at /ci; the image powers off when the payload ends."""
    shutil.rmtree(work, ignore_errors=True)
    (work / "payload").mkdir(parents=True)
    boot = Boot()
    t0 = time.monotonic()
    r = subprocess.run(
        [str(HERE / "mkimage.sh"), str(work / "img"), str(deb)], capture_output=True, text=True
    )
    if r.returncode != 0:
        raise RuntimeError(f"cannot build the VM image:\n{r.stdout}{r.stderr}")
    boot.image_s = time.monotonic() - t0
    for src in files:
        if src.is_dir():
            shutil.copytree(
                src, work / "payload" / src.name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy2(src, work / "payload" / src.name)
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-d", str(work / "payload"), str(work / "payload.img"), "64M"],
        check=True, capture_output=True,
    )  # fmt: skip
    console, results = work / "console.log", work / "results.log"
    cmd = [
        "timeout", "--kill-after=10", str(int(timeout_s)),
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
    boot.vm_s = time.monotonic() - t1
    boot.qemu_rc, boot.qemu_err = q.returncode, q.stderr
    boot.results = results.read_text(errors="replace") if results.exists() else ""
    for line in boot.results.replace("\r", "").splitlines():
        if line.startswith('{"check"'):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            boot.checks[doc["check"]] = doc
    if console.exists():
        boot.console = "\n".join(console.read_text(errors="replace").splitlines()[-40:])
    return boot


def keep() -> bool:
    """PROVIDERD_KEEP_VM=1 keeps the work directory (image, payload, serial logs)."""
    return bool(os.environ.get("PROVIDERD_KEEP_VM"))
