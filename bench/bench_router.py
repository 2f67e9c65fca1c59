#!/usr/bin/env python3
"""The router, measured: what it adds over going to a provider's own port, next to what a
front adds over going to the worker.

One run on this machine, loopback only. Processes: this one (the client), a small
raw-socket HTTP backend (the "worker"), a front (the front's data path, agent.net, always
ready) in front of it, the router (`agent.router.router.Router`, exiting once idle as under
systemd) whose one provider is that front, and for scale two other second hops in the
router's place: another such bare front, and systemd-socket-proxyd. Each gets its
listening socket as fd 3.

    direct:  client → worker
    front:   client → front → worker              front adds  = front - direct
    router:  client → router → front → worker     router adds = router - front
    relay:   client → front → front → worker      relay adds  = relay - front
    proxyd:  client → proxyd → front → worker     proxyd adds = proxyd - front

Prints, side by side: latency p50/p99 of a small keep-alive POST with a JSON body
naming the model (rounds interleaved across the paths), the latency each hop adds, their
ratio (target: the router adds at most 1.2x what a front adds), what the same core with
nothing to decide adds as that second hop (the part of the ratio routing does not
cause), CPU per request of each process, and throughput of a 100 MiB streamed response
through each path. Writes the table to bench/results/router.txt.

    python3 bench/bench_router.py [--quick]
    python3 bench/bench_router.py --profile    # only the in-process figures, and cProfile's
    python3 bench/bench_router.py --instructions   # the in-process request in instructions
"""

from __future__ import annotations

import argparse
import os
import platform
import selectors
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import (
    ROOT,
    always_ready_backend,
    always_ready_front,
    listener,
    pct,
    read_n,
    serve_epoll,
    spawn,
    wait_listening,
)

PROXYD = "/lib/systemd/systemd-socket-proxyd"
BIG = 100 * 1024 * 1024
WARM = 20  # requests on each new client connection before the measured ones
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

    sys.path.insert(0, str(ROOT))
    from agent.net import loop
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
        # As under systemd: exits once idle (after the default 600 s, never within a run).
        router = Router(
            Table([provider]), RouterConfig(), [socket.socket(fileno=3)], exit_on_idle=True
        )
        router.start_accepting()
        await router.done.wait()

    loop.run(main())  # the loop the router runs on


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
        for _ in range(WARM):  # warm the connections behind this one
            c.sendall(SMALL)
            read_n(c, len(SMALL_RESPONSE))
        for _ in range(n):
            t = time.perf_counter()
            c.sendall(SMALL)
            read_n(c, len(SMALL_RESPONSE))
            out.append(time.perf_counter() - t)
    return out


