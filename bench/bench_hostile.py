#!/usr/bin/env python3
"""What hostile clients cost a front: `providerctl serve` with a ready worker, then 600
connections that each send one byte of a head (`G`) and nothing more.

    python3 bench/bench_hostile.py

Prints the serve process's resident set growth per such connection, and how many of them
are still open after the header timeout (10 s) has passed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
N = 600


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "m").mkdir()
        worker = ROOT / "tests" / "workers" / "misbehave.py"
        manifest = tmp / "m" / "hostile.toml"
        manifest.write_text(
            f'[listen]\naddress = "127.0.0.1:{port}"\n[runtime]\n'
            f'command = ["{sys.executable}", "{worker}", "--port", "{{port}}"]\n'
            'ready = "http:/health"\n'
        )
        env = {
            **os.environ,
            "PROVIDERD_RUNTIME_DIR": str(tmp / "run"),
            "PROVIDERD_STATE_DIR": str(tmp / "state"),
            "PROVIDERD_TRUSTED_UID": str(os.getuid()),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "serve", str(tmp / "m")],
            cwd=ROOT,
            env=env,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            time.sleep(0.5)
            before = rss(proc.pid)
            conns = []
            for _ in range(N):
                c = socket.create_connection(("127.0.0.1", port))
                c.sendall(b"G")
                conns.append(c)
            time.sleep(1.0)
            during = rss(proc.pid)
            time.sleep(11)  # past the header timeout
            still_open = 0
            for c in conns:
                c.setblocking(False)
                try:
                    while True:
                        data = c.recv(65536)
                        if not data:
                            break
                except BlockingIOError:
                    still_open += 1
                except OSError:
                    pass
                c.close()
        finally:
            proc.terminate()
            proc.wait(20)
    print(f"{N} connections that sent one byte of a head:")
    print(f"  front RSS growth per connection   {(during - before) / N / 1024:6.1f} KiB")
    print(f"  still open 12 s later             {still_open:6d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
