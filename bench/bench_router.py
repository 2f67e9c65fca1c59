#!/usr/bin/env python3
"""The router, measured: what it adds over going to a provider's own port, next to what a
front adds over going to the worker.

One run on this machine, loopback only. Four processes: this one (the client), a small
raw-socket HTTP backend (the "worker"), a front (`agent.net.proxy.serve_http` behind a
plain accept loop, always ready) in front of it, and the router (`agent.router.router.Router`)
whose one provider is that front. Each gets its listening socket as fd 3.

    direct:  client → worker
    front:   client → front → worker              front adds  = front - direct
    router:  client → router → front → worker     router adds = router - front

Prints, side by side: latency p50/p99 of a small keep-alive POST with a JSON body
naming the model (rounds interleaved across the three paths), the latency each hop
adds, their ratio (target: the router adds at most 1.5x what a front adds), and
throughput of a 100 MiB streamed response through each path. Writes the table to
bench/results/router.txt.

    python3 bench/bench_router.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import selectors
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from common import (
    ROOT,
    always_ready_front,
    listener,
    pct,
    read_n,
    serve_epoll,
    spawn,
    wait_listening,
)

BIG = 100 * 1024 * 1024
CHUNK = 1024 * 1024
BODY = b'{"model": "bench", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}'
SMALL = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    % (
        len(BODY),
        BODY,
    )
)
BIG_REQUEST = SMALL.replace(b"/v1/chat/completions", b"/v1/big")
SMALL_RESPONSE = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{"ok": true}'
)
BIG_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"

# -- the worker: epoll for small requests, a thread for the big response ------------------


def backend_main() -> None:
    serve_epoll(on_data)


def on_data(sel: selectors.BaseSelector, conn: socket.socket, buf: bytearray) -> None:
    while (i := buf.find(b"\r\n\r\n")) >= 0:
        length = int(buf[: i + 4].split(b"Content-Length: ")[1].split(b"\r\n")[0])
        if len(buf) < i + 4 + length:
            break
        big = buf.startswith(b"POST /v1/big")
        del buf[: i + 4 + length]
        if not big:
            conn.send(SMALL_RESPONSE)
            continue
        sel.unregister(conn)
        conn.setblocking(True)
        threading.Thread(target=serve_big, args=(conn,), daemon=True).start()
        break


def serve_big(conn: socket.socket) -> None:
    chunk = memoryview(bytes(CHUNK))
    with conn:
        conn.sendall(BIG_HEAD % BIG)
        for _ in range(BIG // CHUNK):
            conn.sendall(chunk)
        conn.recv(1)  # until the client closes


# -- the front and the router -----------------------------------------------------------------


def router_main(front_port: int) -> None:
    import asyncio

    sys.path.insert(0, str(ROOT))
    from agent.router.router import Router, Table
    from agent.spec.provider import Address, Provider
    from agent.spec.settings import RouterConfig

    provider = Provider(
        slug="bench",
        source=Path("/bench.toml"),
        addresses=(Address("127.0.0.1", front_port),),
        model_names=("bench",),
    )

    async def main() -> None:
        router = Router(
            Table([provider]), RouterConfig(), [socket.socket(fileno=3)], exit_on_idle=False
        )
        router.start_accepting()
        await router.done.wait()

    asyncio.run(main())


# -- processes ------------------------------------------------------------------------------


def wait_until_listening(port: int) -> None:
    def exchange() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.sendall(SMALL)
            read_n(c, len(SMALL_RESPONSE))

    wait_listening(exchange)


# -- measurements ------------------------------------------------------------------------------


def latencies(port: int, n: int) -> list[float]:
    out = []
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(20):  # warm the connections behind this one
            c.sendall(SMALL)
            read_n(c, len(SMALL_RESPONSE))
        for _ in range(n):
            t = time.perf_counter()
            c.sendall(SMALL)
            read_n(c, len(SMALL_RESPONSE))
            out.append(time.perf_counter() - t)
    return out


def throughput(port: int) -> float:
    """MiB/s of a 100 MiB response."""
    buf = bytearray(1 << 20)
    with socket.create_connection(("127.0.0.1", port)) as c:
        t = time.perf_counter()
        c.sendall(BIG_REQUEST)
        got = 0
        head = len(BIG_HEAD % BIG)
        while got < BIG + head:
            n = c.recv_into(buf)
            if not n:
                raise ConnectionError("closed early")
            got += n
        return BIG / (1 << 20) / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--role")
    ap.add_argument("arg", nargs="?", type=int)
    args = ap.parse_args()
    if args.role == "backend":
        backend_main()
        return 0
    if args.role == "front":
        always_ready_front(args.arg)
        return 0
    if args.role == "router":
        router_main(args.arg)
        return 0

    rounds, per_round = (3, 300) if args.quick else (10, 1000)
    socks = {name: listener() for name in ("direct", "front", "router")}
    ports = {name: s.getsockname()[1] for name, s in socks.items()}
    procs = [
        spawn([sys.executable, __file__, "--role", role, str(arg)], socks[name])
        for role, arg, name in (
            ("backend", 0, "direct"),
            ("front", ports["direct"], "front"),
            ("router", ports["front"], "router"),
        )
    ]
    try:
        for port in ports.values():
            wait_until_listening(port)
        samples: dict[str, list[float]] = {name: [] for name in ports}
        for _ in range(rounds):
            for name, port in ports.items():
                samples[name] += latencies(port, per_round)
        mib_s = {
            name: statistics.median(throughput(port) for _ in range(3))
            for name, port in ports.items()
        }
    finally:
        for p in procs:
            p.kill()
            p.wait()

    p50 = {k: pct(v, 50) * 1e6 for k, v in samples.items()}
    p99 = {k: pct(v, 99) * 1e6 for k, v in samples.items()}
    add50 = {"front": p50["front"] - p50["direct"], "router": p50["router"] - p50["front"]}
    add99 = {"front": p99["front"] - p99["direct"], "router": p99["router"] - p99["front"]}
    ratio50 = add50["router"] / add50["front"] if add50["front"] > 0 else float("nan")
    ratio99 = add99["router"] / add99["front"] if add99["front"] > 0 else float("nan")
    n = rounds * per_round
    lines = [
        f"bench_router: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{n} keep-alive requests per path in {rounds} interleaved rounds",
        "",
        f"{'path':<34} {'p50 µs':>8} {'p99 µs':>8} {'adds p50':>9} {'adds p99':>9} {'MiB/s':>7}",
        f"{'direct  (client → worker)':<34} {p50['direct']:8.1f} {p99['direct']:8.1f} {'':>9} {'':>9} {mib_s['direct']:7.0f}",
        f"{'front   (client → front → worker)':<34} {p50['front']:8.1f} {p99['front']:8.1f} "
        f"{add50['front']:9.1f} {add99['front']:9.1f} {mib_s['front']:7.0f}",
        f"{'router  (→ router → front → worker)':<34} {p50['router']:8.1f} {p99['router']:8.1f} "
        f"{add50['router']:9.1f} {add99['router']:9.1f} {mib_s['router']:7.0f}",
        "",
        f"router adds / front adds: p50 {ratio50:.2f}x, p99 {ratio99:.2f}x (target: at most 1.5x)",
        f"streaming through the router: {mib_s['router'] / mib_s['front']:.2f}x the front's throughput",
        "",
        "Small request: POST /v1/chat/completions with an 85-byte JSON body naming the model;",
        "the router reads the body, parses the JSON, looks the model up, and forwards head and",
        "body unchanged on a kept connection to the front. Throughput: one 100 MiB response.",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    out = ROOT / "bench" / "results" / "router.txt"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
