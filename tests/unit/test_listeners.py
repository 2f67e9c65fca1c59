"""The accept side: the connection cap and running out of file descriptors."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

import pytest

from agent.net import listeners
from agent.net.listeners import Listeners


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
