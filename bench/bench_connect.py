"""What a connect to the worker costs the front: the loop's own `sock_connect` against
`agent.net.upstream.connect` (agent.net.sockio.connect_to), on the loop the product runs on
(uvloop's, agent.net.loop), to a loopback listener.

- first: a fresh interpreter's first connect (a cold start's first request to its worker),
  wall time and the process's CPU time, and the threads the process has after it (uvloop's
  sock_connect resolves numeric addresses too, in libuv's thread pool, which its first use
  starts);
- steady: the median of many later connects (a request that finds no kept connection).

Fresh interpreters alternate between the two ways, round by round; the steady connects
alternate in one process.

    python3 bench/bench_connect.py [--runs N] [--no-write]

Writes bench/results/connect.txt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "connect.txt"
WAYS = ("loop.sock_connect", "upstream.connect")

# argv: way, steady count. Prints {"first": [wall s, cpu s], "threads": n, "steady": [...]}.
PROBE = """\
import asyncio, json, os, socket, sys, time
sys.path.insert(0, sys.argv[3])
from agent.net import loop as net_loop, upstream
from agent.spec.provider import Address

way, n = sys.argv[1], int(sys.argv[2])

async def one(loop, address, s):
    if way == "loop.sock_connect":
        c = socket.socket(); c.setblocking(False)
        await loop.sock_connect(c, (address.host, address.port))
    else:
        c = await upstream.connect(loop, address)
    s.accept()[0].close()
    c.close()

async def main():
    loop = asyncio.get_running_loop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); s.listen(64)
        address = Address("127.0.0.1", s.getsockname()[1])
        t0, c0 = time.perf_counter(), time.process_time()
        await one(loop, address, s)
        first = [time.perf_counter() - t0, time.process_time() - c0]
        threads = len(os.listdir("/proc/self/task"))
        steady = []
        for _ in range(n):
            t0, c0 = time.perf_counter(), time.process_time()
            await one(loop, address, s)
            steady.append([time.perf_counter() - t0, time.process_time() - c0])
    print(json.dumps({"loop": type(loop).__module__, "first": first, "threads": threads,
                      "steady": steady}))

net_loop.run(main())
"""


def run(way: str, steady: int) -> dict[str, object]:
    r = subprocess.run(
        [sys.executable, "-c", PROBE, way, str(steady), str(REPO)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    out: dict[str, object] = json.loads(r.stdout)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20, help="fresh interpreters per way")
    ap.add_argument("--steady", type=int, default=2000, help="later connects per interpreter")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    got: dict[str, list[dict[str, object]]] = {w: [] for w in WAYS}
    for i in range(args.runs):
        for way in WAYS if i % 2 == 0 else reversed(WAYS):
            got[way].append(run(way, args.steady if i < 2 else 0))
    loops = {str(x["loop"]) for xs in got.values() for x in xs}

    def first(way: str, k: int) -> float:
        return statistics.median(x["first"][k] for x in got[way]) * 1e3  # type: ignore[index]

    def steady(way: str, k: int) -> float:
        return statistics.median(s[k] for x in got[way] for s in x["steady"]) * 1e6  # type: ignore[attr-defined,index]

    def threads(way: str) -> int:
        return max(int(x["threads"]) for x in got[way])  # type: ignore[call-overload]

    old, new = WAYS
    lines = [
        f"A connect to a loopback listener, {'/'.join(sorted(loops))} loop, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.runs} fresh "
        f"interpreters per way (alternating), {args.steady} steady connects in 2 of them",
        f"{'':34} {old:>18} {new:>18} {'ratio':>7}",
    ]
    rows = [
        ("first connect, wall ms (median)", first(old, 0), first(new, 0), "{:.3f}"),
        ("first connect, process CPU ms", first(old, 1), first(new, 1), "{:.3f}"),
        ("later connects, wall us (median)", steady(old, 0), steady(new, 0), "{:.1f}"),
        ("later connects, process CPU us", steady(old, 1), steady(new, 1), "{:.1f}"),
    ]
    for name, a, b, fmt in rows:
        lines.append(f"{name:34} {fmt.format(a):>18} {fmt.format(b):>18} {a / b:>6.1f}x")
    lines.append(f"{'threads after the first connect':34} {threads(old):>18} {threads(new):>18}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if not args.no_write:
        RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
