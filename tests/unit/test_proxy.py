"""The data path on real loopback and unix sockets (agent.net.proxy).

The front is replaced by `FakeBackend` (leases counted, readiness gated by an event);
workers are small scripted asyncio servers; clients are raw sockets. Every test runs
in its own event loop under a hard deadline so a hang fails instead of blocking.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import tempfile
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from agent.net import sockio
from agent.net.proxy import Unavailable, serve_http, serve_tcp
from agent.net.upstream import Upstream
from agent.spec.provider import Address

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class FakeLease:
    def __init__(self, backend: FakeBackend, path: str | None) -> None:
        self.backend = backend
        self.path = path
        self.holding = path not in backend.ignore
        self.released = False
        if self.holding:
            backend.active += 1

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self.holding:
            self.backend.active -= 1


class FakeBackend:
    """The front's side of the contract: leases, readiness, the request timeout."""

    slug = "demo"

    def __init__(self, address: Address, request_timeout_s: float = 30.0) -> None:
        self.address = address
        self.generation = 1
        self.request_timeout_s = request_timeout_s
        self.ignore: tuple[str, ...] = ()
        self.keys_on = False  # API keys: the site strips them from what the worker gets
        self.leases: list[FakeLease] = []
        self.active = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.unavailable: Unavailable | None = None
        self.ready_cancelled = 0
        self.waiting = 0
        self.upstream = Upstream(limit=1000, max_waiting=1000)
        self.dead = False  # the worker is known to be gone: a refused connect is final

    def alive(self, generation: int) -> bool:
        return not self.dead

    def waiting_for_start(self) -> int:
        return self.waiting

    @property
    def paths(self) -> list[str | None]:
        return [lease.path for lease in self.leases]

    def strips_keys(self) -> bool:
        return self.keys_on

    def lease(self, path: str | None) -> FakeLease:
        lease = FakeLease(self, path)
        self.leases.append(lease)
        return lease

    async def ready(self, *, may_start: bool = True) -> tuple[Address, int]:
        self.waiting += 1
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.ready_cancelled += 1
            raise
        finally:
            self.waiting -= 1
        if self.unavailable is not None:
            raise self.unavailable
        return self.address, self.generation