def cpu_ns(pid: int) -> int:
    """CPU time a process has used so far (ns): /proc/PID/schedstat, else /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 10**9 // os.sysconf("SC_CLK_TCK")


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


# -- in one process, without I/O --------------------------------------------------------------


def in_process(
    n: int, rounds: int, profile: bool = False, names: tuple[str, ...] = ("front", "router")
) -> dict[str, float]:
    """CPU µs per request of the router's site and of a bare front's site on the same core,
    driven in this process through in-memory transports (no system calls, no other
    process): the Python each adds, steadier than any socket figure on a shared machine.
    With `profile`, each path's n requests also run once under cProfile, whose table (the
    functions by their own time) goes to stderr. With no rounds, the n requests run once,
    untimed (0.0): for a count of the instructions around them (`instructions`)."""
    import asyncio
    import tempfile

    sys.path.insert(0, str(ROOT))
    os.environ["PROVIDERD_STATE_DIR"] = tempfile.mkdtemp()  # the router's counters
    os.environ["PROVIDERD_RUNTIME_DIR"] = tempfile.mkdtemp()
    from agent.net import loop
    from agent.net.answers import Style
    from agent.net.client import ClientConn
    from agent.net.site import FrontSite
    from agent.net.upconn import UpstreamConn
    from agent.router.router import Router, Table
    from agent.spec.provider import Address, Provider
    from agent.spec.settings import RouterConfig

    class Transport:
        def write(self, data: object) -> None:
            pass

        def pause_reading(self) -> None:
            pass

        def resume_reading(self) -> None:
            pass

        def set_write_buffer_limits(self, high: int | None = None) -> None:
            pass

        def close(self) -> None:
            pass

    def feed(protocol: asyncio.BaseProtocol, data: bytes) -> None:
        if isinstance(protocol, asyncio.BufferedProtocol):
            buf = protocol.get_buffer(len(data))
            buf[: len(data)] = data
            protocol.buffer_updated(len(data))
        else:
            protocol.data_received(data)  # type: ignore[attr-defined]

    async def per_request(name: str) -> float:
        up = UpstreamConn(0, "upstream")
        up.connection_made(Transport())  # type: ignore[arg-type]
        up.clean = True
        site: object
        if name == "router":
            provider = Provider(
                slug="bench",
                source=Path("/bench.toml"),
                addresses=(Address("127.0.0.1", 1),),
                model_names=("bench",),
            )
            router = Router(Table([provider]), RouterConfig(), [], exit_on_idle=True)
            router.listening.accepting = True  # as once started: the idle timer runs
            site = router.site
            route = router.site.route("bench")  # a first look-up of a table closes the kept
            up.generation = route.target[1]  # made under the route's table
            router.site.pool("bench").keep(up, up.generation)
        else:
            backend = always_ready_backend(1)
            up.generation = 1
            backend.upstream.keep(up, 1)
            site = FrontSite(backend)  # type: ignore[arg-type]
        conn = ClientConn(site, Style("bench"))  # type: ignore[arg-type]
        conn.connection_made(Transport())  # type: ignore[arg-type]

        def one() -> None:
            feed(conn, SMALL)
            if conn.ex is None or getattr(conn.ex, "up", None) is not up:
                raise AssertionError(f"{name}: the request did not reach the kept connection")
            feed(up, SMALL_RESPONSE)
            if conn.ex is not None:
                raise AssertionError(f"{name}: the response did not end the request")

        for _ in range(1000):
            one()
        if not rounds:
            for _ in range(n):
                one()
            return 0.0
        if profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.runcall(lambda: [one() for _ in range(n)])
            print(f"-- {name}: {n} requests under cProfile", file=sys.stderr)
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(30)
        best = float("inf")
        for _ in range(rounds):
            t = time.process_time_ns()
            for _ in range(n):
                one()
            best = min(best, (time.process_time_ns() - t) / n / 1000)
        return best

    return {name: loop.run(per_request(name)) for name in names}


def instructions(n: int = 5000) -> dict[str, int]:
    """Instructions per request of the in-process request, front's site and router's:
    under valgrind's callgrind, a process that runs n requests less one that runs none,
    divided by n. The same on a busy machine as on an idle one, where CPU time is not."""
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_router: --instructions needs valgrind (Debian package valgrind)")
    out = {}
    for name in ("front", "router"):
        counted = []
        for requests in (0, n):
            run = subprocess.run(
                [
                    "valgrind",
                    "--tool=callgrind",
                    "--callgrind-out-file=/dev/null",
                    sys.executable,
                    __file__,
                    "--role",
                    f"instructions-{name}",
                    str(requests),
                ],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONHASHSEED": "0"},  # the same dictionaries both runs
            )
            if run.returncode != 0 or "Collected : " not in run.stderr:
                raise SystemExit(f"bench_router: callgrind failed:\n{run.stderr[-2000:]}")
            counted.append(int(run.stderr.split("Collected : ")[1].split()[0]))
        out[name] = (counted[1] - counted[0]) // n
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true", help="in one process only, profiled")
    ap.add_argument(
        "--instructions", action="store_true", help="in one process only, counted by callgrind"
    )
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
    if args.profile:
        got = in_process(20_000, 3, profile=True)
        print(f"in one process, no I/O: front {got['front']:.1f} µs, router {got['router']:.1f} µs")
        return 0
    if args.role in ("instructions-front", "instructions-router"):
        in_process(args.arg, 0, names=(args.role.split("-")[1],))
        return 0
    if args.instructions:
        got = instructions()
        print(
            f"in one process, no I/O: front {got['front']} instructions, router {got['router']} "
            f"per request: router/front {got['router'] / got['front']:.3f}x, the router's own "
            f"{got['router'] - got['front']}"
        )
        return 0
    if args.role == "in-process":
        got = in_process(20_000, 9)
        print(f"{got['front']} {got['router']}")
        return 0

    rounds, per_round = (3, 300) if args.quick else (9, 1000)
    load_before = os.getloadavg()[0]  # other work on the machine shows in every figure
    names = ("direct", "front", "router", "relay", "proxyd")
    socks = {name: listener() for name in names}
    ports = {name: s.getsockname()[1] for name, s in socks.items()}
    procs = [
        spawn([sys.executable, __file__, "--role", role, str(arg)], socks[name])
        for role, arg, name in (
            ("backend", 0, "direct"),
            ("front", ports["direct"], "front"),
            ("router", ports["front"], "router"),
            ("front", ports["front"], "relay"),  # a bare front where the router is
        )
    ]
    procs.append(
        spawn(
            [
                "/bin/sh",
                "-c",
                'LISTEN_PID=$$ exec "$@"',
                "sh",
                PROXYD,
                f"127.0.0.1:{ports['front']}",
            ],
            socks["proxyd"],
            env=dict(os.environ, LISTEN_FDS="1"),
        )
    )
    # One value per round and path (the paths take turns within a round, so drift on the
    # machine hits all alike); the table shows the median over the rounds.
    rows: dict[str, list[float]] = {}

    def note(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    try:
        for port in ports.values():
            wait_until_listening(port)
        pids = {"front": procs[1].pid, "router": procs[2].pid, "relay": procs[3].pid}
        for _ in range(rounds):
            cpu = {name: cpu_ns(pid) for name, pid in pids.items()}
            got = {name: latencies(port, per_round) for name, port in ports.items()}
            # Every path but direct goes through the front; the router's and the relay's
            # each through their own process too.
            sent = per_round + WARM
            for name, pid in pids.items():
                carried = sent * (len(names) - 1 if name == "front" else 1)
                note(f"{name} cpu", (cpu_ns(pid) - cpu[name]) / carried / 1000)
            for p in (50, 99):
                v = {name: pct(samples, p) * 1e6 for name, samples in got.items()}
                for name in names:
                    note(f"{name} p{p}", v[name])
                note(f"front adds p{p}", v["front"] - v["direct"])
                note(f"router adds p{p}", v["router"] - v["front"])
                note(f"relay adds p{p}", v["relay"] - v["front"])
                note(f"proxyd adds p{p}", v["proxyd"] - v["front"])
        for _ in range(3):
            for name, port in ports.items():
                note(f"{name} MiB/s", throughput(port))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    # Apart, so that its environment and its CPU touch none of the above.
    alone = subprocess.run(
        [sys.executable, __file__, "--role", "in-process"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    front_alone, router_alone = float(alone[0]), float(alone[1])

    med = {k: statistics.median(v) for k, v in rows.items()}

    def ratio(hop: str, p: int) -> float:
        front = med[f"front adds p{p}"]
        return med[f"{hop} adds p{p}"] / front if front > 0 else float("nan")

    def line(label: str, name: str, adds: str | None) -> str:
        added = (
            f"{med[f'{adds} p50']:9.1f} {med[f'{adds} p99']:9.1f}" if adds else f"{'':>9} {'':>9}"
        )
        return (
            f"{label:<38} {med[f'{name} p50']:8.1f} {med[f'{name} p99']:8.1f} {added} "
            f"{med[f'{name} MiB/s']:7.0f}"
        )

    r50, r99 = ratio("router", 50), ratio("router", 99)
    verdict = "" if r50 <= 1.2 and r99 <= 1.2 else "  MISS"
    lines = [
        f"bench_router: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{per_round} keep-alive requests per path and round, median of {rounds} interleaved rounds",
        f"load average (1 min) before the run {load_before:.2f}, after it {os.getloadavg()[0]:.2f}",
        "",
        f"{'path':<38} {'p50 µs':>8} {'p99 µs':>8} {'adds p50':>9} {'adds p99':>9} {'MiB/s':>7}",
        line("direct  (client → worker)", "direct", None),
        line("front   (client → front → worker)", "front", "front adds"),
        line("router  (→ router → front → worker)", "router", "router adds"),
        line("relay   (→ bare front → front → worker)", "relay", "relay adds"),
        line("proxyd  (→ proxyd → front → worker)", "proxyd", "proxyd adds"),
        "",
        f"router adds / front adds: p50 {r50:.2f}x, p99 {r99:.2f}x (target: at most 1.2x){verdict}",
        f"relay adds / front adds: p50 {ratio('relay', 50):.2f}x, p99 {ratio('relay', 99):.2f}x "
        "(the core alone as the second hop: the floor of the ratio above)",
        f"proxyd adds / front adds: p50 {ratio('proxyd', 50):.2f}x, p99 {ratio('proxyd', 99):.2f}x "
        "(a relay that parses nothing, for scale)",
        f"router adds / relay adds: p50 {med['router adds p50'] / med['relay adds p50']:.2f}x, "
        f"p99 {med['router adds p99'] / med['relay adds p99']:.2f}x (what routing itself costs)",
        f"CPU per request: front {med['front cpu']:.1f} µs, relay {med['relay cpu']:.1f} µs, "
        f"router {med['router cpu']:.1f} µs: router/front {med['router cpu'] / med['front cpu']:.2f}x, "
        f"router/relay {med['router cpu'] / med['relay cpu']:.2f}x",
        f"in one process, no I/O: front {front_alone:.1f} µs, router {router_alone:.1f} µs of CPU per "
        f"request: router/front {router_alone / front_alone:.2f}x",
        f"streaming through the router: {med['router MiB/s'] / med['front MiB/s']:.2f}x the front's "
        f"throughput (a bare front in its place: {med['relay MiB/s'] / med['front MiB/s']:.2f}x, "
        f"proxyd: {med['proxyd MiB/s'] / med['front MiB/s']:.2f}x)",
        "",
        "Small request: POST /v1/chat/completions with an 85-byte JSON body naming the model;",
        "the router reads the body, parses the JSON, looks the model up, and forwards head and",
        "body unchanged on a kept connection to the front. Throughput: one 100 MiB response.",
        "The router logs nothing per request, as by default under systemd (a journal line per",
        "routed request only with [router] log_requests = true: docs/router.md).",
        "relay: the front's data path with nothing to decide (always ready, no lease, no gate),",
        "as the bench's front itself, in the router's place: what a second hop costs by itself.",
        "CPU per request: the process's CPU time over the latency rounds (/proc/PID/schedstat)",
        "divided by the requests it carried (the front carries every path but direct).",
        "In one process: the same request and response through the router's site and a bare",
        "front's site on in-memory transports (best of 9 x 20,000), the Python alone.",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if not args.quick:
        out = ROOT / "bench" / "results" / "router.txt"
        out.parent.mkdir(exist_ok=True)
        out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
