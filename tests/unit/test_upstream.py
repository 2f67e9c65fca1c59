"""The worker's side of the data path: slots in arrival order, kept connections, connects."""

from __future__ import annotations

import asyncio
import errno
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from agent.net import upstream
from agent.net.site import FrontSite
from agent.net.sockio import connect_to, error_text
from agent.net.upstream import QueueFull, Upstream
from agent.spec.provider import Address
from tests.support.loops import loops


def test_slots_pass_on_in_arrival_order_and_the_queue_is_bounded() -> None:
    async def go() -> list[int]:
        up = Upstream(limit=1, max_waiting=3)
        await up.acquire()
        order: list[int] = []

        async def waiter(i: int) -> None:
            await up.acquire()
            order.append(i)
            up.release()

        tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
        await asyncio.sleep(0)
        assert up.waiting == 3
        with pytest.raises(QueueFull):
            await up.acquire()
        with pytest.raises(QueueFull):
            await up.acquire(also_waiting=1)
        tasks[1].cancel()  # a client that gives up leaves the queue
        await asyncio.sleep(0)
        up.release()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert up.in_use == 0 and up.waiting == 0
        return order

    assert asyncio.run(go()) == [0, 2]


def test_a_slot_granted_to_a_waiter_cancelled_in_the_same_turn_passes_on() -> None:
    async def go() -> int:
        up = Upstream(limit=1, max_waiting=10)
        await up.acquire()
        first = asyncio.create_task(up.acquire())
        second = asyncio.create_task(up.acquire())
        await asyncio.sleep(0)
        up.release()  # granted to `first` …
        first.cancel()  # … which is cancelled before it runs
        await asyncio.gather(first, return_exceptions=True)
        await asyncio.wait_for(second, 1)
        return up.in_use

    assert asyncio.run(go()) == 1


def test_a_place_taken_at_once_keeps_its_turn_and_leaving_it_passes_the_slot_on() -> None:
    """join() queues at once (no task, no await): a later join() or acquire() goes behind
    it. leave() of a place never waited on: ungranted, it goes; granted, its slot passes on."""

    async def go() -> None:
        up = Upstream(limit=1, max_waiting=10)
        assert up.join() is None and up.in_use == 1  # a slot at once
        first, second, third = up.join(), up.join(), up.join()
        assert first is not None and second is not None and third is not None
        assert up.waiting == 3
        up.leave(second)  # never granted: it leaves the queue
        assert up.waiting == 2 and second.cancelled()
        up.release()  # the slot goes to the first in line
        assert first.done() and not third.done()
        up.leave(first)  # granted, never used: passed on to the next
        assert third.done() and up.in_use == 1 and up.waiting == 0
        await up.wait(third)  # granted already: returns at once
        up.release()
        assert up.in_use == 0

    asyncio.run(go())


def test_a_front_request_that_ends_before_it_waited_for_its_place_leaves_it() -> None:
    """The front's site takes a place in the queue when a request arrives with the worker
    ready and no slot free; an exchange that ends before its task waited on the place (its
    client gone in the same turn) gives the place back when its slot is released."""

    class Backend:
        def __init__(self) -> None:
            self.upstream = Upstream(limit=1, max_waiting=10)

        def ready_now(self) -> tuple[Address, int]:
            return Address("127.0.0.1", 1), 1

        def waiting_for_start(self) -> int:
            return 0

    class Ex:
        slot = False

    async def go() -> None:
        backend = Backend()
        site = FrontSite(backend)
        holder, late = Ex(), Ex()
        assert site.target_now(holder) is not None and holder.slot
        assert site.target_now(late) is None
        assert backend.upstream.waiting == 1 and late in site.queued
        site.release_slot(late, None)
        assert backend.upstream.waiting == 0 and not site.queued
        site.release_slot(holder, None)
        assert backend.upstream.in_use == 0

    asyncio.run(go())