class Worker:
    """A scripted worker: `handler` runs for each connection; connections are counted."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.address = Address("127.0.0.1", 0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def start(self, unix: str | None = None) -> Worker:
        if unix is not None:
            self.server = await asyncio.start_unix_server(self._handle, unix)
            self.address = Address(None, None, unix)
        else:
            self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            port = self.server.sockets[0].getsockname()[1]
            self.address = Address("127.0.0.1", port)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1):
                    await self.server.wait_closed()


class Proxy:
    """Accepts on a loopback or unix listener and runs serve_http/serve_tcp per connection."""

    def __init__(
        self, backend: FakeBackend, serve: Callable[..., Coroutine[Any, Any, None]]
    ) -> None:
        self.backend = backend
        self.serve = serve
        self.tasks: set[asyncio.Task[None]] = set()
        self.done: list[asyncio.Task[None]] = []
        self.listener: socket.socket | None = None
        self.accepting: asyncio.Task[None] | None = None
        self.unix: str | None = None

    async def start(self, unix: str | None = None) -> Proxy:
        if unix is not None:
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(unix)
            self.unix = unix
        else:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        sock.setblocking(False)
        self.listener = sock
        self.accepting = asyncio.create_task(self._accept())
        return self

    async def _accept(self) -> None:
        assert self.listener is not None
        loop = asyncio.get_running_loop()
        while True:
            client, _ = await loop.sock_accept(self.listener)
            task = asyncio.create_task(self.serve(client, self.backend))
            self.tasks.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.done.append(task)

    async def connect(self) -> Client:
        assert self.listener is not None
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX) if self.unix is not None else socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, self.listener.getsockname())
        return Client(sock)

    async def settle(self) -> None:
        """Wait until every connection task has ended; none may have raised."""
        async with asyncio.timeout(5):
            while self.tasks:
                await asyncio.sleep(0.005)
        for task in self.done:
            assert task.exception() is None

    async def stop(self) -> None:
        if self.accepting is not None:
            self.accepting.cancel()
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.listener is not None:
            self.listener.close()


class Client:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.buf = b""

    async def send(self, data: bytes) -> None:
        await self.loop.sock_sendall(self.sock, data)

    async def _more(self) -> bytes:
        data = await self.loop.sock_recv(self.sock, 65536)
        self.buf += data
        return data

    async def read_until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            if not await self._more():
                raise EOFError(f"EOF before {marker!r}; got {self.buf[:200]!r}")
        i = self.buf.index(marker) + len(marker)
        data, self.buf = self.buf[:i], self.buf[i:]
        return data

    async def read_exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not await self._more():
                raise EOFError(f"EOF after {len(self.buf)} of {n} bytes")
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    async def read_to_eof(self) -> bytes:
        while await self._more():
            pass
        data, self.buf = self.buf, b""
        return data

    async def response(self, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
        """One response: status, headers (lower-case names), body (raw for chunked)."""
        head = await self.read_until(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if method == "HEAD" or status in (204, 304) or status < 200:
            return status, headers, b""
        if "content-length" in headers:
            return status, headers, await self.read_exactly(int(headers["content-length"]))
        if headers.get("transfer-encoding") == "chunked":
            return status, headers, await self.read_until(b"0\r\n\r\n")
        return status, headers, await self.read_to_eof()

    async def eof(self) -> bool:
        """True if the proxy closed the connection (after any buffered bytes)."""
        async with asyncio.timeout(3):
            return not self.buf and not await self._more()

    def close(self) -> None:
        self.sock.close()


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(15):
            await test()

    asyncio.run(bounded())


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """Read one request (Content-Length or no body); returns (head, body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


def ok(body: bytes = b"ok", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def echo_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every request with `<method> <target> <body>`."""
    while True:
        try:
            head, body = await read_request(reader)
        except asyncio.IncompleteReadError:
            return
        line = head.split(b"\r\n")[0].rsplit(b" ", 1)[0]
        writer.write(ok(line + b" " + body))
        await writer.drain()


class Setup:
    def __init__(
        self, handler: Handler, serve: Callable[..., Coroutine[Any, Any, None]] = serve_http
    ) -> None:
        self.handler = handler
        self.serve = serve

    async def __aenter__(self) -> tuple[Worker, FakeBackend, Proxy]:
        self.worker = await Worker(self.handler).start()
        self.backend = FakeBackend(self.worker.address)
        self.proxy = await Proxy(self.backend, self.serve).start()
        return self.worker, self.backend, self.proxy

    async def __aexit__(self, *exc: object) -> None:
        await self.proxy.stop()
        self.backend.upstream.clear()
        await self.worker.stop()


# -- requests, keep-alive, leases ------------------------------------------------------


def test_keep_alive_reuses_one_worker_connection_and_leases_each_request() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (worker, backend, px):
            client = await px.connect()
            await client.send(b"GET /a?x=1 HTTP/1.1\r\nHost: h\r\n\r\n")
            assert await client.response() == (200, {"content-length": "11"}, b"GET /a?x=1 ")
            assert backend.active == 0  # released at the response's end
            await client.send(b"POST /b HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\nbody")
            assert (await client.response())[2] == b"POST /b body"
            assert backend.paths == ["/a", "/b"]
            assert all(lease.released for lease in backend.leases)
            assert worker.connections == 1
            # Idle keep-alive: open, no lease held, nothing new leased.
            await asyncio.sleep(0.05)
            assert backend.active == 0 and len(backend.leases) == 2 and len(px.tasks) == 1
            client.close()
            await px.settle()

    run(test)


def test_a_worker_connection_with_bytes_after_a_whole_response_is_not_kept() -> None:
    """A response that came whole in one read, with bytes after it that no request asked
    for: the client gets the response alone, and that worker connection serves no other."""

    async def trailing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok(b"first") + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray")
        await writer.drain()
        while True:
            await read_request(reader)
            writer.write(ok(b"again"))
            await writer.drain()

    async def test() -> None:
        async with Setup(trailing) as (worker, _backend, px):
            client = await px.connect()
            await client.send(b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n")
            assert await client.response() == (200, {"content-length": "5"}, b"first")
            await client.send(b"GET /b HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await client.response())[2] == b"first"  # a new worker connection's
            assert worker.connections == 2
            client.close()
            await px.settle()

    run(test)


async def head_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every request with its head as received, and its body."""
    while True:
        try:
            head, body = await read_request(reader)
        except asyncio.IncompleteReadError:
            return
        writer.write(ok(head + body))
        await writer.drain()


def test_with_keys_on_the_worker_never_sees_a_clients_key() -> None:
    async def test() -> None:
        async with Setup(head_worker) as (_worker, backend, px):
            backend.keys_on = True
            client = await px.connect()
            await client.send(
                b"POST /v1/x HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer pd-secret\r\n"
                b"X-Api-Key: pd-secret\r\nContent-Length: 2\r\n\r\nhi"
            )
            got = (await client.response())[2]
            assert got == b"POST /v1/x HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\n\r\nhi"
            # A body that arrives later takes the other path: the same head goes out.
            await client.send(
                b"POST /v1/y HTTP/1.1\r\nHost: h\r\nx-api-key: pd-secret\r\n"
                b"Content-Length: 3\r\n\r\n"
            )
            await asyncio.sleep(0.05)
            await client.send(b"abc")
            got = (await client.response())[2]
            assert got == b"POST /v1/y HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc"
            client.close()
            await px.settle()

    run(test)


def test_lease_is_held_exactly_while_the_request_is_in_flight() -> None:
    release = asyncio.Event()
    seen: list[int] = []

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
        await writer.drain()
        await release.wait()
        writer.write(b"cd")
        await writer.drain()
        await reader.read()

    async def test() -> None:
        async with Setup(slow) as (_, backend, px):
            client = await px.connect()
            await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            await client.read_until(b"ab")
            seen.append(backend.active)  # response begun, not ended
            release.set()
            assert await client.read_exactly(2) == b"cd"
            seen.append(backend.active)
            client.close()
            await px.settle()
        assert seen == [1, 0]

    run(test)


def test_ignored_path_gets_the_path_without_query_and_a_non_holding_lease() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            backend.ignore = ("/health",)
            client = await px.connect()
            await client.send(b"GET /health?verbose=1 HTTP/1.1\r\nHost: t\r\n\r\n")
            await client.response()
            assert backend.paths == ["/health"]
            assert not backend.leases[0].holding and backend.leases[0].released
            client.close()
            await px.settle()

    run(test)


def test_pipelined_requests_are_served_in_order() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (worker, backend, px):
            client = await px.connect()
            await client.send(
                b"GET /1 HTTP/1.1\r\nHost: t\r\n\r\n"
                b"POST /2 HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc"
                b"\r\n"  # a stray CRLF between requests is allowed
                b"GET /3 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
            )
            bodies = [(await client.response())[2] for _ in range(3)]
            assert bodies == [b"GET /1 ", b"POST /2 abc", b"GET /3 "]
            assert await client.eof()
            assert backend.paths == ["/1", "/2", "/3"] and backend.active == 0
            assert worker.connections == 1
            client.close()
            await px.settle()

    run(test)


def test_http10_client_without_keep_alive_is_closed_after_the_response() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            client = await px.connect()
            await client.send(b"GET / HTTP/1.0\r\n\r\n")
            assert (await client.response())[0] == 200
            assert await client.eof()
            client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


# -- bodies ------------------------------------------------------------------------------


CHUNKED_BODY = (
    b"4;ext=1\r\nWiki\r\n6\r\npedia \r\nE;a=b;c\r\nin \r\n\r\nchunks.\r\n0\r\nChecksum: abc\r\n\r\n"
)


def test_chunked_request_and_response_with_extensions_and_trailers_pass_unchanged() -> None:
    received: list[bytes] = []

    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if b"chunked" in head:
                received.append(await reader.readuntil(b"0\r\nChecksum: abc\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + CHUNKED_BODY)
            await writer.drain()

    async def test() -> None:
        async with Setup(chunked) as (_, backend, px):
            client = await px.connect()
            head = b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            # In pieces, so the body is still coming when the worker is reached.
            await client.send(head + CHUNKED_BODY[:10])
            await asyncio.sleep(0.05)
            await client.send(CHUNKED_BODY[10:])
            end = b"0\r\nChecksum: abc\r\n\r\n"
            assert (await client.read_until(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")
            assert await client.read_until(end) == CHUNKED_BODY
            assert received == [CHUNKED_BODY]
            # The framing ended where it should: the connection goes on.
            await client.send(b"GET /next HTTP/1.1\r\nHost: t\r\n\r\n")
            await client.read_until(b"\r\n\r\n")
            assert await client.read_until(end) == CHUNKED_BODY
            assert backend.paths == ["/c", "/next"] and backend.active == 0
            client.close()
            await px.settle()

    run(test)


def test_large_request_body_arrives_unchanged() -> None:
    payload = bytes(range(256)) * 4096 * 4  # 4 MiB

    async def digest(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, body = await read_request(reader)
        writer.write(ok(b"%d %d" % (len(body), hash(body))))
        await writer.drain()

    async def test() -> None:
        async with Setup(digest) as (_, backend, px):
            client = await px.connect()
            sending = asyncio.create_task(
                client.send(
                    b"PUT /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(payload)
                    + payload
                )
            )
            _, _, body = await client.response()
            await sending
            assert body == b"%d %d" % (len(payload), hash(payload))
            assert backend.active == 0
            client.close()
            await px.settle()

    run(test)


def test_expect_100_continue_is_relayed_before_the_body() -> None:
    async def continuing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"100-continue" in head
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        body = await reader.readexactly(5)
        writer.write(ok(body))
        await writer.drain()
        await reader.read()

    async def test() -> None:
        async with Setup(continuing) as (_, backend, px):
            client = await px.connect()
            await client.send(
                b"PUT /u HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
            )
            assert await client.read_until(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            await client.send(b"hello")
            assert await client.response() == (200, {"content-length": "5"}, b"hello")
            assert backend.active == 0
            client.close()
            await px.settle()

    run(test)


@pytest.mark.parametrize(
    ("method", "answer"),
    [
        ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"),
        ("GET", b"HTTP/1.1 204 No Content\r\n\r\n"),
        ("GET", b"HTTP/1.1 304 Not Modified\r\nContent-Length: 1000\r\n\r\n"),
        ("GET", b"HTTP/1.1 103 Early Hints\r\nLink: </s>\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n"),
    ],
)
def test_responses_without_a_body_keep_the_connection(method: str, answer: bytes) -> None:
    async def bodiless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            writer.write(answer if not head.startswith(b"GET /next") else ok())
            await writer.drain()

    async def test() -> None:
        async with Setup(bodiless) as (_, backend, px):
            client = await px.connect()
            await client.send(f"{method} / HTTP/1.1\r\nHost: t\r\n\r\n".encode())
            if answer.startswith(b"HTTP/1.1 103"):
                assert (await client.response())[0] == 103
            assert (await client.response(method))[0] in (200, 204, 304)
            await client.send(b"GET /next HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await client.response())[2] == b"ok"
            assert backend.active == 0 and len(backend.leases) == 2
            client.close()
            await px.settle()

    run(test)


def test_close_delimited_response_is_relayed_to_eof() -> None:
    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
        for i in range(50):
            writer.write(b"line %d\n" % i)
            await writer.drain()
        writer.close()

    async def test() -> None:
        async with Setup(closing) as (_, backend, px):
            client = await px.connect()
            await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            _, _, body = await client.response()
            assert body == b"".join(b"line %d\n" % i for i in range(50))
            client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


# -- failures ---------------------------------------------------------------------------


def test_unavailable_answers_503_json_with_retry_after_and_keeps_the_connection() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (worker, backend, px):
            backend.unavailable = Unavailable(
                503, "worker failed to start", retry_after_s=2.5, extra={"state": "failed"}
            )
            client = await px.connect()
            await client.send(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi")
            status, headers, body = await client.response()
            assert status == 503 and headers["retry-after"] == "3"
            assert "connection" not in headers
            assert json.loads(body) == {
                "error": "unavailable",
                "message": "worker failed to start",
                "provider": "demo",
                "retry_after_s": 2.5,
                "state": "failed",
            }
            # The body was read: the connection goes on.
            backend.unavailable = None
            await client.send(b"GET /y HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await client.response())[2] == b"GET /y "
            assert backend.active == 0 and worker.connections == 1
            client.close()
            await px.settle()

    run(test)


def test_unavailable_with_an_unread_body_closes_after_the_answer() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            backend.unavailable = Unavailable(503, "stopping", retry_after_s=None)
            client = await px.connect()
            await client.send(
                b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n" + b"x" * 1000
            )
            status, headers, body = await client.response()
            assert status == 503 and headers["connection"] == "close"
            assert "retry-after" not in headers
            assert json.loads(body)["retry_after_s"] is None
            assert await client.eof()
            client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_lease_refused_by_the_front_is_answered() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):

            def refuse(path: str | None) -> FakeLease:
                raise Unavailable(429, "too many requests held", retry_after_s=1)

            backend.lease = refuse  # type: ignore[method-assign]
            client = await px.connect()
            await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            status, headers, _ = await client.response()
            assert status == 429 and headers["retry-after"] == "1"
            client.close()
            await px.settle()

    run(test)


def test_worker_closing_before_the_response_gives_503() -> None:
    async def dying(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async def test() -> None:
        async with Setup(dying) as (_, backend, px):
            client = await px.connect()
            await client.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\nx")
            status, headers, body = await client.response()
            assert status == 503 and headers["retry-after"] == "1"
            assert "before answering" in json.loads(body)["message"]
            assert backend.active == 0
            client.close()
            await px.settle()

    run(test)


def test_worker_refusing_connections_gives_503() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (worker, backend, px):
            await worker.stop()
            backend.dead = True
            client = await px.connect()
            await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            status, _, body = await client.response()
            assert status == 503
            assert "does not accept connections" in json.loads(body)["message"]
            assert backend.active == 0
            client.close()
            await px.settle()

    run(test)


def test_worker_dying_in_the_middle_of_a_response_cuts_the_client() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        await writer.drain()
        writer.transport.abort()

    async def test() -> None:
        async with Setup(cut) as (_, backend, px):
            client = await px.connect()
            await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            data = await client.read_to_eof()
            assert data.endswith(b"\r\n\r\n0123456789")
            client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_malformed_worker_response_gives_502() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    async def test() -> None:
        async with Setup(garbage) as (_, backend, px):
            client = await px.connect()
            await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            status, headers, _ = await client.response()
            assert status == 502 and headers["connection"] == "close"
            client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_request_timeout_gives_504_and_the_connection_goes_on() -> None:
    stuck: list[bool] = []

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        if b"/slow" in head:
            stuck.append(True)
            await reader.read()  # never answers; notices the proxy hanging up
            return
        writer.write(ok())
        await writer.drain()
        await reader.read()

    async def test() -> None:
        async with Setup(mute) as (worker, backend, px):
            backend.request_timeout_s = 0.2
            client = await px.connect()
            await client.send(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
            status, _, body = await client.response()
            assert status == 504
            doc = json.loads(body)
            assert doc["error"] == "upstream_timeout"
            assert doc["message"] == "no response from the worker for 0.2 s (request_timeout_s)"
            assert backend.active == 0
            await client.send(b"GET /fast HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await client.response())[2] == b"ok"
            assert worker.connections == 2 and stuck == [True]
            client.close()
            await px.settle()

    run(test)


def test_request_timeout_after_the_response_began_closes() -> None:
    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345")
        await writer.drain()
        await reader.read()

    async def test() -> None:
        async with Setup(stalls) as (_, backend, px):
            backend.request_timeout_s = 0.2
            client = await px.connect()
            await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await client.read_to_eof()).endswith(b"\r\n\r\n12345")
            client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_bad_request_head_and_oversized_head() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            client = await px.connect()
            await client.send(b"GARBAGE\r\n\r\n")
            status, headers, body = await client.response()
            assert status == 400 and headers["connection"] == "close"
            assert json.loads(body)["provider"] == "demo"
            assert await client.eof()
            client.close()
            client = await px.connect()
            await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n" + b"X: " + b"y" * 70000)
            status, _, _ = await client.response()
            assert status == 431
            client.close()
            await px.settle()
            assert backend.leases == []

    run(test)


# -- waiting for the worker ------------------------------------------------------------


def test_held_request_is_served_once_ready_and_dropped_if_the_client_leaves() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (worker, backend, px):
            backend.gate.clear()
            held = await px.connect()
            leaving = await px.connect()
            await held.send(b"GET /held HTTP/1.1\r\nHost: t\r\n\r\n")
            await leaving.send(b"GET /leaving HTTP/1.1\r\nHost: t\r\n\r\n")
            async with asyncio.timeout(2):
                while backend.waiting < 2:
                    await asyncio.sleep(0.005)
            assert backend.active == 2
            leaving.close()  # gives up while the worker loads
            async with asyncio.timeout(2):
                while backend.ready_cancelled < 1:
                    await asyncio.sleep(0.005)
            assert backend.active == 1
            backend.gate.set()
            assert (await held.response())[2] == b"GET /held "
            assert backend.active == 0 and worker.connections == 1
            held.close()
            await px.settle()

    run(test)


def test_new_worker_generation_gets_a_new_worker_connection() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (worker, backend, px):
            client = await px.connect()
            await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            await client.response()
            backend.generation += 1
            await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            await client.response()
            assert worker.connections == 2
            client.close()
            await px.settle()

    run(test)


def test_worker_connection_closed_between_requests_is_replaced() -> None:
    async def one_shot(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok())  # says keep-alive, then hangs up anyway (its idle timeout)
        await writer.drain()

    async def test() -> None:
        async with Setup(one_shot) as (worker, _, px):
            client = await px.connect()
            for _ in range(3):
                await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
                assert (await client.response())[0] == 200
                await asyncio.sleep(0.02)
            assert worker.connections == 3
            client.close()
            await px.settle()

    run(test)


def test_backend_error_never_escapes_and_releases_the_lease() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):

            async def broken() -> tuple[Address, int]:
                raise RuntimeError("bug")

            backend.ready = broken  # type: ignore[method-assign]
            client = await px.connect()
            await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            assert await client.eof()
            client.close()
            await px.settle()  # asserts no task raised
            assert backend.active == 0 and backend.leases[0].released

    run(test)


# -- streams: half-close, backpressure, upgrade, unix, tcp -------------------------------


def test_http_client_half_close_is_passed_on_and_the_response_still_arrives() -> None:
    saw_eof: list[bool] = []

    async def answers_after_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        saw_eof.append(await reader.read() == b"")
        writer.write(ok(b"late"))
        await writer.drain()

    async def test() -> None:
        async with Setup(answers_after_eof) as (_, backend, px):
            client = await px.connect()
            await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            await asyncio.sleep(0.05)
            client.sock.shutdown(socket.SHUT_WR)
            assert (await client.response())[2] == b"late"
            assert await client.eof()
            assert saw_eof == [True]
            client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_slow_reader_keeps_the_proxy_buffer_bounded() -> None:
    total = 32 * 1024 * 1024
    written = [0]

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        chunk = b"z" * 65536
        for _ in range(total // len(chunk)):
            writer.write(chunk)
            await writer.drain()
            written[0] += len(chunk)
        await reader.read()

    async def test() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            worker = await Worker(big).start(unix=str(Path(tmp) / "w.sock"))
            backend = FakeBackend(worker.address)
            px = await Proxy(backend, serve_http).start(unix=str(Path(tmp) / "p.sock"))
            try:
                client = await px.connect()
                await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
                # The client reads nothing: the worker must stall soon.
                last = -1
                while written[0] != last:
                    last = written[0]
                    await asyncio.sleep(0.1)
                # Worker socket buffer + proxy buffer + client socket buffer, nothing more.
                assert written[0] < 4 * 1024 * 1024
                assert backend.active == 1
                got = 0
                head = await client.read_until(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200")
                got = len(client.buf)
                client.buf = b""
                while got < total:
                    got += len(await client.loop.sock_recv(client.sock, 1 << 20))
                assert got == total
                client.close()
                await px.settle()
                assert backend.active == 0
            finally:
                await px.stop()
                backend.upstream.clear()
                await worker.stop()

    run(test)


def test_upgrade_becomes_a_tunnel_that_keeps_its_lease_past_the_request_timeout() -> None:
    async def websocket(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
            b"hello"
        )
        await writer.drain()
        while data := await reader.read(1024):
            writer.write(data.upper())
            await writer.drain()
        writer.write(b"BYE")
        await writer.drain()

    async def test() -> None:
        async with Setup(websocket) as (_, backend, px):
            backend.request_timeout_s = 0.1
            client = await px.connect()
            await client.send(
                b"GET /ws HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\nearly"
            )
            assert (await client.read_until(b"\r\n\r\n")).startswith(b"HTTP/1.1 101")
            assert await client.read_exactly(5) == b"hello"
            assert await client.read_exactly(5) == b"EARLY"
            await asyncio.sleep(0.3)  # past the request timeout
            await client.send(b"frame")
            assert await client.read_exactly(5) == b"FRAME"
            assert backend.active == 1
            client.sock.shutdown(socket.SHUT_WR)
            assert await client.read_to_eof() == b"BYE"
            client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_unix_sockets_on_both_sides() -> None:
    async def test() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            worker = await Worker(echo_worker).start(unix=str(Path(tmp) / "w.sock"))
            backend = FakeBackend(worker.address)
            px = await Proxy(backend, serve_http).start(unix=str(Path(tmp) / "p.sock"))
            try:
                client = await px.connect()
                await client.send(b"GET /u HTTP/1.1\r\nHost: t\r\n\r\n")
                assert (await client.response())[2] == b"GET /u "
                client.close()
                await px.settle()
            finally:
                await px.stop()
                backend.upstream.clear()
                await worker.stop()

    run(test)


async def tcp_echo_then_bye(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.write(b"bye")
    await writer.drain()


def test_tcp_relay_half_close_and_one_lease_per_connection() -> None:
    async def test() -> None:
        async with Setup(tcp_echo_then_bye, serve_tcp) as (_, backend, px):
            client = await px.connect()
            payload = bytes(range(256)) * 8192  # 2 MiB
            sending = asyncio.create_task(client.send(payload))
            received = await client.read_exactly(len(payload))
            await sending
            assert received == payload
            assert backend.active == 1 and backend.paths == [None]
            client.sock.shutdown(socket.SHUT_WR)
            assert await client.read_to_eof() == b"bye"
            client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_tcp_unavailable_closes_and_gone_client_releases() -> None:
    async def test() -> None:
        async with Setup(tcp_echo_then_bye, serve_tcp) as (_, backend, px):
            backend.unavailable = Unavailable(503, "failed")
            client = await px.connect()
            assert await client.eof()
            client.close()
            backend.unavailable = None
            backend.gate.clear()
            client = await px.connect()
            async with asyncio.timeout(2):
                while backend.waiting < 1:
                    await asyncio.sleep(0.005)
            client.close()
            await px.settle()
            assert backend.active == 0 and backend.ready_cancelled == 1

    run(test)


def test_idle_connections_hold_no_buffer() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (_, _, px):
            sockio.pools[sockio.HEAD_SIZE].clear()
            clients = [await px.connect() for _ in range(20)]
            for client in clients:
                await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
                await client.response()
            await asyncio.sleep(0.05)
            # Every buffer went back to the pool: had the idle connections kept theirs, the
            # emptied pool would have nothing in it now.
            assert sockio.pools[sockio.HEAD_SIZE]
            for client in clients:
                client.close()
            await px.settle()

    run(test)


def test_client_leaving_in_the_middle_of_a_response_closes_the_worker_connection() -> None:
    worker_saw_close = asyncio.Event()

    async def streaming(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            # A long generation, one token every 10 ms, until the connection fails (drain
            # raises) or is closed (the loop may close it between two tokens).
            while not writer.is_closing():
                writer.write(b"5\r\ntoken\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            pass
        worker_saw_close.set()

    async def test() -> None:
        async with Setup(streaming) as (_, backend, px):
            client = await px.connect()
            await client.send(
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n"
            )
            await client.read_until(b"token\r\n")
            assert backend.active == 1
            client.close()
            async with asyncio.timeout(3):
                await worker_saw_close.wait()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_cancelling_the_connection_task_releases_the_lease_and_closes() -> None:
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()

    async def test() -> None:
        async with Setup(mute) as (_, backend, px):
            client = await px.connect()
            await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            async with asyncio.timeout(2):
                while backend.active != 1:
                    await asyncio.sleep(0.005)
            (task,) = px.tasks
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert task.cancelled()
            assert backend.active == 0
            assert await client.eof()
            client.close()

    run(test)


def test_a_worker_connection_left_mid_response_by_a_cancellation_is_not_kept() -> None:
    """A request cancelled from outside (a release cancels connection tasks) leaves its
    answer on the way: kept, that connection would hand it to the next client."""

    async def slow_then_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, _ = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            target = head.split(b" ")[1]
            if target == b"/slow":
                await asyncio.sleep(0.3)
            writer.write(ok(target))
            await writer.drain()

    async def test() -> None:
        async with Setup(slow_then_echo) as (_, backend, px):
            first = await px.connect()
            await first.send(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
            async with asyncio.timeout(2):
                while backend.active != 1:
                    await asyncio.sleep(0.005)
            (task,) = px.tasks
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            first.close()
            second = await px.connect()
            await second.send(b"GET /fast HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await second.response())[:3:2] == (200, b"/fast")
            second.close()

    run(test)


def test_held_request_gets_503_when_the_start_fails() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            backend.gate.clear()
            client = await px.connect()
            await client.send(b"GET /held HTTP/1.1\r\nHost: t\r\n\r\n")
            async with asyncio.timeout(2):
                while backend.waiting < 1:
                    await asyncio.sleep(0.005)
            backend.unavailable = Unavailable(503, "worker exited with status 1", retry_after_s=4)
            backend.gate.set()
            status, headers, body = await client.response()
            assert status == 503 and headers["retry-after"] == "4"
            assert json.loads(body)["message"] == "worker exited with status 1"
            assert backend.active == 0
            client.close()
            await px.settle()

    run(test)


def test_held_requests_give_their_buffers_back_while_they_wait() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            backend.gate.clear()
            sockio.pools[sockio.HEAD_SIZE].clear()
            clients = [await px.connect() for _ in range(20)]
            for i, client in enumerate(clients):
                await client.send(
                    b"POST /p%d HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nbody%d"
                    % (i, i % 10)
                    + b"GET /after HTTP/1.1\r\nHost: t\r\n\r\n"  # pipelined behind it
                )
            async with asyncio.timeout(2):
                while backend.waiting < 20:
                    await asyncio.sleep(0.005)
            # Had any held connection kept its buffer, the emptied pool would still be empty.
            assert sockio.pools[sockio.HEAD_SIZE]
            backend.gate.set()
            for i, client in enumerate(clients):
                assert (await client.response())[2] == b"POST /p%d body%d" % (i, i % 10)
                assert (await client.response())[2] == b"GET /after "
                client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_requests_in_flight_hold_no_buffer_while_the_worker_works() -> None:
    go = asyncio.Event()
    arrived = [0]

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, body = await read_request(reader)
        arrived[0] += 1
        await go.wait()  # a long generation
        writer.write(ok(body))
        await writer.drain()
        await reader.read()

    async def test() -> None:
        async with Setup(slow) as (_, backend, px):
            sockio.pools[sockio.HEAD_SIZE].clear()
            clients = [await px.connect() for _ in range(20)]
            for i, client in enumerate(clients):
                await client.send(
                    b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nr%02d" % i
                )
            async with asyncio.timeout(2):
                while arrived[0] < 20:
                    await asyncio.sleep(0.005)
            assert backend.active == 20
            # Had any request in flight kept a buffer, the emptied pool would be empty.
            assert sockio.pools[sockio.HEAD_SIZE]
            go.set()
            for i, client in enumerate(clients):
                assert (await client.response())[2] == b"r%02d" % i
                client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


# -- what a client may take ------------------------------------------------------------


def test_a_head_not_complete_within_the_header_timeout_gets_408(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sockio, "HEADER_TIMEOUT_S", 0.3)

    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            client = await px.connect()
            await client.send(b"G")  # and nothing more
            status, headers, _ = await client.response()
            assert status == 408 and headers["connection"] == "close"
            assert await client.eof()
            client.close()
            silent = await px.connect()  # a connection that never sends a byte
            assert await silent.eof()
            silent.close()
            await px.settle()
            assert backend.leases == []

    run(test)


def test_a_later_head_that_comes_in_parts_is_timed_from_its_first_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A head that arrives whole arms no header timer; one that arrives in parts on a kept
    connection does: completed within the limit it is served, left incomplete it gets 408."""
    monkeypatch.setattr(sockio, "HEADER_TIMEOUT_S", 0.4)

    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            client = await px.connect()
            for _ in range(3):  # whole heads, spaced past the header timeout in all
                await client.send(b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n")
                assert (await client.response())[0] == 200
                await asyncio.sleep(0.2)
            await client.send(b"GET /b HTT")
            await asyncio.sleep(0.2)
            await client.send(b"P/1.1\r\nHost: t\r\n\r\n")
            assert (await client.response())[2] == b"GET /b "
            await asyncio.sleep(0.3)  # idle, with no head begun: no 408
            await client.send(b"GET /c")  # and nothing more
            loop = asyncio.get_running_loop()
            began = loop.time()
            status, headers, _ = await client.response()
            assert status == 408 and headers["connection"] == "close"
            assert 0.3 <= loop.time() - began < 2.0
            assert await client.eof()
            client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_a_bare_lf_head_before_a_crlf_one_is_refused_and_nothing_reaches_the_worker() -> None:
    """A client's blank line of bare LFs ahead of a CRLF one: wherever the head is taken to
    end, the front answers 400 and closes, so the worker never reads a second request."""

    async def test() -> None:
        async with Setup(echo_worker) as (worker, backend, px):
            for head in (
                b"GET /a HTTP/1.1\nHost: t\n\nGET /b HTTP/1.1\r\nHost: t\r\n\r\n",
                b"GET /a HTTP/1.1\r\nHost: t\n\r\nGET /b HTTP/1.1\r\nHost: t\r\n\r\n",
            ):
                client = await px.connect()
                await client.send(head)
                status, headers, _ = await client.response()
                assert status == 400 and headers["connection"] == "close"
                assert await client.eof()
                client.close()
            await px.settle()
            assert worker.connections == 0 and backend.leases == []

    run(test)


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sockio, "KEEPALIVE_TIMEOUT_S", 0.3)

    async def test() -> None:
        async with Setup(echo_worker) as (_, _backend, px):
            client = await px.connect()
            await client.send(b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await client.response())[0] == 200
            assert await client.eof()  # closed without an answer
            client.close()
            await px.settle()

    run(test)


def test_a_body_that_stops_coming_gets_408_and_releases_its_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sockio, "BODY_TIMEOUT_S", 0.3)

    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            client = await px.connect()
            await client.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\n123")
            status, _, _ = await client.response()
            assert status == 408
            assert await client.eof()
            client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_a_stream_longer_than_the_request_timeout_arrives_whole() -> None:
    """request_timeout_s limits inactivity, not the whole response: a token stream that
    keeps producing runs as long as it needs (it was cut at the deadline, without its last
    chunk)."""

    async def streaming(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(12):
            await asyncio.sleep(0.05)
            writer.write(b"2\r\n%02d\r\n" % i)
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def test() -> None:
        async with Setup(streaming) as (_, backend, px):
            backend.request_timeout_s = 0.2  # the stream runs 0.6 s
            client = await px.connect()
            await client.send(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
            status, _, body = await client.response()
            assert status == 200
            assert body == b"".join(b"2\r\n%02d\r\n" % i for i in range(12)) + b"0\r\n\r\n"
            client.close()
            await px.settle()

    run(test)


def test_a_request_line_longer_than_the_head_limit_gets_414() -> None:
    async def test() -> None:
        async with Setup(echo_worker) as (_, _backend, px):
            client = await px.connect()
            await client.send(b"GET /" + b"a" * 70000)
            status, _, _ = await client.response()
            assert status == 414
            client.close()
            await px.settle()

    run(test)


def test_a_worker_that_refuses_for_a_moment_is_retried_while_it_runs() -> None:
    async def test() -> None:
        worker = await Worker(echo_worker).start()
        address = worker.address
        await worker.stop()  # the port refuses connections for now
        backend = FakeBackend(address)
        px = await Proxy(backend, serve_http).start()
        client = await px.connect()
        await client.send(b"GET /late HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.sleep(0.3)
        assert address.port is not None

        async def echo_then_close(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                await echo_worker(r, w)
            finally:
                w.close()

        server = await asyncio.start_server(echo_then_close, "127.0.0.1", address.port)
        status, _, body = await client.response()
        assert (status, body) == (200, b"GET /late ")
        client.close()
        await px.settle()
        await px.stop()
        backend.upstream.clear()
        server.close()
        await server.wait_closed()
        await asyncio.sleep(0.05)  # the handler sees the EOF and closes its side

    run(test)


def test_requests_beyond_max_concurrency_wait_their_turn_in_order() -> None:
    """Deterministic: arrival order is made, not hoped for. The first two requests take the
    two slots at once and go to the worker on two connections, which the worker may read in
    either order (each connect and each connection's first read race the other's): so each
    is sent only once the worker has the one before. Each later one is sent only once the
    one before waits in the front's queue. The worker answers one request at a time, each
    only once the previous answer's slot has gone to the next request (two slots freed in
    one turn would send two requests on two connections at once)."""
    order: list[bytes] = []
    open_now = [0]
    peak = [0]
    answer = asyncio.Semaphore(0)  # one release: one answer goes

    async def counting(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        open_now[0] += 1
        peak[0] = max(peak[0], open_now[0])
        try:
            while True:
                try:
                    head, _ = await read_request(reader)
                except asyncio.IncompleteReadError:
                    return
                order.append(head.split(b" ")[1])
                await answer.acquire()
                writer.write(ok())
                await writer.drain()
        finally:
            open_now[0] -= 1

    async def until(check: Callable[[], bool]) -> None:
        async with asyncio.timeout(2):
            while not check():
                await asyncio.sleep(0.001)

    async def test() -> None:
        async with Setup(counting) as (_, backend, px):
            backend.upstream = Upstream(limit=2, max_waiting=100)
            clients = []
            for i in range(10):
                client = await px.connect()
                await client.send(b"GET /%d HTTP/1.1\r\nHost: t\r\n\r\n" % i)
                clients.append(client)
                if i < 2:
                    await until(lambda i=i: len(order) == i + 1)  # it is at the worker
                else:
                    await until(lambda i=i: backend.upstream.waiting == i - 1)  # it waits
            for k in range(10):
                answer.release()
                await until(lambda k=k: len(order) == min(10, k + 3))  # the next one went
            for client in clients:
                assert (await client.response())[0] == 200
                client.close()
            await px.settle()
            assert backend.upstream.in_use == 0 and backend.active == 0

    run(test)
    assert peak[0] == 2
    assert order == [b"/%d" % i for i in range(10)]


class ReadyBackend(FakeBackend):
    """With the front's fast path: the worker's target at once while the gate is open."""

    def ready_now(self) -> tuple[Address, int] | None:
        return (self.address, self.generation) if self.gate.is_set() else None


def test_a_request_that_finds_no_slot_is_not_overtaken_by_one_that_arrives_in_the_same_turn() -> (
    None
):
    """Regression: with the worker ready and its one slot taken, A's head, the end of the
    answer that held the slot and C's head came in one turn of the loop; A's place in the
    queue was to be taken by its task, which had not run yet, so C found the slot free and
    went first. Deterministic: the three are written to the kernel with no await between,
    so one poll of the loop returns them in that order."""
    order: list[bytes] = []
    writers: list[asyncio.StreamWriter] = []

    async def holding(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, _ = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            order.append(head.split(b" ")[1])
            writers.append(writer)  # answered by the test

    async def until(check: Callable[[], bool]) -> None:
        async with asyncio.timeout(2):
            while not check():
                await asyncio.sleep(0.001)

    async def test() -> None:
        async with Setup(holding) as (worker, _, px):
            backend = px.backend = ReadyBackend(worker.address)
            backend.upstream = Upstream(limit=1, max_waiting=100)
            x = await px.connect()
            await x.send(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n")
            await until(lambda: len(writers) == 1)  # X holds the slot
            a, c = await px.connect(), await px.connect()
            await until(lambda: len(px.tasks) == 3)
            await asyncio.sleep(0.01)  # both connections are being read
            a.sock.send(b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n")
            os.write(writers[0].get_extra_info("socket").fileno(), ok())  # X's slot frees
            c.sock.send(b"GET /c HTTP/1.1\r\nHost: t\r\n\r\n")
            await until(lambda: len(order) == 2)
            writers[1].write(ok())
            await until(lambda: len(order) == 3)
            writers[2].write(ok())
            for client in (x, a, c):
                assert (await client.response())[0] == 200
                client.close()
            await px.settle()
            assert backend.upstream.in_use == 0 and backend.upstream.waiting == 0
            assert backend.active == 0

    run(test)
    assert order == [b"/x", b"/a", b"/c"]


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n5\r\n",
        b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5, 5\r\n\r\nhello",
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer_Encoding: chunked\r\nContent-Length: 5\r\n\r\nhello",
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5;a\rb\r\nhello\r\n0\r\n\r\n",
        b"GET / HTTP/1.1\nHost: t\n\n",
    ],
)
def test_ambiguous_framing_is_refused_before_the_worker_sees_a_byte(request_bytes: bytes) -> None:
    """Regression: with `chunked, chunked` the worker read a 0-length body, then `5\\r\\n` as
    the next request, past the front's lease."""
    seen: list[bytes] = []

    async def recording(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.read())

    async def test() -> None:
        async with Setup(recording) as (_, backend, px):
            client = await px.connect()
            await client.send(request_bytes)
            status, headers, _ = await client.response()
            assert status == 400 and headers["connection"] == "close"
            assert await client.eof()
            client.close()
            await px.settle()
            assert backend.active == 0

    run(test)
    assert seen in ([], [b""])


def test_a_worker_connection_whose_request_said_close_is_not_kept_for_another_client() -> None:
    """Regression (container tier, urllib clients): a request with `Connection: close`
    makes the worker close after answering, without saying so; kept for the next client's
    POST, that connection failed under it (503)."""

    async def closing_quietly(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _head, body = await read_request(reader)
        writer.write(ok(body))
        await writer.drain()
        await asyncio.sleep(0.05)  # closes a moment later, as a threaded server does
        writer.close()

    async def test() -> None:
        async with Setup(closing_quietly) as (worker, _backend, px):
            for i in range(3):
                client = await px.connect()
                await client.send(
                    b"POST / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
                    b"Content-Length: 1\r\n\r\n%d" % i
                )
                assert (await client.response())[:3:2] == (200, b"%d" % i)
                client.close()
            assert worker.connections == 3
            await px.settle()

    run(test)


# -- the request gate, the answers' one shape, the task-free keep-alive path -------------


def test_the_request_gate_answers_before_anything_is_leased_or_connected() -> None:
    """The gate (the place for API-key checks) sees every parsed head first: a refusal is
    answered with its own status and code, takes no lease and reaches no worker."""
    from agent.net.answers import Answer
    from agent.net.http import RequestHead

    seen: list[str] = []

    def gate(req: RequestHead) -> Answer | None:
        seen.append(req.target)
        if dict((k.lower(), v) for k, v in req.headers).get("authorization") != "Bearer k":
            return Answer(401, "a valid API key is required", "invalid_api_key")
        return None

    async def test() -> None:
        async with Setup(echo_worker) as (worker, backend, px):
            backend.request_gate = gate  # type: ignore[attr-defined]
            client = await px.connect()
            await client.send(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi")
            status, headers, body = await client.response()
            assert status == 401 and headers["content-type"] == "application/json"
            assert json.loads(body) == {
                "error": "invalid_api_key",
                "message": "a valid API key is required",
                "provider": "demo",
                "retry_after_s": None,
            }
            assert backend.leases == [] and worker.connections == 0
            # Its body was read: the connection goes on, and a good key passes.
            await client.send(b"GET /y HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer k\r\n\r\n")
            assert (await client.response())[2] == b"GET /y "
            assert seen == ["/x", "/y"] and backend.paths == ["/y"]
            client.close()
            await px.settle()

    run(test)


def test_answers_made_up_here_carry_a_stable_code_and_a_sentence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sockio, "HEADER_TIMEOUT_S", 0.2)

    async def test() -> None:
        async with Setup(echo_worker) as (_, _backend, px):
            client = await px.connect()
            await client.send(b"GET / HTTP/1.1\r\nHost: t\r\nContent-Length: 5, 5\r\n\r\n")
            status, _, body = await client.response()
            assert status == 400
            assert json.loads(body)["error"] == "bad_request"
            assert "Content-Length" in json.loads(body)["message"]
            client.close()
            client = await px.connect()
            await client.send(b"GET / HTTP/1.1\r\nHo")
            status, _, body = await client.response()
            assert (status, json.loads(body)["error"]) == (408, "request_timeout")
            assert json.loads(body)["message"] == "request head not complete within 0.2 s"
            client.close()
            await px.settle()

    run(test)


def test_keep_alive_requests_to_a_ready_worker_make_no_task() -> None:
    """With the worker ready (`ready_now`) and its connection kept, a request runs in the
    callbacks that bring its bytes: the loop is asked for no task."""

    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            backend.ready_now = lambda: (backend.address, backend.generation)  # type: ignore[attr-defined]
            client = await px.connect()
            await client.send(b"GET /warm HTTP/1.1\r\nHost: t\r\n\r\n")
            await client.response()  # the worker connection is made (a task) and kept
            loop = asyncio.get_running_loop()
            made: list[object] = []
            create = loop.create_task

            def counting(coro: Any, **kw: Any) -> asyncio.Task[Any]:
                made.append(coro)
                return create(coro, **kw)

            loop.create_task = counting  # type: ignore[method-assign]
            try:
                for i in range(20):
                    await client.send(b"GET /%d HTTP/1.1\r\nHost: t\r\n\r\n" % i)
                    assert (await client.response())[2] == b"GET /%d " % i
            finally:
                loop.create_task = create  # type: ignore[method-assign]
            assert made == []
            client.close()
            await px.settle()

    run(test)


def test_a_worker_that_answers_before_the_body_ends_keeps_no_half_read_connection() -> None:
    """A worker may refuse a body before it has all of it (413): that connection holds the
    rest of the body, which it would read as the next request; it is never kept."""

    async def early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"POST"):
            writer.write(b"HTTP/1.1 413 Content Too Large\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            await reader.read()
            return
        writer.write(ok(b"fresh"))
        await writer.drain()

    async def test() -> None:
        async with Setup(early) as (worker, backend, px):
            client = await px.connect()
            await client.send(b"POST /u HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\nab")
            assert (await client.response())[0] == 413
            assert await client.eof()
            client.close()
            second = await px.connect()
            await second.send(b"GET /g HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await second.response())[2] == b"fresh"
            assert worker.connections == 2  # a new one, not the half-read one
            second.close()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_a_malformed_chunk_after_the_head_gets_400_and_releases_the_lease() -> None:
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async def test() -> None:
        async with Setup(swallow) as (_, backend, px):
            client = await px.connect()
            await client.send(b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
            async with asyncio.timeout(2):
                while backend.active != 1:
                    await asyncio.sleep(0.005)
            await client.send(b"5 ;x\r\nhello\r\n0\r\n\r\n")  # a space in the size line
            status, _, body = await client.response()
            assert status == 400 and "chunk size" in json.loads(body)["message"]
            assert await client.eof()
            client.close()
            await px.settle()
            assert backend.active == 0

    run(test)


def test_a_tunnel_whose_worker_half_closes_first_ends_when_the_client_does() -> None:
    """Both directions end on their own: the worker's EOF goes to the client, the client's
    later EOF closes the tunnel and releases its lease, though the worker never closes."""
    hold = asyncio.Event()

    async def half_closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: Upgrade\r\n\r\n"
        )
        writer.write_eof()  # done sending, still reading
        await writer.drain()
        await hold.wait()

    async def test() -> None:
        async with Setup(half_closing) as (_, backend, px):
            client = await px.connect()
            await client.send(
                b"GET /t HTTP/1.1\r\nHost: t\r\nUpgrade: x\r\nConnection: Upgrade\r\n\r\n"
            )
            assert (await client.read_until(b"\r\n\r\n")).startswith(b"HTTP/1.1 101")
            assert await client.read_to_eof() == b""  # the worker's EOF, passed on
            assert backend.active == 1
            client.sock.shutdown(socket.SHUT_WR)
            await px.settle()
            assert backend.active == 0
            client.close()
            hold.set()

    run(test)


def test_a_worker_connection_kept_after_a_slow_reader_still_reads_the_next_response() -> None:
    """A response that ends while the client's side is full pauses the worker connection;
    kept for the next request, it must read again (else that request waits for its 504)."""
    # Reads are 64 KiB, then 256 KiB (sockio): sizes whose last read is nearly a full one
    # end the response with the client's side over its high-water mark.
    head = len(b"HTTP/1.1 200 OK\r\nContent-Length: 4000000\r\n\r\n")
    sizes = [(64 + 4 * 256 + last) * 1024 - head for last in range(256, 0, -32)]

    async def sized(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        left = list(sizes)
        while True:
            head, _ = await read_request(reader)
            if head.startswith(b"GET /n "):
                writer.write(ok(b"next"))
                continue
            size = left.pop(0)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
            writer.write(b"z" * size)
            await writer.drain()

    async def test() -> None:
        async with Setup(sized) as (worker, _backend, px):
            assert px.listener is not None
            # Small socket buffers on both ends of the client's connection: what the client
            # does not read stays in the proxy's own write buffer.
            px.listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow, small reader
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, px.listener.getsockname())
            client = Client(sock)
            for size in sizes:
                await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
                await asyncio.sleep(0.05)  # the client's side fills up: reading pauses
                head = await client.read_until(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200")
                got, client.buf = len(client.buf), b""
                while got < size:
                    got += len(await client.loop.sock_recv(client.sock, 65536))
                assert got == size
                async with asyncio.timeout(3):
                    await client.send(b"GET /n HTTP/1.1\r\nHost: t\r\n\r\n")
                    assert await client.response() == (200, {"content-length": "4"}, b"next")
            assert worker.connections == 1
            client.close()

    run(test)


def test_a_lease_that_fails_to_release_still_ends_the_connection() -> None:
    """A failing release as the client goes must not leave the connection counted open."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async def test() -> None:
        async with Setup(silent) as (_, backend, px):

            def failing(self: FakeLease) -> None:
                FakeLease.release(self)
                raise RuntimeError("bug")

            client = await px.connect()
            await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            async with asyncio.timeout(3):
                while not backend.leases:
                    await asyncio.sleep(0.005)
            lease = backend.leases[0]
            lease.release = failing.__get__(lease)  # type: ignore[method-assign]
            client.close()
            await px.settle()
            assert lease.released and backend.active == 0

    run(test)
