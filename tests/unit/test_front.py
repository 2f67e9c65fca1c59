"""The front's own decisions on real loopback sockets, with an in-process worker."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping
from pathlib import Path

import pytest

from agent.front import front as front_module
from agent.front.front import Front
from agent.front.state import State
from agent.spec.provider import Address, Provider
from agent.worker.control import DeviceRules, StartFailed

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class InProcessWorker:
    """A WorkerControl whose "model" is an asyncio server in this process."""

    def __init__(self, fail: str | None = None, crash: Exception | None = None) -> None:
        self.fail = fail
        self.crash = crash  # raised by start() as is: a bug below the front, not a refusal
        self.starts = 0
        self.stops = 0
        self.server: asyncio.AbstractServer | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self._on_exit = lambda _reason: None

    def on_exit(self, callback: object) -> None:
        self._on_exit = callback  # type: ignore[assignment]

    async def start(self, env: Mapping[str, str], devices: DeviceRules | None) -> None:
        self.starts += 1
        if self.fail:
            raise StartFailed(self.fail)
        if self.crash is not None:
            raise self.crash

        async def answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.writers.append(w)
            try:
                while await r.readuntil(b"\r\n\r\n"):
                    w.write(RESPONSE)
                    await w.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                w.close()

        port = int(env["PROVIDERD_WORKER_PORT"])
        self.server = await asyncio.start_server(answer, "127.0.0.1", port)

    async def stop(self) -> None:
        self.stops += 1
        if self.server is not None:
            self.server.close()
            for w in self.writers:
                w.close()
            await self.server.wait_closed()
            self.server = None

    async def answered(self, timeout_s: float) -> bool:
        return True  # started in this process: nothing waits for an answer

    def answers_by(self, deadline: float) -> None:
        pass

    def sending(self) -> bool:
        return False

    async def pids(self) -> list[int]:
        return []

    async def memory(self) -> dict[str, int | None]:
        return {"current": None, "max": None}


def provider(**kw: object) -> Provider:
    base: dict[str, object] = {
        "slug": "t",
        "source": Path("/t.toml"),
        "addresses": (Address("127.0.0.1", 1),),
        "idle_timeout_s": 30.0,
    }
    base.update(kw)
    return Provider(**base)  # type: ignore[arg-type]


def listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s


async def get(port: int) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    data = await asyncio.wait_for(r.read(), 5)
    w.close()
    await w.wait_closed()
    return data


async def shutdown(front: Front, worker: InProcessWorker) -> None:
    front.stop_accepting()
    for task in list(front._connections):
        task.cancel()
    await asyncio.gather(*front._connections, return_exceptions=True)
    front.upstream.clear()  # the kept worker connections (a worker stop does this too)
    await worker.stop()
    await asyncio.sleep(0)


def test_a_connection_accepted_in_the_turn_of_an_idle_exit_is_served() -> None:
    """Regression: the idle decision ran before the new connection's task had counted it,
    so the worker was stopped under a request (seen as a 503 in the container tier)."""

    async def go() -> tuple[bytes, State, int]:
        sock = listener()
        port = sock.getsockname()[1]
        worker = InProcessWorker()
        front = Front(provider(), worker, [sock], exit_on_idle=True)
        front.start_accepting()
        front.warm()
        while front.state != State.READY:
            await asyncio.sleep(0.01)
        asyncio.get_running_loop().remove_reader(sock.fileno())  # accept by hand below
        client = asyncio.create_task(get(port))
        await asyncio.sleep(0.05)  # the connection waits in the accept queue
        front.listening.accept(sock)  # accepted in this turn of the loop …
        front._idle()  # … and the idle deadline falls in the same turn
        data = await client
        state, stops = front.state, worker.stops
        await shutdown(front, worker)
        return data, state, stops

    data, state, stops = asyncio.run(go())
    assert data.startswith(b"HTTP/1.1 200"), data
    assert state == State.READY and stops == 0


def test_idle_exit_stops_accepting_and_releases() -> None:
    async def go() -> tuple[bool, int]:
        sock = listener()
        worker = InProcessWorker()
        front = Front(provider(idle_timeout_s=0.2), worker, [sock], exit_on_idle=True)
        front.start_accepting()
        front.warm()
        await asyncio.wait_for(front.done.wait(), 5)
        closed, stops = sock.fileno() == -1, worker.stops
        await shutdown(front, worker)
        return closed, stops

    closed, stops = asyncio.run(go())
    assert closed and stops == 1


def test_failed_start_refuses_during_backoff_without_restarting() -> None:
    async def go() -> tuple[list[bytes], int]:
        sock = listener()
        port = sock.getsockname()[1]
        worker = InProcessWorker(fail="worker failed to start: status 3")
        front = Front(provider(), worker, [sock], exit_on_idle=False)
        front.start_accepting()
        answers = [await get(port) for _ in range(5)]
        await shutdown(front, worker)
        return answers, worker.starts

    answers, starts = asyncio.run(go())
    assert all(a.startswith(b"HTTP/1.1 503") for a in answers), answers
    assert b"status 3" in answers[0] and b"Retry-After" in answers[0]
    assert starts == 1


def test_an_unexpected_error_in_the_start_answers_503_instead_of_holding_forever() -> None:
    """Regression: dbus-next refused the device rules with its own exception type, which
    escaped the start task, so every held request waited until the client gave up."""

    async def go() -> bytes:
        sock = listener()
        worker = InProcessWorker(
            crash=ValueError('DBus STRUCT type "(" must be Python type "list"')
        )
        front = Front(provider(), worker, [sock], exit_on_idle=False)
        front.start_accepting()
        answer = await asyncio.wait_for(get(sock.getsockname()[1]), 5)
        await shutdown(front, worker)
        return answer

    answer = asyncio.run(go())
    assert answer.startswith(b"HTTP/1.1 503"), answer
    assert b"internal error while starting the worker; see journalctl -u provider@t" in answer
    assert b"DBus" not in answer  # the details are for the journal


def test_warm_while_the_worker_is_being_released_starts_it_again() -> None:
    async def go() -> tuple[dict[str, object], int]:
        sock = listener()
        worker = InProcessWorker()
        front = Front(provider(), worker, [sock], exit_on_idle=False)
        front.start_accepting()
        await front.handle({"op": "warm"})
        front.release_worker("stop on request")  # STOPPING now
        answer = await asyncio.wait_for(front.handle({"op": "warm"}), 5)
        starts = worker.starts
        await shutdown(front, worker)
        return answer, starts

    answer, starts = asyncio.run(go())
    assert answer == {"state": "ready", "error": None}
    assert starts == 2


def test_a_pinned_provider_is_never_released_on_idle_nor_retired() -> None:
    async def go() -> tuple[State, int, dict[str, object], bool]:
        sock = listener()
        worker = InProcessWorker()
        front = Front(provider(idle_timeout_s=0.1, pinned=True), worker, [sock], exit_on_idle=True)
        front.start_accepting()
        front.warm()
        while front.state != State.READY:
            await asyncio.sleep(0.01)
        await get(sock.getsockname()[1])  # a lease ends: where the idle timer would be armed
        await asyncio.sleep(0.5)  # five idle timeouts
        answer = await front.retire()
        state, stops, done = front.state, worker.stops, front.done.is_set()
        status = await front.status()
        await shutdown(front, worker)
        sock.close()
        return state, stops, answer | {"status_pinned": status["pinned"]}, done

    state, stops, answer, done = asyncio.run(go())
    assert state == State.READY and stops == 0 and not done
    assert answer == {"retired": False, "busy": 0, "pinned": True, "status_pinned": True}


def test_an_unpinned_provider_retires_when_idle() -> None:
    async def go() -> tuple[dict[str, object], int]:
        sock = listener()
        worker = InProcessWorker()
        front = Front(provider(), worker, [sock], exit_on_idle=False)
        front.start_accepting()
        front.warm()
        while front.state != State.READY:
            await asyncio.sleep(0.01)
        answer = await front.retire()
        stops = worker.stops
        await shutdown(front, worker)
        sock.close()
        return answer, stops

    answer, stops = asyncio.run(go())
    assert answer == {"retired": True} and stops == 1


def test_the_preload_is_recorded_once_per_boot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent.systemd import preload

    monkeypatch.setenv("PROVIDERD_RUNTIME_DIR", str(tmp_path))
    p = provider(preload=True)
    assert preload.activation_cause(provider()) == "activation"
    assert preload.activation_cause(p) == "preload"
    assert preload.read("t") is None

    async def go() -> None:
        sock = listener()
        worker = InProcessWorker()
        front = Front(p, worker, [sock], exit_on_idle=False)
        front.warm(preload.activation_cause(p))
        while front.state != State.READY:
            await asyncio.sleep(0.01)
        await shutdown(front, worker)
        sock.close()

    asyncio.run(go())
    record = preload.read("t")
    assert record is not None and record["result"] == "ready"
    assert set(record) == {"at", "took_s", "result"}
    assert preload.activation_cause(p) == "activation"  # later fronts this boot: activations


def test_requests_back_to_back_tell_systemd_the_status_at_most_every_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each STATUS= is a datagram that wakes PID 1: a request's change of the "Serving"
    line is sent at once after a quiet spell, then at most every STATUS_EVERY_S, and the
    latest line always arrives."""
    monkeypatch.setattr(front_module, "STATUS_EVERY_S", 0.3)
    sent: list[str] = []

    async def go() -> None:
        sock = listener()
        worker = InProcessWorker()
        front = Front(provider(), worker, [sock], exit_on_idle=False, notify=sent.append)
        front.start_accepting()
        front.warm()
        while front.state != State.READY:
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        before, began = len(sent), loop.time()
        for _ in range(20):  # 40 changes of the line: a lease begins and ends
            assert (await get(sock.getsockname()[1])).startswith(b"HTTP/1.1 200")
        took = loop.time() - began
        await asyncio.sleep(0.5)
        assert sent[-1] == "STATUS=Serving: 0 in flight, 20 served"
        assert sent[before] == "STATUS=Serving: 1 in flight, 0 served"  # at once
        assert len(sent) - before <= 2 + took / 0.3
        await shutdown(front, worker)

    asyncio.run(go())


def test_a_provider_used_more_often_than_its_idle_timeout_is_released_only_after_the_last() -> None:
    """The idle timer is moved lazily: requests ending back to back do not re-arm it, yet the
    release comes idle_timeout_s after the last lease, never sooner."""

    async def go() -> float:
        sock = listener()
        worker = InProcessWorker()
        front = Front(provider(idle_timeout_s=0.3), worker, [sock], exit_on_idle=True)
        front.start_accepting()
        front.warm()
        while front.state != State.READY:
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        for _ in range(8):  # 0.8 s in all, never 0.3 s without a request
            assert (await get(sock.getsockname()[1])).startswith(b"HTTP/1.1 200")
            assert worker.stops == 0
            await asyncio.sleep(0.1)
        last = loop.time() - 0.1
        await asyncio.wait_for(front.done.wait(), 5)
        took = loop.time() - last
        await shutdown(front, worker)
        return took

    took = asyncio.run(go())
    assert 0.29 <= took < 2.0, took
