#!/usr/bin/env python3
"""One keep-alive request through the front's data path, taken apart, with real sockets.

The proxy (agent.net's `Listeners` → `ClientConn` → `Exchange` → `UpstreamConn`, an
always-ready backend, as bench_proxy.py's `ours`) runs on uvloop in a thread of this
process; bench_proxy.py's epoll backend and its keep-alive client (`GET /small`, a 66-byte
response) run as processes of their own. After a warm-up, N requests on one connection are
measured in the proxy's thread only:

    python3 bench/profile_core.py            # CPU per request (the proxy thread's own)
    python3 bench/profile_core.py --calls    # Python calls, C calls and attribute writes per request
    python3 bench/profile_core.py --cprofile # cProfile: own time per request by function

`--calls` counts with `sys.setprofile` (each Python function entered, each C function
called from Python) and `sys.settrace` with opcode events (each STORE_ATTR executed in
agent/), both in the proxy's thread alone. The counts are exact; the times under a
profiler are not (cProfile about doubles them), so the CPU figure comes from a run with
none (`time.thread_time_ns` in the proxy's thread: user and system time, the loop's
system calls included).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dis
import logging
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_proxy import (
    PySide,
    protocol_relay,
    spawn_activated,
    stop,
    wait_until_listening,
)
from common import always_ready_backend, listener

STORE_ATTR = dis.opmap["STORE_ATTR"]
HERE = Path(__file__).resolve().parent


class Proxy:
    """The front's data path on its own uvloop loop, in a thread of this process."""

    def __init__(self, backend_port: int, relay: str = "ours") -> None:
        self.sock = listener()
        self.address = self.sock.getsockname()
        self.backend_port = backend_port
        self.relay = relay
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.main, daemon=True)
        self.thread.start()
        self.ready.wait()

    def main(self) -> None:
        from agent.net import loop
        from agent.net.listeners import Listeners
        from agent.net.proxy import FrontSite, Style, accept_http

        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            if self.relay == "pyproto":
                self.ready.set()
                await protocol_relay(PySide, self.backend_port, listening=self.sock)
                return
            site = FrontSite(always_ready_backend(self.backend_port))
            style = Style("bench")
            listening: Listeners

            def connection(sock: socket.socket) -> None:
                accept_http(sock, site, style, listening.closed, listening.loop)

            listening = Listeners([self.sock], connection, logging.getLogger("bench"))
            listening.start()
            self.ready.set()
            await asyncio.Event().wait()

        loop.run(serve())

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn in the proxy's thread, between two of the loop's callbacks; its result."""
        assert self.loop is not None
        done = threading.Event()
        out: list[Any] = []

        def run() -> None:
            out.append(fn())
            done.set()

        self.loop.call_soon_threadsafe(run)
        done.wait()
        return out[0]


class Client:
    """bench_proxy.py's keep-alive client, a process: N requests on one connection."""

    def __init__(self, port: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "bench_proxy.py"), "--role", "client", "--port", str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.proc.stdout.readline()  # its pid, after its warm-up

    def run(self, n: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "done":
            raise RuntimeError("the client failed")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)


def where(code: Any) -> str:
    path = code.co_filename
    i = path.rfind("/agent/")
    path = path[i + 1 :] if i >= 0 else Path(path).name
    return f"{path}:{code.co_name}"


