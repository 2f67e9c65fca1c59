"""Long bodies go by splice (agent.net.splice), and everything the normal path guarantees
still holds: bytes exact both ways (a front, and the router on top of one), keep-alive
after a spliced body, a client that leaves mid-body releasing its lease, a slow reader
that costs no memory, and the body timeout while a spliced body stalls.

That the splice path is the one taken is seen from outside: the front holds a pipe while
a long body passes (/proc/PID/fd), which the normal path never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import MISBEHAVE, Served, free_port, manifest

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
BIG = 100 * MIB

sys.path.insert(0, str(MISBEHAVE.parent))
from misbehave import pattern  # noqa: E402


def pipes(pid: int) -> int:
    """How many pipes process `pid` holds open."""
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            n += os.readlink(fd).startswith("pipe:")
    return n


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Reader:
    """HTTP/1.1 responses with a Content-Length read off a raw socket, keep-alive."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def head(self) -> tuple[int, int]:
        while b"\r\n\r\n" not in self.buf:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError(f"closed before a head: {self.buf!r}")
            self.buf += data
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        length = next(
            int(line.split(":", 1)[1])
            for line in lines
            if line.lower().startswith("content-length:")
        )
        return int(lines[0].split()[1]), length

    def body(self, length: int, digest: Any = None, rate: float = 0.0) -> bytes:
        """`length` bytes; with `digest`, hashed instead of kept; `rate`: bytes per second."""
        parts, got, t0 = [], 0, time.monotonic()
        take = min(len(self.buf), length)
        first, self.buf = self.buf[:take], self.buf[take:]
        got += take
        (digest.update if digest is not None else parts.append)(first)
        while got < length:
            data = self.sock.recv(min(MIB, length - got))
            if not data:
                raise ConnectionError(f"closed after {got} of {length} bytes")
            got += len(data)
            (digest.update if digest is not None else parts.append)(data)
            if rate:
                ahead = got / rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        return b"".join(parts)

    def response(self) -> tuple[int, bytes]:
        status, length = self.head()
        return status, self.body(length)


def post(sock: socket.socket, path: str, body: bytes, extra: str = "") -> None:
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    sock.sendall(head.encode())
    sock.sendall(body)


def get(sock: socket.socket, path: str) -> None:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())


def front_pid(served: Served) -> int:
    return served.proc.pid


def test_a_100_mib_body_arrives_byte_exact_both_ways_and_keep_alive_goes_on(serve: Any) -> None:
    port = free_port()
    s = serve(("big", manifest(port)))
    data = pattern(BIG)
    want = hashlib.sha256(data).hexdigest()
    with connect(port) as sock:
        r = Reader(sock)
        get(sock, "/pid")
        assert r.response()[0] == 200
        before = pipes(front_pid(s))
        post(sock, "/upload", data)
        status, body = r.response()
        assert status == 200, body
        echo = json.loads(body)
        assert (echo["body_length"], echo["sha256"]) == (BIG, want)
        assert pipes(front_pid(s)) > before  # the body went by splice (the pipe is kept)
        get(sock, f"/bytes?n={BIG}")
        status, length = r.head()
        assert (status, length) == (200, BIG)
        digest = hashlib.sha256()
        r.body(length, digest)
        assert digest.hexdigest() == want
        # The same connection goes on after each spliced body.
        post(sock, "/after", b"tail")
        status, body = r.response()
        assert status == 200 and json.loads(body)["body_length"] == 4


def test_the_tcp_relay_carries_100_mib_each_way_exact(serve: Any) -> None:
    """protocol = "tcp": opaque bytes (HTTP here, the worker's), both ways in the kernel."""
    port = free_port()
    s = serve(("opaque", manifest(port, protocol="tcp", ready="tcp")))
    data = pattern(BIG)
    want = hashlib.sha256(data).hexdigest()
    with connect(port) as sock:
        r = Reader(sock)
        before = pipes(front_pid(s))
        post(sock, "/upload", data)
        status, body = r.response()
        assert status == 200 and json.loads(body)["sha256"] == want
        assert pipes(front_pid(s)) > before
        get(sock, f"/bytes?n={BIG}")
        status, length = r.head()
        digest = hashlib.sha256()
        r.body(length, digest)
        assert digest.hexdigest() == want


