#!/usr/bin/env python3
"""Run the GPU tier without pytest: every `test_*` function of the given files, in order.

Prints PASS / FAIL / SKIP per test and writes the measured figures to $OUT/gpu.txt.
Exit status 1 if any test failed.
"""

from __future__ import annotations

import os
import platform
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this tier's helpers, and tests/support
os.environ["PROVIDERD_GPU_RUNNER"] = "1"

import gpu_tier  # noqa: E402


def main(files: list[str]) -> int:
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    failed = 0
    for name in files:
        for test, fn in gpu_tier.tests_in(Path(name).resolve()):
            print(test, flush=True)
            t0 = time.monotonic()
            try:
                fn()
                result = "PASS"
            except gpu_tier.Skip as e:
                result = f"SKIP ({e})"
            except BaseException as e:
                if type(e).__name__ == "Skipped":
                    result = f"SKIP ({e})"
                else:
                    failed += 1
                    result = f"FAIL ({type(e).__name__}: {e})"
                    traceback.print_exc()
            line = f"{result.split(' ')[0]:4} {test} ({time.monotonic() - t0:.1f} s)"
            print(f"  {result}", flush=True)
            lines.append(line + ("" if result == "PASS" else f" {result[5:]}"))
    header = [
        f"# providerd GPU tier, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"# host {platform.node()}, Python {platform.python_version()}, kernel {platform.release()}",
        "# command: tests/gpu/run.sh",
        "",
    ]
    text = "\n".join(header + lines + ["", "## figures", *gpu_tier.FIGURES]) + "\n"
    (out / "gpu.txt").write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