def count_calls(proxy: Proxy, client: Client, n: int) -> str:
    calls: collections.Counter[str] = collections.Counter()
    c_calls: collections.Counter[str] = collections.Counter()
    stores: collections.Counter[str] = collections.Counter()

    def profiler(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            calls[where(frame.f_code)] += 1
        elif event == "c_call":
            c_calls[getattr(arg, "__qualname__", str(arg))] += 1

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if "/agent/" not in frame.f_code.co_filename:
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return opcode

    def opcode(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode" and frame.f_code.co_code[frame.f_lasti] == STORE_ATTR:
            stores[where(frame.f_code)] += 1
        return opcode

    def on() -> None:
        sys.setprofile(profiler)

    def off() -> None:
        sys.setprofile(None)

    proxy.call(on)
    client.run(n)
    proxy.call(off)
    proxy.call(lambda: sys.settrace(tracer))
    client.run(n)
    proxy.call(lambda: sys.settrace(None))

    def block(title: str, counter: collections.Counter[str]) -> list[str]:
        total = sum(counter.values()) / n
        lines = [f"{title}: {total:.2f} per request"]
        for name, k in counter.most_common():
            if k / n >= 0.01:
                lines.append(f"  {k / n:7.2f}  {name}")
        return lines

    by_file: collections.Counter[str] = collections.Counter()
    for name, k in calls.items():
        by_file[name.split(":")[0]] += k
    return "\n".join(
        [
            *block("Python calls", calls),
            "",
            *block("Python calls by file", by_file),
            "",
            *block("C calls from Python", c_calls),
            "",
            *block("attribute writes (STORE_ATTR in agent/)", stores),
        ]
    )


def cprofile(proxy: Proxy, client: Client, n: int) -> str:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    proxy.call(prof.enable)
    client.run(n)
    proxy.call(prof.disable)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime")
    lines = [f"cProfile, {n} requests: own time per request (µs), calls per request"]
    rows = []
    for func, (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        file, _line, name = func
        i = file.rfind("/agent/")
        short = file[i + 1 :] if i >= 0 else Path(file).name
        rows.append((tt, nc, ct, f"{short}:{name}"))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    lines.append(f"  all: {total / n * 1e6:.2f} µs per request")
    for tt, nc, ct, name in rows[:40]:
        lines.append(f"  {tt / n * 1e6:6.2f} {nc / n:6.2f}  cum {ct / n * 1e6:6.2f}  {name}")
    return "\n".join(lines)


SPENT: collections.Counter[str] = collections.Counter()


def install_stamps() -> float:
    """Wrap the core's protocol callbacks in timers (before any connection: uvloop binds
    them when a transport is made); what one wrapper costs (ns)."""
    from agent.net.client import ClientConn
    from agent.net.upconn import UpstreamConn

    spent = SPENT
    clock = time.perf_counter_ns

    def timed(cls: type, name: str) -> None:
        inner = getattr(cls, name)
        key = f"{cls.__name__}.{name}"

        def wrapper(self: Any, arg: Any) -> Any:
            t = clock()
            try:
                return inner(self, arg)
            finally:
                spent[key] += clock() - t

        setattr(cls, name, wrapper)

    def empty(arg: Any) -> Any:
        return arg

    def probe(arg: Any) -> Any:  # what a wrapper itself costs, measured the same way
        t = clock()
        try:
            return empty(arg)
        finally:
            spent["(wrapper)"] += clock() - t

    for cls, names in (
        (ClientConn, ("get_buffer", "buffer_updated", "data_received", "write")),
        (UpstreamConn, ("get_buffer", "buffer_updated", "data_received", "write")),
    ):
        for name in names:
            if name in cls.__dict__:
                timed(cls, name)
    for _ in range(100_000):
        probe(None)
    return spent.pop("(wrapper)") / 100_000


def stamps(proxy: Proxy, client: Client, n: int, rounds: int, wrapper_ns: float) -> str:
    """The time spent inside each of the core's protocol callbacks (perf_counter_ns around
    each, in the proxy's thread), against the thread's CPU: what the core's Python costs,
    and what is left to the loop and the kernel."""
    spent = SPENT
    lines = []
    for _ in range(rounds):
        spent.clear()
        t0 = proxy.call(time.thread_time_ns)
        client.run(n)
        t1 = proxy.call(time.thread_time_ns)
        total = (t1 - t0) / n / 1000
        parts = {k: v / n / 1000 for k, v in spent.items()}
        inside = sum(v for k, v in parts.items() if not k.endswith(".write"))
        detail = ", ".join(f"{k} {v:.1f}" for k, v in sorted(parts.items()))
        lines.append(
            (
                total,
                f"  thread {total:.1f}, in the callbacks {inside:.1f} ({detail}), "
                f"the rest (loop, kernel) {total - inside:.1f}",
            )
        )
    lines.sort()
    return "\n".join(
        [f"µs per request, rounds sorted by thread CPU (a wrapper's own {wrapper_ns:.0f} ns each)"]
        + [text for _, text in lines]
    )


def cpu(proxy: Proxy, client: Client, n: int, rounds: int) -> str:
    got = []
    for _ in range(rounds):
        t0 = proxy.call(time.thread_time_ns)
        client.run(n)
        t1 = proxy.call(time.thread_time_ns)
        got.append((t1 - t0) / n / 1000)
    got.sort()
    each = " ".join(f"{g:.1f}" for g in got)
    return f"proxy thread CPU per request (µs): best {got[0]:.1f}, median {got[len(got) // 2]:.1f} ({each})"


def interleaved(backend_port: int, n: int, rounds: int) -> str:
    """CPU per request of ours and of the Protocol relay, each in a thread of its own, the
    rounds taking turns (the machine's drift hits both alike)."""
    proxies = {name: Proxy(backend_port, name) for name in ("ours", "pyproto")}
    clients = {}
    for name, proxy in proxies.items():
        wait_until_listening(proxy.address)
        clients[name] = Client(proxy.address[1])
        clients[name].run(2000)
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in proxies}
    for _ in range(rounds):
        for name, proxy in proxies.items():
            t0 = proxy.call(thread_times)
            clients[name].run(n)
            t1 = proxy.call(thread_times)
            got[name].append(((t1[0] - t0[0]) / n * 1e6, (t1[1] - t0[1]) / n * 1e6))
    for client in clients.values():
        client.close()
    lines = [
        "CPU per request of the proxy's thread (µs): user + system, the rounds' best and median"
    ]
    best = {}
    for name, values in got.items():
        values.sort(key=sum)
        best[name] = values[0]
        med = values[len(values) // 2]
        each = " ".join(f"{sum(v):.1f}" for v in values)
        lines.append(
            f"  {name:8} best {values[0][0]:.1f} + {values[0][1]:.1f} = {sum(values[0]):.1f}, "
            f"median {med[0]:.1f} + {med[1]:.1f} = {sum(med):.1f}   ({each})"
        )
    u = best["ours"][0] - best["pyproto"][0]
    k = best["ours"][1] - best["pyproto"][1]
    lines.append(f"  ours - pyproto (best rounds): user {u:.1f}, system {k:.1f}")
    return "\n".join(lines)


def thread_times() -> tuple[float, float]:
    """This thread's user and system CPU time so far (s)."""
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime, r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5000, help="requests measured (per round)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", action="store_true")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--stamps", action="store_true", help="time inside each protocol callback")
    ap.add_argument(
        "--relay",
        choices=("ours", "pyproto", "both"),
        default="ours",
        help="what relays: the front's data path, bench_proxy's asyncio.Protocol relay, or "
        "both, interleaved round by round (CPU only)",
    )
    args = ap.parse_args()
    back_sock = listener()
    backend = spawn_activated(
        [sys.executable, str(HERE / "bench_proxy.py"), "--role", "backend"], back_sock
    )
    try:
        wait_until_listening(back_sock.getsockname())
        port = back_sock.getsockname()[1]
        wrapper_ns = install_stamps() if args.stamps else 0.0
        if args.relay == "both":
            print(interleaved(port, args.n, args.rounds))
            return 0
        proxy = Proxy(port, args.relay)
        wait_until_listening(proxy.address)
        client = Client(proxy.address[1])
        client.run(2000)  # warm-up: heads remembered, buffers pooled
        if args.calls:
            print(count_calls(proxy, client, min(args.n, 2000)))
        elif args.stamps:
            print(stamps(proxy, client, args.n, args.rounds, wrapper_ns))
        elif args.cprofile:
            print(cprofile(proxy, client, args.n))
        else:
            print(cpu(proxy, client, args.n, args.rounds))
        client.close()
    finally:
        stop([backend])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