def test_what_came_with_the_head_goes_first_and_a_pipelined_request_follows(serve: Any) -> None:
    """Head, the body's first bytes and the next request in one write: the spliced rest
    joins what was read before the switch, and the request after it is served."""
    port = free_port()
    serve(("pipelined", manifest(port)))
    data = pattern(3 * MIB + 17)
    head = f"POST /a HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n\r\n".encode()
    with connect(port) as sock:
        r = Reader(sock)
        sock.sendall(head + data + b"GET /pid HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, body = r.response()
        assert status == 200
        assert json.loads(body)["sha256"] == hashlib.sha256(data).hexdigest()
        status, body = r.response()
        assert status == 200 and "pid" in json.loads(body)


def wait_more(served: Served, text: str, before: int, timeout: float = 15) -> None:
    """Wait until the log has more lines with `text` than `before`."""
    deadline = time.monotonic() + timeout
    while served.count(text) <= before:
        assert time.monotonic() < deadline, f"no new {text!r}:\n{served.log}"
        time.sleep(0.05)


def test_a_client_that_leaves_in_the_middle_of_a_spliced_body_frees_its_lease(
    serve: Any,
) -> None:
    port = free_port()
    text = manifest(port, "--slow-body", "30", "--body-chunks", "30", idle=1)
    s = serve(("leaver", text.replace("request_timeout_s = 10", "request_timeout_s = 60")))
    for leave in ("upload", "download"):
        with connect(port) as sock:
            r = Reader(sock)
            get(sock, "/pid")  # the worker runs
            assert r.response()[0] == 200
            stopped = s.count("Worker stopped")
            if leave == "upload":  # 4 MiB of a 100 MiB body, then gone
                head = f"POST /up HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {BIG}\r\n\r\n"
                sock.sendall(head.encode())
                sock.sendall(pattern(4 * MIB))
            else:  # the worker sends 100 MiB over 30 s; the client reads 2 MiB and leaves
                get(sock, f"/bytes?n={BIG}")
                assert r.head()[0] == 200
                r.body(2 * MIB)
            time.sleep(1.5)  # past the idle timeout: the request holds the worker
            assert s.count("Worker stopped") == stopped, s.log
        wait_more(s, "Worker stopped", stopped)  # well before request_timeout_s


def test_a_slow_reader_of_a_spliced_body_does_not_grow_the_fronts_memory(serve: Any) -> None:
    port = free_port()
    s = serve(("slow", manifest(port)))
    pid = front_pid(s)
    with connect(port) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)
        r = Reader(sock)
        get(sock, "/pid")
        r.response()
        before_rss, before_pipes = rss(pid), pipes(pid)
        get(sock, f"/bytes?n={BIG}")
        status, length = r.head()
        assert status == 200
        # 8 MiB/s: the worker is done writing long before the client has read.
        r.body(24 * MIB, rate=8 * MIB)
        grown = rss(pid) - before_rss
        assert pipes(pid) > before_pipes  # the body goes by splice
        assert grown < 8 * MIB, f"the front grew by {grown} bytes behind a slow reader"
        r.body(length - 24 * MIB)
        get(sock, "/pid")
        assert r.response()[0] == 200


