#!/usr/bin/env python3
"""What the asyncio I/O model costs the data path, before any HTTP logic.

Two bare relays that parse nothing, next to systemd-socket-proxyd and agent.net.proxy:
  coroutines: a relay on coroutines that wait on sockets (wait for readability,
              recv_into, sock_sendall, on both sockets), with no HTTP parsing or leases;
  protocols:  asyncio Protocols and transports (callbacks, sockets stay registered),
              the model the connection core (agent.net) is built on.
Each runs in its own process, with its listening socket as fd 3 like the others, in
front of the same raw-socket backend. Prints, per path, the p50 of a small keep-alive
request and the proxy process's CPU time per request. The difference between the two
bare relays is what the I/O model costs; agent.net.proxy minus the protocol relay is what
its HTTP handling costs. The last lines give that HTTP handling alone: the core's Python
per request, its callbacks driven in this process on transports that do no I/O (no
system calls, no event loop turns), for the front's site and for the router's.

    python3 bench/bench_io_models.py [--quick]

Prints only (a design measurement, not a target).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import time
from pathlib import Path

from bench_proxy import PROXYD, cpu_s, keep_alive_us, spawn_activated, wait_until_listening
from common import ROOT, listener

BENCH = Path(__file__).resolve()


async def wait_readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Wait until `sock` is readable, holding no buffer (a reader added and removed per wait)."""
    fut: asyncio.Future[None] = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_reader(sock.fileno())


async def _coroutine_relay(client: socket.socket, port: int) -> None:
    loop = asyncio.get_running_loop()
    up = socket.socket()
    up.setblocking(False)
    await loop.sock_connect(up, ("127.0.0.1", port))
    up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request, response = bytearray(65536), bytearray(65536)
    with client, up:
        while True:
            try:
                n = client.recv_into(request)
            except BlockingIOError:
                await wait_readable(loop, client)
                continue
            if not n:
                return
            await loop.sock_sendall(up, memoryview(request)[:n])
            await wait_readable(loop, up)
            m = await loop.sock_recv_into(up, response)
            await loop.sock_sendall(client, memoryview(response)[:m])


class _Upstream(asyncio.Protocol):
    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.write(data)


class _Client(asyncio.Protocol):
    def __init__(self, port: int) -> None:
        self.port = port
        self.up: asyncio.Transport | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        up, _ = await loop.create_connection(
            lambda: _Upstream(self.transport), "127.0.0.1", self.port
        )
        self.up = up
        for data in self.pending:
            up.write(data)

    def data_received(self, data: bytes) -> None:
        if self.up is None:
            self.pending.append(data)
        else:
            self.up.write(data)


def relay_main(model: str, port: int) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(fileno=3)
        sock.setblocking(False)
        if model == "protocols":
            await loop.create_server(lambda: _Client(port), sock=sock)
            await asyncio.Event().wait()
        tasks: set[asyncio.Task[None]] = set()
        while True:
            client, _ = await loop.sock_accept(sock)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(_coroutine_relay(client, port))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    asyncio.run(main())