def test_kept_connections_are_reused_only_for_their_generation_and_while_fresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(upstream.time, "monotonic", lambda: now[0])

    class Kept:
        def __init__(self) -> None:
            self.good = True
            self.closed = False

        def usable(self) -> bool:
            return self.good and not self.closed

        def close(self) -> None:
            self.closed = True

    up = Upstream(limit=4, max_waiting=10)
    a, b, c, d = Kept(), Kept(), Kept(), Kept()
    up.keep(a, generation=1)
    assert up.take_idle(generation=2) is None  # another worker: closed, not reused
    assert a.closed
    up.keep(b, generation=1)
    now[0] += upstream.KEEP_IDLE_S + 0.1
    assert up.take_idle(generation=1) is None  # idle too long: the server may close it
    assert b.closed
    up.keep(c, generation=1)
    c.good = False  # the upstream closed it meanwhile (its EOF arrived)
    assert up.take_idle(generation=1) is None and c.closed
    up.keep(d, generation=1)
    assert up.take_idle(generation=1) is d and not d.closed  # fresh, same worker: reused


def test_kept_connections_too_old_to_be_reused_are_closed_when_another_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst leaves many idle connections; the newest is reused, and the others, never
    to be reused once older than KEEP_IDLE_S, must not stay open to the worker."""

    class Conn:
        closed = False

        def usable(self) -> bool:
            return not self.closed

        def close(self) -> None:
            self.closed = True

    now = [100.0]
    monkeypatch.setattr(upstream.time, "monotonic", lambda: now[0])
    pool = Upstream(limit=8, max_waiting=8)
    burst = [Conn() for _ in range(5)]
    for conn in burst:
        pool.keep(conn, 1)
    now[0] += upstream.KEEP_IDLE_S + 0.1
    newest = Conn()
    pool.keep(newest, 1)
    assert all(conn.closed for conn in burst) and not newest.closed
    assert pool.take_idle(1) is newest and pool.take_idle(1) is None


def test_no_more_connections_are_kept_than_the_limit() -> None:
    """The worker never has more idle connections from the front than `limit`: one kept
    beyond it is closed at once."""

    class Conn:
        closed = False

        def usable(self) -> bool:
            return not self.closed

        def close(self) -> None:
            self.closed = True

    pool = Upstream(limit=2, max_waiting=8)
    conns = [Conn() for _ in range(3)]
    for conn in conns:
        pool.keep(conn, 1)
    assert [conn.closed for conn in conns] == [False, False, True]
    assert pool.take_idle(1) is conns[1] and pool.take_idle(1) is conns[0]
    assert pool.take_idle(1) is None


def listening(
    family: int = socket.AF_INET, where: str | tuple[str, int] = ("127.0.0.1", 0)
) -> socket.socket:
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind(where)
        s.listen(8)
    except OSError:
        s.close()
        raise
    return s


@pytest.mark.parametrize("run", list(loops()))
def test_connects_reach_v4_v6_and_unix_listeners_and_a_refused_one_raises_its_errno(
    run: Callable[[Coroutine[Any, Any, None]], None], tmp_path: Path
) -> None:
    listeners = [listening(), listening(socket.AF_UNIX, str(tmp_path / "w.sock"))]
    addresses = [
        Address("127.0.0.1", listeners[0].getsockname()[1]),
        Address(None, None, str(tmp_path / "w.sock")),
    ]
    try:
        listeners.append(listening(socket.AF_INET6, ("::1", 0)))
        addresses.append(Address("::1", listeners[-1].getsockname()[1]))
    except OSError:  # no IPv6 loopback here
        pass
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused = Address("127.0.0.1", closed.getsockname()[1])

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for address, server in zip(addresses, listeners, strict=True):
                sock = await upstream.connect(loop, address)
                try:
                    accepted, _ = server.accept()
                    with accepted:
                        sock.send(b"x")
                        assert accepted.recv(1) == b"x"
                    assert not sock.getblocking()
                finally:
                    sock.close()
            with pytest.raises(OSError) as raised:
                await upstream.connect(loop, refused)
            assert raised.value.errno == errno.ECONNREFUSED  # retried by connect_retrying
            # A unix listener whose accept queue is full: "not now" at once, also retried.
            with socket.socket(socket.AF_UNIX) as full:
                full.bind(str(tmp_path / "full.sock"))
                full.listen(0)
                first = await upstream.connect(
                    loop, Address(None, None, str(tmp_path / "full.sock"))
                )
                try:
                    with pytest.raises(OSError) as raised:
                        await upstream.connect(
                            loop, Address(None, None, str(tmp_path / "full.sock"))
                        )
                    assert raised.value.errno == errno.EAGAIN
                    assert raised.value.errno in upstream.RETRYABLE
                finally:
                    first.close()

        try:
            run(main())
        finally:
            for s in listeners:
                s.close()


def test_a_connect_to_the_worker_starts_no_resolver_threads(tmp_path: Path) -> None:
    """On uvloop, the loop's sock_connect resolves numeric addresses too, in libuv's thread
    pool: the first connect of a cold start's first request started its four threads (3 ms,
    10 under systemd on a busy host). The front's connects, the probe's and the request's,
    start none: the process keeps its one thread. In a fresh interpreter: the pool, once
    started, stays for the process's life."""
    pytest.importorskip("uvloop")
    script = textwrap.dedent(
        """\
        import asyncio, os, socket
        from agent.net import loop as net_loop, upstream
        from agent.spec.provider import Address, Ready
        from agent.worker import readiness

        async def main():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                s.listen(8)
                address = Address("127.0.0.1", s.getsockname()[1])
                assert await readiness.answers(address, Ready("tcp"))
                loop = asyncio.get_running_loop()
                conn = await upstream.connect_retrying(loop, address, lambda: True)
                conn.close()
                print(type(loop).__module__, len(os.listdir("/proc/self/task")))

        net_loop.run(main())
        """
    )
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["uvloop", "1"]