def test_a_slow_worker_reading_a_spliced_body_does_not_grow_the_fronts_memory(
    serve: Any,
) -> None:
    port = free_port()
    s = serve(("slowread", manifest(port, "--slow-read", "--read-rate", str(32 * MIB))))
    pid = front_pid(s)
    # Past what the kernel may buffer on the way (tcp_rmem lets a receive buffer grow to
    # 32 MiB here: the front's and the worker's, the pipe, a send buffer: about 70 MiB).
    data = pattern(BIG)
    with connect(port) as sock:
        r = Reader(sock)
        get(sock, "/pid")
        r.response()
        before = rss(pid)
        head = f"POST /up HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n\r\n"
        sock.sendall(head.encode())
        sock.settimeout(0.05)
        view, sent, peak, t0 = memoryview(data), 0, 0, time.monotonic()
        while sent < len(data):  # as fast as the front takes it
            with contextlib.suppress(TimeoutError):
                sent += sock.send(view[sent : sent + MIB])
            peak = max(peak, rss(pid) - before)
        took = time.monotonic() - t0
        sock.settimeout(30)
        status, body = r.response()
        assert status == 200
        assert json.loads(body)["sha256"] == hashlib.sha256(data).hexdigest()
        assert took > 0.5  # the worker's pace reached the client
        assert peak < 8 * MIB, f"the front grew by {peak} bytes before a slow worker"