def run(quick: bool) -> str:
    rounds, n = (3, 3000) if quick else (5, 10000)
    back = listener()
    port = back.getsockname()[1]
    py = sys.executable
    argv = {
        "proxyd": [PROXYD, "-c", "4096", f"127.0.0.1:{port}"],
        "coroutines": [py, str(BENCH), "--role", "coroutines", "--backend-port", str(port)],
        "protocols": [py, str(BENCH), "--role", "protocols", "--backend-port", str(port)],
        "agent.net.proxy": [
            py, str(BENCH.with_name("bench_proxy.py")), "--role", "ours",
            "--backend-port", str(port),
        ],
    }  # fmt: skip
    procs = [
        spawn_activated([py, str(BENCH.with_name("bench_proxy.py")), "--role", "backend"], back)
    ]
    socks = {name: listener() for name in argv}
    try:
        pids = {}
        for name, args in argv.items():
            procs.append(spawn_activated(args, socks[name]))
            pids[name] = procs[-1].pid
        for sock in socks.values():
            wait_until_listening(sock.getsockname())
        p50: dict[str, list[float]] = {name: [] for name in argv}
        cpu: dict[str, list[float]] = {name: [] for name in argv}
        for _ in range(rounds):  # interleaved, so drift on the machine hits all alike
            for name, sock in socks.items():
                keep_alive_us(sock.getsockname(), 200)
                before = cpu_s(pids[name])
                samples = keep_alive_us(sock.getsockname(), n // rounds)
                cpu[name].append((cpu_s(pids[name]) - before) / (n // rounds) * 1e6)
                p50[name].append(statistics.median(samples))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    lines = [
        f"asyncio I/O models on the data path — {time.strftime('%Y-%m-%d %H:%M')}, "
        f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, {n} keep-alive requests",
        "",
        f"{'':14}{'p50 (µs)':>10}{'CPU/request (µs)':>18}",
    ]
    for name in argv:
        lines.append(
            f"{name:14}{statistics.median(p50[name]):>10.0f}{statistics.median(cpu[name]):>18.0f}"
        )
    python = statistics.median(core_python_us(n) for _ in range(rounds))
    routing = statistics.median(router_python_us(n) for _ in range(rounds))
    lines += [
        "",
        f"agent.net, its Python alone (no I/O): {python:.0f} µs per request",
        f"the router on agent.net, its Python alone (no I/O): {routing:.0f} µs per request",
        "",
        "coroutines and protocols relay bytes and parse nothing; agent.net.proxy is the real path.",
    ]
    return "\n".join(lines) + "\n"


class Counting(asyncio.Transport):
    """A transport that does no I/O: it counts the writes it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes += 1

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def can_write_eof(self) -> bool:
        return True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def core_python_us(n: int) -> float:
    """CPU µs per keep-alive request of the core's own Python (ClientConn → Exchange →
    UpstreamConn), driven directly on transports that only count what they are given."""
    sys.path.insert(0, str(ROOT))
    from agent.net.answers import Style
    from agent.net.client import ClientConn
    from agent.net.site import FrontSite
    from agent.net.upconn import UpstreamConn
    from agent.net.upstream import Upstream
    from agent.spec.provider import Address

    class NoLease:
        def release(self) -> None:
            pass

    class Ready:
        slug = "bench"
        request_timeout_s = 300.0
        address = Address("127.0.0.1", 1)
        upstream = Upstream(4096, 100_000)

        def lease(self, path: str | None) -> NoLease:
            return NoLease()

        def alive(self, generation: int) -> bool:
            return True

        def waiting_for_start(self) -> int:
            return 0

        def ready_now(self) -> tuple[Address, int]:
            return self.address, 1

        async def ready(self, *, may_start: bool = True) -> tuple[Address, int]:
            return self.address, 1

    request = b"GET /small HTTP/1.1\r\nHost: bench\r\n\r\n"
    response = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"

    async def measure() -> float:
        backend = Ready()
        conn = ClientConn(FrontSite(backend), Style("bench"))
        client = Counting()
        conn.connection_made(client)
        up = UpstreamConn(1, "worker")
        up.connection_made(Counting())
        up.clean = True
        backend.upstream.keep(up, 1)

        def one() -> None:
            conn.get_buffer(-1)[: len(request)] = request
            conn.buffer_updated(len(request))
            up.get_buffer(-1)[: len(response)] = response
            up.buffer_updated(len(response))

        for _ in range(1000):
            one()
        t = time.process_time()
        for _ in range(n):
            one()
        took = time.process_time() - t
        assert client.writes == n + 1000, "a request went unanswered"
        return took / n * 1e6

    return asyncio.run(measure())


def router_python_us(n: int) -> float:
    """CPU µs per keep-alive request of the router's own Python (its site on the core: the
    Origin check, the JSON body's model, the lookup, the counting), driven as above: a
    POST naming its model, the provider's answer on a kept connection."""
    sys.path.insert(0, str(ROOT))
    from agent.net.client import ClientConn
    from agent.net.upconn import UpstreamConn
    from agent.router.router import Router, Table
    from agent.spec.provider import Address, Provider
    from agent.spec.settings import RouterConfig

    body = b'{"model": "bench", "messages": [{"role": "user", "content": "hello"}]}'
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    response = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    async def measure() -> float:
        provider = Provider(
            slug="bench",
            source=Path("/bench.toml"),
            addresses=(Address("127.0.0.1", 1),),
            model_names=("bench",),
        )
        router = Router(Table([provider]), RouterConfig(), [], exit_on_idle=False)
        conn = ClientConn(router.site, router.site.style())
        client = Counting()
        conn.connection_made(client)
        up = UpstreamConn(0, "provider")
        up.connection_made(Counting())
        up.clean = True
        router.site.pool("bench").keep(up, 0)

        def one() -> None:
            conn.get_buffer(-1)[: len(request)] = request
            conn.buffer_updated(len(request))
            up.get_buffer(-1)[: len(response)] = response
            up.buffer_updated(len(response))

        for _ in range(1000):
            one()
        t = time.process_time()
        for _ in range(n):
            one()
        took = time.process_time() - t
        assert client.writes == n + 1000, "a request went unanswered"
        if router._flush_timer is not None:
            router._flush_timer.cancel()
        return took / n * 1e6

    return asyncio.run(measure())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--role", choices=("coroutines", "protocols"), help=argparse.SUPPRESS)
    parser.add_argument("--backend-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        relay_main(args.role, args.backend_port)
        return 0
    print(run(args.quick), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
