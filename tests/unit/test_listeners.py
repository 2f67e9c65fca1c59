"""The accept side: the connection cap, running out of file descriptors, the first-request
grace, and the deadlines a connection leaves behind (none)."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from pathlib import Path

import pytest

from agent.net import deadlines, listeners
from agent.net.answers import Style
from agent.net.client import ClientConn
from agent.net.deadlines import COMPACT_MIN
from agent.net.listeners import HttpListeners, Listeners


class Exhausted:
    """A listening socket whose accept() fails with EMFILE the first `failures` times."""

    def __init__(self, failures: int) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.failures = failures
        self.calls = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def setblocking(self, flag: bool) -> None:
        self.sock.setblocking(flag)

    def accept(self) -> tuple[socket.socket, object]:
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock.accept()

    def close(self) -> None:
        self.sock.close()


def test_emfile_pauses_accepting_logs_once_and_recovers(caplog: pytest.LogCaptureFixture) -> None:
    """Regression: on EMFILE the listener stayed registered and the front spun at 100% CPU,
    one log line per try, and never answered again."""

    async def go() -> tuple[int, int]:
        fake = Exhausted(failures=3)
        got: list[socket.socket] = []
        ls = Listeners([fake], got.append, logging.getLogger("t"), max_connections=100)  # type: ignore[list-item]
        ls.start()
        client = socket.create_connection(fake.sock.getsockname())
        async with asyncio.timeout(5):
            while not got:
                await asyncio.sleep(0.01)
        calls = fake.calls
        for s in got:
            s.close()
        client.close()
        ls.stop()
        return calls, len(got)

    with caplog.at_level(logging.INFO):
        calls, accepted = asyncio.run(go())
    assert accepted == 1
    assert calls == 5  # three failures, each followed by a pause, the accept, EAGAIN
    failed = [r for r in caplog.records if "Failed to accept" in r.getMessage()]
    assert len(failed) == 1 and "pausing accepting" in failed[0].getMessage()
    assert any("Accepting connections again" in r.getMessage() for r in caplog.records)


def test_the_cap_leaves_connections_in_the_kernel_queue_until_one_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def go() -> tuple[int, int]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        got: list[socket.socket] = []
        ls = Listeners([sock], got.append, logging.getLogger("t"), max_connections=2)
        ls.start()
        clients = [socket.create_connection(sock.getsockname()) for _ in range(3)]
        await asyncio.sleep(0.2)
        at_cap = len(got)
        got[0].close()
        ls.closed()
        await asyncio.sleep(0.2)
        after = len(got)
        for s in got + clients:
            s.close()
        ls.stop()
        return at_cap, after

    with caplog.at_level(logging.INFO):
        at_cap, after = asyncio.run(go())
    assert (at_cap, after) == (2, 3)
    assert sum("Reached 2 client connections" in r.getMessage() for r in caplog.records) == 1


def test_the_cap_follows_a_low_file_descriptor_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listeners.resource, "getrlimit", lambda _r: (1024, 4096))
    assert listeners.connection_cap() == 1024 - listeners.FD_RESERVE
    monkeypatch.setattr(listeners.resource, "getrlimit", lambda _r: (65536, 65536))
    assert listeners.connection_cap() == listeners.MAX_CONNECTIONS


def test_a_connection_that_cannot_be_taken_costs_only_itself(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A socket the loop refuses as a transport is closed and logged; it does not count
    against the cap, and the next connection is taken as usual."""

    async def go() -> tuple[int, int, bytes]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        got: list[socket.socket] = []

        def take(conn: socket.socket) -> None:
            if not got:
                got.append(conn)
                raise RuntimeError("the loop refused it")
            got.append(conn)

        ls = Listeners([sock], take, logging.getLogger("t"), max_connections=1)
        ls.start()
        first = socket.create_connection(sock.getsockname())
        first.settimeout(5)
        second = socket.create_connection(sock.getsockname())
        async with asyncio.timeout(5):
            while len(got) < 2:
                await asyncio.sleep(0.01)
        refused = first.recv(1)  # closed by the listener: EOF
        for s in [*got, first, second]:
            s.close()
        ls.stop()
        return len(got), ls.open, refused

    with caplog.at_level(logging.INFO):
        taken, still_open, refused = asyncio.run(go())
    assert taken == 2 and refused == b""  # closed at once
    assert still_open == 1  # the second only
    assert any(
        "Failed to take connection: the loop refused it" in r.getMessage() for r in caplog.records
    )