def test_the_router_relays_a_100_mib_response_byte_exact(
    serve: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    router_port = free_port()
    config = tmp_path / "providerd.toml"
    config.write_text(f'[router]\nenabled = true\naddress = "127.0.0.1:{router_port}"\n')
    monkeypatch.setenv("PROVIDERD_CONFIG", str(config))
    port = free_port()
    text = manifest(port) + '[models]\nnames = ["m-1"]\n'
    s = serve(("routed", text))
    s.wait_log("Routing requests by model on 127.0.0.1:")
    want = hashlib.sha256(pattern(BIG)).hexdigest()
    body = json.dumps({"model": "m-1"}).encode()
    with connect(router_port) as sock:
        r = Reader(sock)
        for _ in range(2):  # keep-alive: the second one after a spliced body
            post(sock, f"/bytes?n={BIG}", body, "Content-Type: application/json\r\n")
            status, length = r.head()
            assert (status, length) == (200, BIG)
            digest = hashlib.sha256()
            r.body(length, digest)
            assert digest.hexdigest() == want


# -- in-process: the front's data path in this loop, scripted workers


class Leases:
    """Leases given and released."""

    def __init__(self) -> None:
        self.given = self.released = 0

    def lease(self, path: str | None) -> Leases:
        self.given += 1
        return self

    def release(self) -> None:
        self.released += 1


async def spliced_front(address: Any, leases: Leases, timeout_s: float = 30.0) -> socket.socket:
    """The front's data path (FrontSite on the core) in this loop, always ready, relaying
    to `address` (an agent.spec.provider.Address); its listening socket."""
    from agent.net.proxy import FrontSite, Style, accept_http
    from agent.net.upstream import Upstream

    class Ready:
        slug = "t"
        request_timeout_s = timeout_s
        upstream = Upstream(limit=8, max_waiting=8)
        target = (address, 1)

        def lease(self, path: str | None) -> Leases:
            return leases.lease(path)

        def alive(self, generation: int) -> bool:
            return True

        def waiting_for_start(self) -> int:
            return 0

        def ready_now(self) -> tuple[Any, int]:
            return self.target

        async def ready(self, *, may_start: bool = True) -> tuple[Any, int]:
            return self.target

    site = FrontSite(Ready())
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    loop = asyncio.get_running_loop()

    def accept() -> None:
        with_client, _ = listener.accept()
        accept_http(with_client, site, Style("t"), None)

    loop.add_reader(listener.fileno(), accept)
    pools.append(Ready.upstream)
    return listener


pools: list[Any] = []  # the fronts' worker connection pools, closed with them


async def close_front(front: socket.socket) -> None:
    """Stop accepting; close the kept worker connections; let the closes finish."""
    asyncio.get_running_loop().remove_reader(front.fileno())
    front.close()
    while pools:
        pools.pop().clear()
    await asyncio.sleep(0.05)


async def read_head(reader: asyncio.StreamReader) -> tuple[bytes, int]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, length


async def hashing_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Each request: its body's sha256 back, then as many bytes of pattern() as it had
    (or as its path says: /N)."""
    try:
        while await hash_one(reader, writer):
            pass
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def hash_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    head, length = await read_head(reader)
    path = head.split(b" ", 2)[1]
    digest = hashlib.sha256()
    left = length
    while left:
        data = await reader.read(min(left, MIB))
        if not data:
            return False
        digest.update(data)
        left -= len(data)
    answer = pattern(int(path[1:]) if path[1:].isdigit() else length)
    writer.write(
        b"HTTP/1.1 200 OK\r\nX-Sha256: %s\r\nContent-Length: %d\r\n\r\n"
        % (digest.hexdigest().encode(), len(answer))
    )
    writer.write(answer)
    await writer.drain()
    return True


async def round_trip(port: int, sizes: list[int], up: bool = True) -> None:
    """On one connection, each size up (or an empty body) and down, byte-exact."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for size in sizes:
        data = pattern(size if up else 0)
        head = b"POST /%d HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n"
        writer.write(head % (size, len(data)))
        writer.write(data)
        await writer.drain()
        head, length = await read_head(reader)
        assert head.startswith(b"HTTP/1.1 200 "), head
        want = hashlib.sha256(data).hexdigest().encode()
        assert b"X-Sha256: " + want in head, (size, head)
        assert length == size
        got = await reader.readexactly(length)
        assert hashlib.sha256(got).digest() == hashlib.sha256(pattern(size)).digest(), size
    writer.close()


def test_a_unix_socket_worker_gets_and_sends_long_bodies_exact() -> None:
    from agent.spec.provider import Address

    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/w.sock"
            server = await asyncio.start_unix_server(hashing_worker, path)
            leases = Leases()
            front = await spliced_front(Address(None, None, path), leases)
            await round_trip(front.getsockname()[1], [8 * MIB, 100, 3 * MIB + 1])
            assert leases.given == leases.released == 3
            await close_front(front)
            server.close()
            await server.wait_closed()

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("size", [8 * MIB, 100 * 1024])  # the pipe takes part of it, or all
@pytest.mark.parametrize("up", [True, False], ids=["request", "response"])
def test_where_the_kernel_declines_to_splice_the_bytes_go_through_python(
    monkeypatch: pytest.MonkeyPatch, size: int, up: bool
) -> None:
    """A kernel without splice for these sockets (EINVAL), as os.splice would answer it:
    whatever the pump took goes on through the transports, exact, and it is not tried again."""
    from agent.net import splice
    from agent.spec.provider import Address

    calls = {"n": 0}
    real = os.splice

    def declining(src: int, dst: int, count: int, *args: Any, **kw: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 1:  # the first one moves bytes into the pipe, the next refuses
            return real(src, dst, count, *args, **kw)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "splice", declining)
    monkeypatch.setattr(splice, "declined", set())
    monkeypatch.setattr(splice, "SPLICE_MIN", 1)  # the short body's rest fits the first splice

    async def main() -> None:
        server = await asyncio.start_server(hashing_worker, "127.0.0.1", 0)
        leases = Leases()
        front = await spliced_front(
            Address("127.0.0.1", server.sockets[0].getsockname()[1]), leases
        )
        await round_trip(front.getsockname()[1], [size, size], up)
        assert leases.given == leases.released == 2
        await close_front(front)
        server.close()
        await server.wait_closed()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert splice.declined == {(socket.AF_INET, socket.AF_INET)}
    assert calls["n"] == 2  # declined once, never tried again


def test_a_tunnel_carries_long_streams_both_ways_and_passes_each_half_close_on() -> None:
    from agent.spec.provider import Address

    up_bytes = pattern(6 * MIB)
    down_bytes = pattern(5 * MIB + 3)

    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_head(reader)
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: Upgrade\r\n\r\n"
        )
        writer.write(down_bytes)
        writer.write_eof()  # our half-close first; the client's still comes
        worker.got = await reader.read()  # type: ignore[attr-defined]  # to the client's EOF
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(worker, "127.0.0.1", 0)
        leases = Leases()
        front = await spliced_front(
            Address("127.0.0.1", server.sockets[0].getsockname()[1]), leases
        )
        reader, writer = await asyncio.open_connection("127.0.0.1", front.getsockname()[1])
        writer.write(b"GET /ws HTTP/1.1\r\nHost: t\r\nUpgrade: x\r\nConnection: Upgrade\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101 ")
        got = await reader.read()  # to the worker's EOF, passed on
        assert hashlib.sha256(got).digest() == hashlib.sha256(down_bytes).digest()
        assert leases.released == 0  # half open: the tunnel holds its lease
        writer.write(up_bytes)
        writer.write_eof()
        await writer.drain()
        for _ in range(200):
            if leases.released:
                break
            await asyncio.sleep(0.025)
        assert leases.given == leases.released == 1
        got = worker.got  # type: ignore[attr-defined]
        assert hashlib.sha256(got).digest() == hashlib.sha256(up_bytes).digest()
        writer.close()
        await close_front(front)
        server.close()
        await server.wait_closed()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_body_timeout_fires_while_a_spliced_body_stalls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agent.net import sockio
    from agent.spec.provider import Address

    monkeypatch.setattr(sockio, "BODY_TIMEOUT_S", 0.5)

    async def main() -> None:
        got = asyncio.get_running_loop().create_future()

        async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            n = 0
            try:
                while data := await reader.read(MIB):
                    n += len(data)
            except ConnectionError:
                pass
            finally:
                writer.close()
            got.set_result(n)

        server = await asyncio.start_server(worker, "127.0.0.1", 0)
        leases = Leases()
        front = await spliced_front(
            Address("127.0.0.1", server.sockets[0].getsockname()[1]), leases
        )
        reader, writer = await asyncio.open_connection("127.0.0.1", front.getsockname()[1])
        writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % BIG)
        writer.write(pattern(2 * MIB))
        await writer.drain()
        t0 = time.monotonic()
        answer = await asyncio.wait_for(reader.read(), 10)
        took = time.monotonic() - t0
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b"no byte of the request body for 0.5 s" in answer
        assert took < 5
        assert leases.given == leases.released == 1
        # The worker's connection was closed, after the 2 MiB that came (nothing more).
        assert await asyncio.wait_for(got, 5) <= 2 * MIB + 200
        writer.close()
        await close_front(front)
        server.close()
        await server.wait_closed()

    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.parametrize("worker_reads", ["stalls", "slowly"])