@pytest.mark.parametrize("run", list(loops()))
def test_a_connect_the_worker_never_completes_gives_up_at_the_deadline(
    run: Callable[[Coroutine[Any, Any, tuple[OSError, float]]], tuple[OSError, float]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that stopped accepting, its accept queue full: the kernel drops the SYNs and
    a connect would wait through two minutes of retransmits. It ends at RETRY_FOR_S.
    (Linux's loopback: a listen(0) queue holds one connection, and later SYNs are dropped.)"""
    monkeypatch.setattr(upstream, "RETRY_FOR_S", 0.3)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)  # never accepted: one connection fills the queue
        port = server.getsockname()[1]
        queued = []
        for _ in range(3):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            queued.append(c)

        async def main() -> tuple[OSError, float]:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(OSError) as raised:
                await asyncio.wait_for(
                    upstream.connect_retrying(loop, Address("127.0.0.1", port), lambda: True), 5
                )
            return raised.value, loop.time() - t0

        try:
            error, took = run(main())
        finally:
            for c in queued:
                c.close()
    assert isinstance(error, TimeoutError) and error.errno == errno.ETIMEDOUT, error
    assert error_text(error) == "Connection timed out"
    assert took < 4  # not asyncio.wait_for's 5 s: the deadline's own


def test_a_scoped_ipv6_address_keeps_its_scope() -> None:
    """connect_ex on a (host, port) pair drops an IPv6 address's scope (EINVAL for a
    link-local one); connect_to keeps it, looked up numerically (no resolver): the connect
    is tried on that interface (here none answers: unreachable or refused, not EINVAL)."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    target = ("fe80::1%lo", 9)
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM | socket.SOCK_NONBLOCK) as plain:
        assert plain.connect_ex(target) == errno.EINVAL  # what connect_to must not do

    async def main() -> OSError:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        with sock, pytest.raises(OSError) as raised:
            await connect_to(loop, sock, target, timeout_s=1)
        return raised.value

    error = asyncio.run(main())
    assert error.errno != errno.EINVAL, error
