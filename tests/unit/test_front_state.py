"""The front's journeys through its state table, on real loopback sockets: every wait is
on a future or an event the one writer sets, so each test ends as soon as what it waits
for has happened (the deadlines below are only there to fail instead of hanging)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from agent.front.front import Front
from agent.front.state import State
from agent.worker.control import DeviceRules
from tests.unit.test_front import InProcessWorker, get, listener, provider, shutdown


class SlowWorker(InProcessWorker):
    """Takes `start_s` to start and `stop_s` to stop; remembers a cancelled start."""

    def __init__(self, start_s: float = 0.0, stop_s: float = 0.0) -> None:
        super().__init__()
        self.start_s = start_s
        self.stop_s = stop_s
        self.begun = 0
        self.cancelled = 0

    async def start(self, env: Mapping[str, str], devices: DeviceRules | None) -> None:
        self.begun += 1
        try:
            await asyncio.sleep(self.start_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        await super().start(env, devices)

    async def stop(self) -> None:
        await asyncio.sleep(self.stop_s)
        await super().stop()


async def until(front: Front, state: State) -> None:
    async with asyncio.timeout(5):
        while front.state != state:
            await asyncio.sleep(0.005)


def test_worker_gone_answers_as_soon_as_the_exit_is_known() -> None:
    async def go() -> tuple[str | None, float, str | None]:
        sock = listener()
        worker = InProcessWorker()
        front = Front(provider(), worker, [sock], exit_on_idle=False)
        front.warm()
        await until(front, State.READY)
        generation = front.generation
        began = time.monotonic()
        gone = asyncio.create_task(front.worker_gone(generation, wait_s=30))
        await asyncio.sleep(0)
        front._worker_exited("worker exited: status 9")
        why = await asyncio.wait_for(gone, 5)
        took = time.monotonic() - began
        later = await front.worker_gone(generation - 1, wait_s=30)  # an older worker: None
        await shutdown(front, worker)
        sock.close()
        return why, took, later

    why, took, later = asyncio.run(go())
    assert why == "worker exited: status 9" and took < 5
    assert later is None


def test_stop_waits_for_the_requests_in_flight_and_no_longer() -> None:
    async def go() -> tuple[dict[str, object], float, dict[str, object]]:
        sock = listener()
        worker = InProcessWorker()
        front = Front(provider(), worker, [sock], exit_on_idle=False)
        front.warm()
        await until(front, State.READY)
        lease = front.lease("/v1/x")
        stopping = asyncio.create_task(front.stop(grace_s=30))
        await asyncio.sleep(0.05)
        assert not stopping.done() and front.state == State.READY
        began = time.monotonic()
        lease.release()
        first = await asyncio.wait_for(stopping, 5)
        took = time.monotonic() - began
        front.warm()
        await until(front, State.READY)
        held = front.lease("/v1/x")  # never ends: cut after the grace
        second = await asyncio.wait_for(front.stop(grace_s=0.1), 5)
        held.release()
        await shutdown(front, worker)
        sock.close()
        return first, took, second

    first, took, second = asyncio.run(go())
    assert first == {"stopped": True, "cut": 0} and took < 5
    assert second == {"stopped": True, "cut": 1}


def test_a_release_while_the_worker_starts_cancels_the_start() -> None:
    async def go() -> tuple[State, int, int, int, float]:
        sock = listener()
        worker = SlowWorker(start_s=30)
        front = Front(provider(), worker, [sock], exit_on_idle=False)
        front.warm()
        await until(front, State.STARTING)
        await asyncio.sleep(0.05)  # the start is under way
        began = time.monotonic()
        front.release_worker("Worker over its VRAM budget")
        await until(front, State.IDLE)
        took = time.monotonic() - began
        result = front.state, worker.begun, worker.cancelled, worker.stops, took
        await shutdown(front, worker)
        sock.close()
        return result

    state, begun, cancelled, stops, took = asyncio.run(go())
    assert (state, begun, cancelled, stops) == (State.IDLE, 1, 1, 1)
    assert took < 5  # not the 30 s the start would have taken


def test_requests_held_over_a_stop_share_one_fresh_start() -> None:
    async def go() -> tuple[list[bytes], int, State]:
        sock = listener()
        port = sock.getsockname()[1]
        worker = SlowWorker(stop_s=0.3)
        front = Front(provider(), worker, [sock], exit_on_idle=False)
        front.start_accepting()
        front.warm()
        await until(front, State.READY)
        front.release_worker("stop on request")
        assert front.state == State.STOPPING
        answers = await asyncio.wait_for(asyncio.gather(*(get(port) for _ in range(3))), 10)
        result = answers, worker.starts, front.state
        await shutdown(front, worker)
        return result

    answers, starts, state = asyncio.run(go())
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers), answers
    assert starts == 2 and state == State.READY


def test_an_activated_front_that_leaves_starts_no_worker_again() -> None:
    async def go() -> tuple[dict[str, object], State, int, bool, str]:
        sock = listener()
        worker = InProcessWorker()
        front = Front(provider(), worker, [sock], exit_on_idle=True)
        front.start_accepting()
        front.warm()
        await until(front, State.READY)
        answer = await asyncio.wait_for(front.handle({"op": "stop"}), 5)
        front.warm()  # a demand that arrives as the front goes
        await asyncio.sleep(0.05)
        status = await front.status()
        result = answer, front.state, worker.starts, front.done.is_set(), str(status["state"])
        await shutdown(front, worker)
        return result

    answer, state, starts, done, shown = asyncio.run(go())
    assert answer == {"stopped": True, "cut": 0}
    assert (state, starts, done, shown) == (State.LEAVING, 1, True, "stopping")


def test_a_hook_that_fails_after_a_failed_start_still_answers_the_held_requests() -> None:
    from agent.front.hooks import Admission, Host

    class Broken(Admission):
        async def released(self, host: Host) -> None:
            raise RuntimeError("the reservation could not be removed")

    async def go() -> tuple[bytes, bool]:
        sock = listener()
        worker = InProcessWorker(fail="worker failed to start: status 3")
        front = Front(provider(), worker, [sock], exit_on_idle=False, admission=Broken())
        front.start_accepting()
        answer = await asyncio.wait_for(get(sock.getsockname()[1]), 5)
        stopped = front._stopped.is_set()  # a leave or a retire would not wait for ever
        await shutdown(front, worker)
        return answer, stopped

    answer, stopped = asyncio.run(go())
    assert answer.startswith(b"HTTP/1.1 503") and b"status 3" in answer, answer
    assert stopped


def test_the_first_start_attempt_ends_the_early_starts_adoption_even_before_the_worker() -> None:
    """An attempt that fails before it reaches worker.start (its admission, here) still
    ends the adoption of the early start's job: a later start must not follow that job."""
    from agent.front.hooks import Admission, Host

    class Broken(Admission):
        async def admit(self, host: Host) -> tuple[dict[str, str], None]:
            raise OSError("the reservation could not be written")

    async def go() -> tuple[bytes, list[str], int]:
        sock = listener()
        worker = InProcessWorker()
        front = Front(provider(), worker, [sock], exit_on_idle=False, admission=Broken())
        over: list[str] = []
        front.first_start_over = lambda: over.append("over")
        front.start_accepting()
        answer = await asyncio.wait_for(get(sock.getsockname()[1]), 5)
        await shutdown(front, worker)
        return answer, over, worker.starts

    answer, over, starts = asyncio.run(go())
    assert answer.startswith(b"HTTP/1.1 503"), answer
    assert (over, starts) == (["over"], 0)