def test_a_client_blocked_only_by_a_slow_worker_is_not_timed_out_while_its_body_is_spliced(
    monkeypatch: pytest.MonkeyPatch, worker_reads: str
) -> None:
    """The body's limit is the client's: a worker that stops reading for several limits
    (stalls), or that reads so slowly that the pipe still holds the body's end long after
    the client sent it all (slowly), costs the client nothing; the body arrives whole. The
    normal path does the same (PAUSE_UPSTREAM)."""
    from agent.net import sockio
    from agent.spec.provider import Address

    limit = 0.4
    monkeypatch.setattr(sockio, "BODY_TIMEOUT_S", limit)
    size = 8 * MIB  # past the front's send buffer (4 MiB at most here) and the pipe
    data = pattern(size)

    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            _, length = await read_head(reader)
            digest, got, stalled, t0 = hashlib.sha256(), 0, False, time.monotonic()
            while got < length:
                chunk = await reader.read(min(length - got, 64 * 1024))
                if not chunk:
                    return
                digest.update(chunk)
                got += len(chunk)
                if worker_reads == "stalls" and got >= MIB and not stalled:
                    stalled = True
                    await asyncio.sleep(3 * limit)
                elif worker_reads == "slowly":  # 1.6 MiB/s: the pipe alone takes 0.6 s
                    ahead = got / (1.6 * MIB) - (time.monotonic() - t0)
                    if ahead > 0:
                        await asyncio.sleep(ahead)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 64\r\n\r\n")
            writer.write(digest.hexdigest().encode())
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def main() -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # no autotuning
        listener.bind(("127.0.0.1", 0))
        server = await asyncio.start_server(worker, sock=listener)
        leases = Leases()
        front = await spliced_front(Address("127.0.0.1", listener.getsockname()[1]), leases)
        reader, writer = await asyncio.open_connection("127.0.0.1", front.getsockname()[1])
        try:
            writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % size)
            writer.write(data)
            head, length = await asyncio.wait_for(read_head(reader), 20)
            answer = await reader.readexactly(length)
            assert head.startswith(b"HTTP/1.1 200 "), head + answer
            assert answer == hashlib.sha256(data).hexdigest().encode()
            assert leases.given == leases.released == 1
        finally:
            writer.transport.abort()
            await close_front(front)
            server.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_slow_but_steady_reader_of_a_spliced_body_is_not_cut_by_request_timeout() -> None:
    """request_timeout_s is between bytes either way: a reader taking a spliced body at
    1 MiB/s with a 0.5 s limit gets all of it (the pipe alone holds 1 MiB)."""
    from agent.spec.provider import Address

    size = 3 * MIB

    async def main() -> None:
        server = await asyncio.start_server(hashing_worker, "127.0.0.1", 0)
        leases = Leases()
        address = Address("127.0.0.1", server.sockets[0].getsockname()[1])
        front = await spliced_front(address, leases, timeout_s=0.5)
        sock = socket.create_connection(("127.0.0.1", front.getsockname()[1]))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % size)
        writer.write(pattern(size))
        _, length = await read_head(reader)
        got, t0 = bytearray(), time.monotonic()
        while len(got) < length:
            data = await reader.read(64 * 1024)
            assert data, f"cut after {len(got)} bytes"
            got += data
            ahead = len(got) / MIB - (time.monotonic() - t0)
            if ahead > 0:
                await asyncio.sleep(ahead)
        assert hashlib.sha256(got).digest() == hashlib.sha256(pattern(size)).digest()
        assert leases.released == 1
        writer.close()
        await close_front(front)
        server.close()
        await server.wait_closed()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_pumps_leave_no_descriptor_behind() -> None:
    """Each pump holds two duplicates and a pipe: after spliced bodies that ended, were
    cut by a client leaving, and tunnels, only the kept pipes remain."""
    from agent.net import splice
    from agent.spec.provider import Address

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def main() -> None:
        server = await asyncio.start_server(hashing_worker, "127.0.0.1", 0)
        leases = Leases()
        address = Address("127.0.0.1", server.sockets[0].getsockname()[1])
        front = await spliced_front(address, leases)
        port = front.getsockname()[1]
        await round_trip(port, [2 * MIB])  # the pipes kept from here on
        before = fds()
        for _ in range(5):
            await round_trip(port, [2 * MIB, 3 * MIB])
        for _ in range(5):  # a client that leaves in the middle of its body
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % BIG)
            writer.write(pattern(2 * MIB))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.close()
        for _ in range(50):
            if leases.released == leases.given:
                break
            await asyncio.sleep(0.02)
        assert leases.given == leases.released == 16
        await close_front(front)
        server.close()
        await server.wait_closed()
        assert fds() <= before - 1  # the front's listener is gone, and nothing else stayed
        assert len(splice._pipes) <= splice.PIPES_KEPT

    asyncio.run(asyncio.wait_for(main(), 60))