# -- the connections' deadlines: first-request grace, and none left behind by a close ------


class Answering:
    """A site that counts each request as its connection's first (as the front's does) and
    answers 204."""

    def __init__(self) -> None:
        self.listening: HttpListeners | None = None

    def exchange(self, conn: ClientConn, req: object, head_end: int) -> None:
        assert self.listening is not None
        self.listening.first_request(conn)
        conn.start = head_end
        conn.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        conn.request_done(keep=True)


def unix_listener(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(1024)
    return sock


def http_listeners(sock: socket.socket, grace_s: float, fresh: list[int]) -> HttpListeners:
    site = Answering()
    ls = HttpListeners([sock], site, Style("t"), logging.getLogger("t"), grace_s, fresh.append)
    site.listening = ls
    return ls


def test_a_new_connection_is_fresh_until_its_first_request_or_its_grace_ends(
    tmp_path: Path,
) -> None:
    async def go() -> tuple[list[int], list[int], float]:
        loop = asyncio.get_running_loop()
        fresh: list[int] = []
        when: list[float] = []  # the loop's time of each change, as it happens
        path = tmp_path / "s"
        ls = http_listeners(unix_listener(path), 0.3, fresh)
        ls.on_fresh = lambda delta: (fresh.append(delta), when.append(loop.time()))  # type: ignore[assignment]

        async def changes(n: int) -> None:
            async with asyncio.timeout(5):
                while len(fresh) < n:
                    await asyncio.sleep(0.005)

        ls.start()
        asking = socket.socket(socket.AF_UNIX)
        asking.connect(str(path))
        await changes(1)
        asking.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        await changes(2)
        after_request = list(fresh)  # +1 at the accept, -1 at the request
        silent = socket.socket(socket.AF_UNIX)
        silent.connect(str(path))
        await changes(4)
        for s in (asking, silent):
            s.close()
        async with asyncio.timeout(5):
            while ls.connections:
                await asyncio.sleep(0.005)
        ls.stop()
        return after_request, fresh, when[3] - when[2]

    after_request, fresh, waited = asyncio.run(go())
    assert after_request == [1, -1]
    assert fresh == [1, -1, 1, -1]  # the silent one's grace ran out; nothing counted twice
    # Not before the grace, less the loop's ms step (and the float error of two loop times:
    # 0.298999999999978 was seen).
    assert waited >= 0.3 - 0.001 - 1e-9


def test_ten_thousand_connections_opened_and_closed_leave_nothing_on_the_deadline_queue(
    tmp_path: Path,
) -> None:
    """Each connection puts its head deadline and its grace on the loop's queue, and some
    a 400's linger; a close takes them off: none stays, and the heap is rebuilt as the
    stale entries pile up."""

    async def go() -> tuple[int, int, int, int, list[int]]:
        loop = asyncio.get_running_loop()
        queue = deadlines.of(loop)
        fresh: list[int] = []
        path = tmp_path / "s"
        ls = http_listeners(unix_listener(path), 5.0, fresh)
        ls.start()
        most = 0
        sends = [b"", b"GET / HT", b"BAD\r\n\r\n", b"GET / HTTP/1.1\r\nHost: t\r\n\r\n"]
        for _ in range(40):
            clients = []
            for i in range(250):
                c = socket.socket(socket.AF_UNIX)
                c.connect(str(path))
                if sends[i % 4]:
                    c.sendall(sends[i % 4])
                clients.append(c)
            async with asyncio.timeout(10):
                while len(ls.connections) < 250:
                    await asyncio.sleep(0.002)
            await asyncio.sleep(0.01)  # heads read, answers sent, lingers armed
            most = max(most, queue.entries())
            for c in clients:
                c.close()
            async with asyncio.timeout(10):
                while ls.connections:
                    await asyncio.sleep(0.002)
        ls.stop()
        return len(queue), queue.entries(), most, ls.open, fresh

    live, entries, most, still_open, fresh = asyncio.run(go())
    assert (live, still_open) == (0, 0)
    assert entries <= COMPACT_MIN  # stale ones only, bounded
    assert most <= 2 * 2 * 250 + COMPACT_MIN + 1  # two deadlines per connection at most
    assert sum(fresh) == 0 and len(fresh) == 20_000