def test_systemctl_stop_while_the_worker_starts_cancels_the_start_and_exits() -> None:
    async def go() -> tuple[dict[str, object], int, int, bool, float]:
        sock = listener()
        worker = SlowWorker(start_s=30)
        front = Front(provider(), worker, [sock], exit_on_idle=True)
        front.start_accepting()
        front.warm("activation")
        await until(front, State.STARTING)
        await asyncio.sleep(0.05)
        began = time.monotonic()
        answer = await asyncio.wait_for(front.handle({"op": "stop"}), 5)
        took = time.monotonic() - began
        result = answer, worker.begun, worker.cancelled, front.done.is_set(), took
        await shutdown(front, worker)
        return result

    answer, begun, cancelled, done, took = asyncio.run(go())
    assert answer == {"stopped": True, "cut": 0}
    assert (begun, cancelled, done) == (1, 1, True) and took < 5


class FailingStop(InProcessWorker):
    """A worker whose stop raises (a bus error after the unit went), once."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    async def stop(self) -> None:
        await super().stop()
        if not self.failed:
            self.failed = True
            raise RuntimeError("org.freedesktop.DBus.Error.NoReply")


def test_a_stop_that_fails_still_ends_and_the_front_can_start_again() -> None:
    async def go() -> tuple[dict[str, object], State]:
        sock = listener()
        worker = FailingStop()
        front = Front(provider(), worker, [sock], exit_on_idle=False)
        front.warm()
        await until(front, State.READY)
        stopped = await asyncio.wait_for(front.stop(grace_s=0.1), 5)
        front.warm()
        await until(front, State.READY)
        state = front.state
        await shutdown(front, worker)
        sock.close()
        return stopped, state

    stopped, state = asyncio.run(go())
    assert stopped == {"stopped": True, "cut": 0}
    assert state == State.READY


def test_a_request_that_may_not_start_the_model_never_does() -> None:
    """A key with can_start = false was let in while the worker ran; the worker went
    away while the request waited: the request is refused, the model does not start."""
    from agent.net.site import Unavailable

    async def go() -> tuple[int, int, int]:
        sock = listener()
        worker = InProcessWorker()
        front = Front(provider(), worker, [sock], exit_on_idle=False)
        refused = 0
        try:
            await front.ready(may_start=False)
        except Unavailable as e:
            refused = e.status
        starts_idle = worker.starts
        front.warm()
        await until(front, State.READY)
        await front.ready(may_start=False)  # running: served
        await asyncio.wait_for(front.stop(grace_s=0.1), 5)
        try:
            await front.ready(may_start=False)
        except Unavailable:
            refused += 1
        starts = worker.starts
        await shutdown(front, worker)
        sock.close()
        return refused, starts_idle, starts

    refused, starts_idle, starts = asyncio.run(go())
    assert refused == 403 + 1
    assert starts_idle == 0 and starts == 1
