"""The soak: activation → request → release cycles against the installed package.

    python3 bench/soak.py [--cycles 1000] [--deb dist/providerd_0.1.0_all.deb]   (make soak)

Boots the container tier's Debian 12 (systemd 252) with the package installed, adds a
provider whose model is ready at once, and runs the cycles (tests/system/soak.py). Prints
failed requests, leftover processes and units, PID 1's and journald's open file
descriptors and PID 1's memory before and after, and writes bench/results/soak.txt.
Exits 1 on any failed request or leftover. Needs root (systemd-nspawn).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.system import soak  # noqa: E402
from tests.system.nspawn import base_tarball, installed  # noqa: E402

RESULTS = REPO / "bench" / "results" / "soak.txt"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--deb", default=str(REPO / "dist" / "providerd_0.1.0_all.deb"))
    ap.add_argument(
        "--pace",
        type=float,
        default=soak.PACE_S,
        help="the shortest cycle, s (default %(default)s)",
    )
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument(
        "--pid1-debug",
        action="store_true",
        help="PID 1 logs at debug level during the cycles (implies --no-write)",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("soak: needs root (systemd-nspawn)", file=sys.stderr)
        return 2
    deb = Path(args.deb).resolve()
    if not deb.is_file():
        print(f"soak: {deb} does not exist; run `make deb`", file=sys.stderr)
        return 2
    with installed(deb, base_tarball(), f"providerd-soak-{os.getpid()}") as ct:
        result = soak.run(ct, args.cycles, args.pace, args.pid1_debug)
        version = ct.sh("systemctl --version | head -n 1", check=False).out.strip()
    head = f"Soak under {version}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    text = "\n".join([head, *result.lines()]) + "\n"
    print(text, end="")
    if not args.no_write and not args.pid1_debug:  # a debug-level run is not a result
        RESULTS.write_text(text)
    bad = result.failed or result.leftover_processes or result.leftover_units
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
