"""The activated agent ("front"): holds connections, starts the worker once, proxies, releases.

`Front` is the same object under systemd (`python3 -m agent.front SLUG`, which the unit runs as
`python3 -c "import agent.front.__main__" SLUG`, socket-activated)
and in the foreground (`providerctl serve`). One task owns the state (`agent.front.state`);
connections, timers and control requests only send it events.

What `ready()` does in each state (the contract every held connection relies on):
- ready: returns the worker's address at once.
- idle: starts the worker, then waits like `starting`.
- starting / stopping: waits for the start (or for the stop, then demands again).
- backoff: refuses at once with 503 and the time left before the next try.
- leaving (systemd mode, shown as stopping): waits until the front exits.
- more than `max_held` already waiting: refuses at once.

Why this module is over 400 lines: `Front` is the state's one writer, and the action
handlers, the start and stop tasks and the control requests it serves live beside it so
that every write of the state is in this file. What is not the writer can move out: the
per-connection glue (`_Lease`, `_Connection`, accepting, leases) and the systemd entry
(`run_systemd`, `admission_for`, `main`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.front import backoff as saved_backoff
from agent.front.early import Early, free_port, gpu_headroom, worker_environment
from agent.front.gate import Gate
from agent.front.hooks import Admission
from agent.front.state import Action, Event, Mode, State, step
from agent.front.status import Memory, ProviderStatus
from agent.net import auth, counters, deadlines
from agent.net.answers import Answer
from agent.net.deadlines import CLOCK_STEP_S
from agent.net.http import RequestHead
from agent.net.listeners import HttpListeners, Listeners
from agent.net.proxy import FrontSite, Style, Unavailable, serve_tcp, too_many_waiting
from agent.net.upstream import Upstream
from agent.spec import apikeys, paths
from agent.spec.apikeys import KeySet
from agent.spec.provider import Address, Provider
from agent.systemd import preload
from agent.systemd.names import front_unit, worker_unit
from agent.systemd.units import front_after_worker, worker_host
from agent.worker.control import StartFailed, WorkerControl

# A new connection counts as in flight until its first request arrives, at most this long,
# so an idle exit never closes a connection whose request is on its way.
FIRST_REQUEST_GRACE_S = 5.0
# The "Serving: N in flight, M served" line changes with every request: systemd is told it
# at most this often (each STATUS= is a datagram that wakes PID 1), the latest text last.
STATUS_EVERY_S = 1.0
# How long a leaving front waits, from its decision to leave, for PID 1's answers to the
# starts it asked for (polkit holds each for milliseconds, or hundreds of them on a busy
# host): one budget for its own wait and its worker stop's (dbus-next bounds neither), well
# within the front's TimeoutStopSec= margin over stop_timeout_s (units.FRONT_STOP_MARGIN_S),
# which is also to hold the worker's stop. (A stop by SIGTERM drains requests first for up
# to stop_timeout_s; this wait and the worker's stop then share the margin.)
START_ANSWER_WAIT_S = 10.0

Notify = Callable[[str], object]


@dataclass(frozen=True)
class _Outcome:
    """What the start task reports with STARTED or START_FAILED."""

    took_s: float
    tail: tuple[str, ...] = ()  # the worker's last output lines, for the journal
    extra: dict[str, object] = field(default_factory=dict)  # more JSON for the 503
    stopped: bool = False  # PID 1 stopped the worker while it started: no saved backoff


def cold_start_refused(slug: str) -> Unavailable:
    """The 403 for a request whose key may not start the model, once it would."""
    return Unavailable(403, auth.cold_start_message(slug), code=auth.COLD_START_NOT_ALLOWED)


class _Lease:
    __slots__ = ("front", "held", "may_start")

    def __init__(self, front: Front, held: bool) -> None:
        self.front = front
        self.held = held
        self.may_start = True  # False: its key has can_start = false (agent.front.gate)
        if held:
            front._lease_begin()

    def release(self) -> None:
        if self.held:
            self.held = False
            self.front._lease_end()


class _Worker:
    """The Backend the data path sees: the front's worker, its leases and its slots."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.slug = front.provider.slug
        self.request_timeout_s = front.provider.request_timeout_s
        self.upstream = front.upstream
        # Backend.ready, the front's own: a held request waits in one coroutine less.
        self.ready = front.ready
        # A host-network worker admits only its own loopback address: connect from it.
        self.source = front.worker_host if front.worker_host != "127.0.0.1" else None

    def lease(self, path: str | None) -> _Lease:
        lease = self.front.lease(path)
        lease.may_start = self.front.request_gate.may_start
        return lease

    def request_gate(self, req: RequestHead) -> Answer | None:
        """API keys, and the model list while the worker is not ready (agent.front.gate)."""
        answer = self.front.request_gate(req)
        if answer is not None and (cause := self.front.request_gate.cause):
            self.front.counters.count_refused(cause)
        return answer

    def strips_keys(self) -> bool:
        """With API keys on, the worker never sees a client's key."""
        return self.front.request_gate.keys is not None

    def ready_now(self) -> tuple[Address, int] | None:
        front = self.front
        return (front.address, front.generation) if front.state == State.READY else None

    def alive(self, generation: int) -> bool:
        front = self.front
        return front.state == State.READY and front.generation == generation

    def waiting_for_start(self) -> int:
        return len(self.front.waiters)

    async def worker_gone(self, generation: int) -> str | None:
        return await self.front.worker_gone(generation)


class _TcpConnection(_Worker):
    """One TCP connection's Backend, with its first-request grace: until its lease (at most
    FIRST_REQUEST_GRACE_S), it keeps an idle exit from closing it; it does not restart the
    idle timer. The grace is a deadline on the loop's queue (agent.net.deadlines)."""

    def __init__(self, front: Front) -> None:
        super().__init__(front)
        front._fresh(+1)
        loop = asyncio.get_running_loop()
        self.deadlines = deadlines.of(loop)
        self.queued: deadlines.Entry | None = None
        self.due: float | None = loop.time() + FIRST_REQUEST_GRACE_S
        self.deadlines.arm(self, self.due)

    def end_grace(self) -> None:
        if self.due is not None:
            self.due = None
            self.deadlines.drop(self)
            self.front._fresh(-1)

    expire = end_grace  # the grace ran out

    def lease(self, path: str | None) -> _Lease:
        lease = self.front.lease(path)
        self.end_grace()
        return lease


class Front:
    def __init__(
        self,
        provider: Provider,
        worker: WorkerControl,
        listeners: list[socket.socket],
        *,
        exit_on_idle: bool,
        notify: Notify = lambda _s: None,
        log: logging.Logger | None = None,
        admission: Admission | None = None,
        worker_port: int | None = None,
        backoff_file: Path | None = None,
        keys: KeySet | None = None,
    ) -> None:
        self.provider = provider
        self.worker = worker
        self.listeners = listeners
        self.exit_on_idle = exit_on_idle  # systemd: exit when idle; foreground: stop the worker
        self.mode = Mode.ACTIVATED if exit_on_idle else Mode.FOREGROUND
        self.notify = notify
        self.log = log or logging.getLogger(f"providerd.{provider.slug}")
        self.admission = admission or Admission()

        self._state = State.IDLE  # written by _dispatch alone
        self.in_flight = 0
        self.fresh = 0  # connections whose first request has not arrived yet
        self._idle_due = False  # the idle deadline passed while `fresh` connections waited
        self.waiters: list[asyncio.Future[bool]] = []  # True: go on; False: demand again
        # Requests to the worker at once ([runtime] max_concurrency) and its kept connections.
        self.upstream = Upstream(
            provider.max_concurrency,
            provider.max_held,
            on_full=lambda: self.counters.count_refused("too_many_waiting"),
        )
        self.generation = 0
        # The worker's port: fixed, or 0 to pick a free one at each start (foreground mode).
        self.worker_port = provider.worker_port if worker_port is None else worker_port
        # The port of the start asked for before this front's own start (agent.front.early),
        # and what ends that start's adoption once the first attempt is over, however it ends.
        self.first_port: int | None = None
        self.first_start_over: Callable[[], None] = lambda: None
        # A host-network worker listens on its own loopback address (units.worker_loopback).
        self.worker_host = worker_host(provider)
        self.address = Address(self.worker_host, self.worker_port)
        self.backoff_file = backoff_file  # systemd mode: the backoff outlives this front
        # systemd mode: the front's unit is ordered after the worker's (units.front_after_worker)
        self.after_worker = exit_on_idle and front_after_worker(provider)
        self.served = 0
        self.last_used = time.time()
        self.last_start: dict[str, Any] | None = None
        self.failure: str | None = None
        self.failure_extra: dict[str, object] = {}  # more JSON for the 503 (GPU holders)
        self.last_exit: tuple[int, str] | None = None  # (generation, why) of the last lost worker
        self.backoff = saved_backoff.Backoff()
        self.done = asyncio.Event()  # set when the front has released everything and should exit
        self.counters = counters.load(provider.slug, self.log)  # where the last front left off
        self.request_gate = Gate(provider, keys, lambda: self.state)  # API keys, the model list
        self._flush_timer: asyncio.TimerHandle | None = None

        self.site = FrontSite(_Worker(self))
        self.listening: Listeners
        if provider.protocol == "http":  # the connection core, no task per connection
            self.listening = HttpListeners(
                listeners,
                self.site,
                Style(provider.slug),
                self.log,
                FIRST_REQUEST_GRACE_S,
                self._fresh,
            )
            self.site.on_request = self.listening.first_request
        else:
            self.listening = Listeners(listeners, self._tcp_connection, self.log)
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_at = 0.0  # loop time the idle timer is due (it is moved lazily)
        self._status_sent = ""  # the status line systemd was told last
        self._status_stale = False  # it may have changed since: sent when the timer is due
        self._status_timer: asyncio.TimerHandle | None = None
        self._backoff_timer: asyncio.TimerHandle | None = None
        self._connections: set[asyncio.Task[None]] = set()  # TCP relays
        self._background: set[asyncio.Task[None]] = set()
        self._start_cause = ""
        self._starting: asyncio.Task[None] | None = None  # the start under way, if any
        self._stopped = asyncio.Event()  # set while no worker runs and nothing is reserved
        self._stopped.set()
        self._drained = asyncio.Event()  # set while nothing is in flight
        self._drained.set()
        self._worker_news = asyncio.Event()  # replaced and set when a worker exits or starts
        worker.on_exit(self._worker_exited)

    @property
    def state(self) -> State:
        """The provider's state (read-only: `_dispatch` is its one writer)."""
        return self._state

    # ------------------------------------------------------------------ accepting

    def start_accepting(self) -> None:
        self.listening.start()
        self._arm_idle()

    def stop_accepting(self) -> None:
        """Stop accepting for good: what arrives now waits in the kernel for the next front."""
        self.listening.stop()

    def _tcp_connection(self, sock: socket.socket) -> None:
        # The connection counts from now (its grace): an idle decision in this same turn of
        # the loop must see it.
        backend = _TcpConnection(self)
        task = asyncio.get_running_loop().create_task(self._serve_tcp(sock, backend))
        self._connections.add(task)
        task.add_done_callback(self._tcp_done)

    def _tcp_done(self, task: asyncio.Task[None]) -> None:
        self._connections.discard(task)
        self.listening.closed()

    async def _serve_tcp(self, sock: socket.socket, backend: _TcpConnection) -> None:
        try:
            await serve_tcp(sock, backend)
        finally:
            backend.end_grace()

    # ------------------------------------------------------------------ leases

    def lease(self, path: str | None) -> _Lease:
        """One unit of in-flight work (a request, or a TCP connection)."""
        held = path is None or path not in self.provider.idle_ignore_paths
        return _Lease(self, held)

    def _lease_begin(self) -> None:
        self.in_flight += 1
        self._drained.clear()
        self._idle_due = False
        # The idle timer stays armed: firing while a lease is held, it does nothing.
        self._update_status(at_once=False)

    def _lease_end(self) -> None:
        self.in_flight -= 1
        self.served += 1
        self.counters.count_served()
        self._flush_soon()
        self.last_used = time.time()
        if self.in_flight == 0:
            self._drained.set()
            self._arm_idle()
        self._update_status(at_once=False)

    def _arm_idle(self) -> None:
        """The idle deadline, idle_timeout_s from now. The timer is moved lazily: one that is
        due sooner stays and waits again when it fires (requests ending back to back re-arm
        it about once per idle_timeout_s, not once each)."""
        if self.provider.pinned:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
            return  # held until stopped: never released on idle
        loop = asyncio.get_running_loop()
        self._idle_at = loop.time() + self.provider.idle_timeout_s
        if self._idle_timer is None:
            self._idle_timer = loop.call_at(self._idle_at, self._idle_fired)

    def _idle_fired(self) -> None:
        """The idle timer: the deadline, unless it moved later meanwhile (it waits again)."""
        self._idle_timer = None
        loop = asyncio.get_running_loop()
        if loop.time() < self._idle_at - CLOCK_STEP_S:
            self._idle_timer = loop.call_at(self._idle_at, self._idle_fired)
            return
        self._idle()

    def _fresh(self, delta: int) -> None:
        """A new connection began (+1) or ended (-1) its first-request grace."""
        self.fresh += delta
        if self.fresh == 0 and self._idle_due:
            self._idle()

    def _idle(self) -> None:
        """The idle deadline: the table decides what idle means in this state and mode."""
        if self._idle_timer is not None:  # decided now: a timer still due has no more to do
            self._idle_timer.cancel()
            self._idle_timer = None
        if self.in_flight or self.waiters:
            return
        if self.fresh:
            self._idle_due = True  # decide once those connections have sent a request, or not
            return
        self._idle_due = False
        idle_s = self.provider.idle_timeout_s
        self._dispatch(Event.IDLE, f"Idle for {idle_s:g} s, releasing the worker")

    # ------------------------------------------------------------------ the worker

    async def ready(self, cause: str = "request", may_start: bool = True) -> tuple[Address, int]:
        """The worker's address once it is ready. `may_start=False` (a key with
        `can_start = false`): served by a worker that runs or starts, never the cause of a
        start, also when the worker goes away while the request waits."""
        if self.state == State.READY:
            return self.address, self.generation
        if len(self.waiters) + self.upstream.waiting >= self.provider.max_held:
            self.counters.count_refused("too_many_waiting")
            raise too_many_waiting(self.provider.max_held)
        loop = asyncio.get_running_loop()
        while True:  # once more each time the worker stopped under the wait (RETRY_WAITERS)
            if not may_start and self.state not in (State.READY, State.STARTING):
                self.counters.count_refused("forbidden")
                raise cold_start_refused(self.provider.slug)
            future: asyncio.Future[bool] = loop.create_future()
            self.waiters.append(future)
            try:
                self._dispatch(Event.DEMAND, cause)
                served = await future  # a waiter cancelled in the same turn: skipped (done)
            except Unavailable as e:
                if cause == "request":
                    self.counters.count_refused(e.code)  # gpu_unavailable or start_failed
                raise
            finally:
                if future in self.waiters:
                    self.waiters.remove(future)
            if served:
                return self.address, self.generation

    async def worker_gone(self, generation: int, wait_s: float = 1.0) -> str | None:
        """Why worker `generation` went away, once its exit is known (waits up to `wait_s`):
        a request it dropped is answered with the cause, an OOM kill for instance."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                while True:
                    news = self._worker_news
                    if self.last_exit is not None and self.last_exit[0] == generation:
                        return self.last_exit[1]
                    if self.generation != generation:
                        return None  # a newer worker runs: this one was released, not lost
                    await news.wait()
        return None

    def _tell_worker_news(self) -> None:
        """Wake `worker_gone` waiters: a worker exited, or a new one started."""
        news, self._worker_news = self._worker_news, asyncio.Event()
        news.set()

    def warm(self, cause: str = "warm") -> None:
        """Start the worker with no request (`providerctl warm`, an activation)."""
        self._dispatch(Event.DEMAND, cause)

    def _unavailable(self) -> Unavailable:
        retry = max(1.0, self.backoff.left())
        gpu = "holders" in self.failure_extra
        return Unavailable(
            503,
            self.failure or "worker unavailable",
            retry_after_s=retry,
            extra=self.failure_extra,
            code="gpu_unavailable" if gpu else "start_failed",
        )

    def release_worker(self, reason: str) -> None:
        """Stop the worker now (over its VRAM budget, say); the next request starts it again."""
        self._dispatch(Event.RELEASE, reason)

    def _dispatch(self, event: Event, cause: str = "", outcome: _Outcome | None = None) -> None:
        """The one writer of the state: the table's step for `event`, then its actions."""
        self._state, actions = step(self._state, event, self.mode)
        self._perform(actions, cause, outcome)
        self._update_status()

    def _perform(self, actions: Sequence[Action], cause: str, outcome: _Outcome | None) -> None:
        """Do `actions` in order: now, up to the first that waits; the rest once it is done."""
        for i, action in enumerate(actions):
            waiting = self._act(action, cause, outcome)
            if waiting is not None:
                self._spawn(self._then(waiting, actions[i + 1 :], cause, outcome))
                return

    async def _then(
        self,
        waiting: Coroutine[Any, Any, None],
        actions: Sequence[Action],
        cause: str,
        outcome: _Outcome | None,
    ) -> None:
        try:
            await waiting
        finally:  # a hook that fails must not leave held requests waiting for ever
            self._perform(actions, cause, outcome)

    def _act(
        self, action: Action, cause: str, outcome: _Outcome | None
    ) -> Coroutine[Any, Any, None] | None:
        """One action of the table; an action that waits returns what to wait for."""
        if action == Action.START_WORKER:
            self._start_cause = cause
            self._stopped.clear()
            self._starting = self._spawn(self._start_worker())
        elif action == Action.STOP_WORKER:
            if cause:
                self.log.info("%s", cause)
            return self._stop_worker()
        elif action == Action.GIVE_BACK:
            return self._give_back()
        elif action == Action.WATCH:
            return self.admission.started(self)
        elif action == Action.NOTE_READY:
            self._note_ready(outcome.took_s if outcome else 0.0)
        elif action in (Action.WAKE_WAITERS, Action.RETRY_WAITERS):
            for future in self.waiters:
                if not future.done():
                    future.set_result(action == Action.WAKE_WAITERS)
            self.waiters.clear()
        elif action == Action.FAIL_WAITERS:
            error = self._unavailable()
            for future in self.waiters:
                if not future.done():
                    future.set_exception(error)
                    future.exception()  # retrieved here; the waiter re-raises it
            self.waiters.clear()
        elif action == Action.ARM_BACKOFF:
            self.failure = cause
            self.failure_extra = dict(outcome.extra) if outcome else {}
            self._arm_backoff(self.backoff.next_delay())
            if not (outcome and outcome.stopped):
                # A worker stopped while it started is no broken model: its condition on
                # this file must not keep the next activation from starting it.
                self._save_backoff()
        elif action == Action.RESUME_BACKOFF:
            left = self.backoff.left()
            self._arm_backoff(left)
            self.log.info(
                "Worker unavailable after %d failed start(s) (%s); refusing requests for %.1f s more",
                self.backoff.failures,
                cause,
                left,
            )
        elif action == Action.RESET_BACKOFF:
            self.backoff.reset()
            self.failure = None
            self.failure_extra = {}
            self._save_backoff()
        elif action == Action.REPORT_START_FAILURE:
            self.log.error(
                "Failed to start worker: %s; refusing requests for %g s%s",
                cause,
                self.backoff.last_s,
                "".join(f"\n  {line}" for line in (outcome.tail if outcome else ())),
            )
        elif action == Action.REPORT_EXIT:
            self.log.error("Worker exited unexpectedly: %s", cause)
        elif action == Action.ARM_IDLE and self.in_flight == 0:
            self._arm_idle()
        elif action == Action.COUNT_IDLE:
            self.counters.count_idle_release()
        elif action == Action.COUNT_RETIREMENT:
            self.counters.count_retirement()
        elif action == Action.LEAVE:
            # Decided now, in this turn of the loop: nothing may be handed the worker after this.
            self.stop_accepting()
            deadline = asyncio.get_running_loop().time() + START_ANSWER_WAIT_S
            self.worker.answers_by(deadline)  # before the worker's stop waits for them
            self._spawn(self._leave(cause, deadline))
        elif action == Action.LOG_CAUSE:
            self.log.info("%s", cause)
        return None

    def _arm_backoff(self, delay: float) -> None:
        if self._backoff_timer is not None:
            self._backoff_timer.cancel()
        self._backoff_timer = asyncio.get_running_loop().call_later(
            delay, self._dispatch, Event.BACKOFF_OVER, "backoff over"
        )

    async def _start_worker(self) -> None:
        """The start task: reports STARTED or START_FAILED. A release cancels it."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        waiting = len(self.waiters)
        cause = (
            f"on {self._start_cause}"
            if self._start_cause in ("request", "activation")
            else f"({self._start_cause})"
        )
        self.log.info(
            "Starting worker %s%s", cause, f", {waiting} request(s) waiting" if waiting else ""
        )
        try:
            port = self.worker_port or self.first_port or free_port()
            self.first_port = None  # an early start's port serves that start alone
            self.address = Address(self.worker_host, port)
            env, devices = await self.admission.admit(self)
            env = worker_environment(port, self.worker_host, env)
            if self.backoff_file is not None:
                saved_backoff.clear(self.backoff_file)  # else the worker's condition skips it
            # In this task, not in one of wait_for's: a release's cancel reaches the
            # worker's start at once (`_may_start`).
            async with asyncio.timeout(self.provider.start_timeout_s + 60):
                await self.worker.start(env, devices)
        except Exception as e:  # any failure fails the start: held requests get a 503, never a hang
            took = loop.time() - began
            if isinstance(e, (StartFailed, Unavailable, TimeoutError, OSError)):
                reason, tail = _describe_failure(e, self.provider.start_timeout_s)
            else:  # a bug, or the bus: the details are for the journal, not for clients
                self.log.error("Failed to start the worker: unexpected error", exc_info=e)
                slug = self.provider.slug
                reason = f"internal error while starting the worker; see journalctl -u {front_unit(slug)}"
                tail = []
            self.last_start = {"at": time.time(), "took_s": round(took, 3), "result": reason}
            self._record_preload()
            self.counters.count_start_failure()
            self._flush()
            refusal = getattr(e, "refusal", None)  # a GPU refusal: the 503 carries its details
            body = refusal.body() if refusal is not None else None
            extra: dict[str, object] = {}
            if isinstance(body, dict):
                reason = str(body.get("message", reason))
                extra = {k: v for k, v in body.items() if k not in ("error", "message")}
            stopped = isinstance(e, StartFailed) and e.stopped
            outcome = _Outcome(took, tuple(tail), extra, stopped)
            self._dispatch(Event.START_FAILED, reason, outcome)
            return
        finally:
            over, self.first_start_over = self.first_start_over, lambda: None
            over()
        self._dispatch(Event.STARTED, outcome=_Outcome(loop.time() - began))

    def _note_ready(self, took: float) -> None:
        self.generation += 1
        self._tell_worker_news()
        self.last_start = {"at": time.time(), "took_s": round(took, 3), "result": "ready"}
        self._record_preload()
        self.counters.count_start(took)
        # Not now: the write's fsync (5-20 ms on a busy disk) would hold the event loop,
        # and the held requests with it, at the very moment they go to the worker.
        self._flush_soon()
        self.log.info("Worker ready after %.1f s", took)

    def _flush_soon(self) -> None:
        if self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(counters.FLUSH_S, self._flush)

    def _flush(self) -> None:
        """Persist the counters now (worker started or stopped, the front exits)."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        counters.save(self.provider.slug, self.counters, self.log)

    def _record_preload(self) -> None:
        if self._start_cause == preload.CAUSE and self.last_start is not None:
            preload.record(self.provider.slug, self.last_start, self.log)

    async def _stop_worker(self) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        start = self._starting
        if start is not None and not start.done():
            start.cancel()  # released while it started: the start ends here, the stop reports
            await asyncio.wait({start})
        try:
            await self.worker.stop()
            self.upstream.clear()
            await self.admission.released(self)
            self.log.info("Worker stopped after %.1f s", loop.time() - began)
        except Exception:
            # The stop still ends: held requests are retried and waiters on it go on.
            self.log.exception("Stopping the worker failed")
        finally:
            self._flush()
            self._stopped.set()
            self._dispatch(Event.STOPPED)

    async def _give_back(self) -> None:
        """No worker after a failure: what admission reserved goes back."""
        try:
            await self.admission.released(self)
        finally:
            self._stopped.set()

    def _worker_exited(self, reason: str) -> None:
        self.last_exit = (self.generation, reason)
        self.upstream.clear()
        self._tell_worker_news()
        self._dispatch(Event.WORKER_EXITED, reason)

    def _save_backoff(self) -> None:
        if self.backoff_file is None:
            return
        try:
            if self.backoff.failures:
                saved = saved_backoff.Saved(
                    self.backoff.failures,
                    self.backoff.until,
                    self.failure or "start failed",
                    saved_backoff.manifest_key(self.provider),
                )
                saved_backoff.save(self.backoff_file, saved)
            else:
                saved_backoff.clear(self.backoff_file)
        except OSError as e:
            self.log.warning("Failed to keep the backoff in %s: %s, ignoring", self.backoff_file, e)

    def restore_backoff(self, saved: saved_backoff.Saved) -> None:
        """Go on with an earlier front's backoff (before accepting): refuse until it runs out."""
        self.failure = saved.reason
        if self.backoff.resume(saved) > 0:  # else over: the next demand starts the worker
            self._dispatch(Event.BACKOFF_RESUMED, saved.reason)

    # ------------------------------------------------------------------ control

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            what = getattr(task.get_coro(), "__qualname__", "a background task")
            self.log.error("Failed to finish %s", what, exc_info=task.exception())

    def _may_start(self) -> bool:
        """Whether the start task may still ask PID 1 for a start: under way, and neither
        cancelled yet nor, being cancelled, through that cancel in the worker's start (a
        cancel taken before the worker's start was entered keeps it from being entered)."""
        start = self._starting
        if start is None or start.done():
            return False
        return not start.cancelling() or self.worker.sending()

    async def _leave(self, cause: str, deadline: float) -> None:
        """The end of an activated front: once the worker is gone, close up and exit.

        A StartUnit sent and not answered yet (held by polkit) is taken by PID 1 later.
        While the front's own stop job is installed (SIGTERM), job mode "fail" refuses it;
        with the front gone it would start the worker and, by its BindsTo=, the front
        again. So the front exits only once it is answered. And it says STOPPING=1 only
        then, where it is leaving on its own (a stop on the control socket, idle): a front
        "deactivating" with no stop job would have PID 1 queue that start of the front
        behind its exit, where an active front takes it as done; the worker it started is
        stopped by the front's own stop, which goes out after the answer (agent.systemd.bus).
        A start under way is first let go (`_stop_worker` cancels it), so that it sends no
        StartUnit after STOPPING=1. The waits end at `deadline`, the worker stop's too;
        STOPPING=1 goes out once the answers are in, the worker's stop is awaited after.
        """
        loop = asyncio.get_running_loop()
        while self._may_start() and loop.time() < deadline:
            await asyncio.sleep(0.005)
        if self._may_start() or not await self.worker.answered(deadline - loop.time()):
            self.log.warning("Leaving with a start of the worker not answered by systemd")
        self.notify(f"STOPPING=1\nSTATUS={cause}")
        await self._stopped.wait()
        for task in list(self._connections):
            task.cancel()
        if isinstance(self.listening, HttpListeners):
            self.listening.abort_all()
        self._flush()
        self.done.set()

    async def stop(self, grace_s: float, by_systemd: bool = False) -> dict[str, Any]:
        """Release now, letting requests in flight finish within `grace_s`.

        `by_systemd`: PID 1 is stopping the front (SIGTERM). Where the front is ordered
        after its worker (`units.front_after_worker`), PID 1 stops the worker once the
        front is gone, and a stop of ours would wait for the front's own: the front leaves
        it to PID 1."""
        if by_systemd and self.after_worker:
            self.worker.leave_stop_to_systemd()
        if self.in_flight:
            self.log.info("Stopping: waiting up to %g s for %d request(s)", grace_s, self.in_flight)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), grace_s)
        cut = self.in_flight
        reason = "Stopping on request" + (f", cutting {cut} request(s)" if cut else "")
        self._dispatch(Event.STOP, reason)
        await (self.done if self.mode == Mode.ACTIVATED else self._stopped).wait()
        self._flush()
        return {"stopped": True, "cut": cut}

    async def retire(self) -> dict[str, Any]:
        """Give the card back for another provider, unless something is in flight."""
        busy = self.in_flight + len(self.waiters)
        if busy:
            return {"retired": False, "busy": busy}
        if self.provider.pinned:
            return {"retired": False, "busy": 0, "pinned": True}
        self._dispatch(Event.RETIRE, "Retiring the worker to make room on the GPU")
        await self._stopped.wait()
        return {"retired": True}

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """The control socket's requests."""
        op = request.get("op")
        if op == "status":
            return await self.status()
        if op == "warm":
            try:
                await self.ready("warm")
            except Unavailable as e:
                return {"state": self.state.shown, "error": e.error}
            return {"state": self.state.shown, "error": None}
        if op == "stop":
            return await self.stop(float(request.get("grace_s", self.provider.stop_timeout_s)))
        if op == "retire":
            return await self.retire()
        if op == "keys":
            return self.reload_keys(request)
        return {"error": f"unknown op {op!r}"}

    def reload_keys(self, request: dict[str, Any]) -> dict[str, Any]:
        """`providerctl reload` (root) hands over the keys file as it is now (hashes only):
        a changed or revoked key takes effect at once, without restarting the model."""
        if request.get("peer_uid") not in paths.trusted_uids():
            return {"error": "only root may change the API keys"}
        keys = apikeys.from_wire(request.get("keys"), str(paths.keys_file()))
        changed = apikeys.to_wire(keys) != apikeys.to_wire(self.request_gate.keys)
        self.request_gate.keys = keys
        if changed and keys is None:
            self.log.info("API keys are off now")
        elif changed:
            apikeys.report(keys, self.log)
        return {"keys": None if keys is None else len(keys.keys)}

    async def status(self) -> dict[str, Any]:
        idle_for = None
        if self.in_flight == 0 and self.state == State.READY:
            idle_for = round(time.time() - self.last_used, 1)
        retry = None
        if self.state == State.BACKOFF:
            retry = round(self.backoff.left(), 1)
        try:
            memory = await asyncio.wait_for(self.worker.memory(), 2)
        except Exception:
            memory = {}
        return ProviderStatus(
            slug=self.provider.slug,
            state=self.state.shown,
            in_flight=self.in_flight,
            waiting=len(self.waiters) + self.upstream.waiting,
            to_worker=self.upstream.in_use,
            served=self.served,
            idle_for_s=idle_for,
            last_used=self.last_used,
            last_start=self.last_start,
            failure=self.failure,
            retry_after_s=retry,
            memory=Memory(memory.get("current"), memory.get("max")),
            gpu=self.admission.status(self),
            pinned=self.provider.pinned,
            counters=self.counters.to_json(),
        ).to_json()

    def _update_status(self, at_once: bool = True) -> None:
        """Tell systemd the status line: a state's change at once; a request's (`at_once`
        False) at most every STATUS_EVERY_S, the latest line last."""
        if self._status_timer is not None and not at_once:
            self._status_stale = True  # the line is made and sent when the timer is due
            return
        self._send_status()
        if not at_once:
            loop = asyncio.get_running_loop()
            self._status_timer = loop.call_later(STATUS_EVERY_S, self._status_due)

    def _status_due(self) -> None:
        self._status_timer = None
        if self._status_stale:
            self._status_stale = False
            self._send_status()
            self._status_timer = asyncio.get_running_loop().call_later(
                STATUS_EVERY_S, self._status_due
            )

    def _send_status(self) -> None:
        text = self._status_line()
        if text != self._status_sent:
            self._status_sent = text
            self.notify(f"STATUS={text}")

    def _status_line(self) -> str:
        if self.state == State.READY:
            text = f"Serving: {self.in_flight} in flight, {self.served} served"
        elif self.state == State.STARTING:
            text = f"Loading the worker, {len(self.waiters)} request(s) waiting"
        elif self.state == State.BACKOFF:
            text = f"Worker unavailable ({self.failure}); next try after the backoff"
        elif self.state in (State.STOPPING, State.LEAVING):
            text = "Releasing the worker"
        else:
            text = "Idle, worker not running"
        return text


def _describe_failure(e: BaseException, timeout_s: float) -> tuple[str, list[str]]:
    if isinstance(e, StartFailed):
        return e.reason, e.log_tail
    if isinstance(e, Unavailable):
        return e.error, []
    if isinstance(e, TimeoutError):
        return f"worker did not become ready within {timeout_s:g} s", []
    return f"{e}", []


# ---------------------------------------------------------------------------- systemd entry


async def run_systemd(slug: str, early: Early | None = None) -> int:
    """The front as `provider@SLUG.service` runs it.

    A start the front decides was asked for before this (`early`, agent.front.early) where
    it could be decided at once: this start follows its job. Otherwise what decides the
    worker's start comes first; the control socket and signal handlers are set up while
    the start is under way.
    """
    import signal

    from agent import signals
    from agent.net import rpc
    from agent.spec import paths
    from agent.spec.manifest import ManifestError
    from agent.systemd.bus import DbusSystemd
    from agent.systemd.manifests import load
    from agent.systemd.notify import notify
    from agent.worker.control import SystemdWorker

    log = logging.getLogger(f"providerd.{slug}")
    early = early or Early()
    early.replay()
    try:
        provider = early.provider or load(slug)
    except ManifestError as e:
        for problem in e.problems:
            log.error("Failed to load manifest: %s", problem)
        return 1
    from agent.systemd.activation import inherited_listeners

    stale = early.stale(provider)
    listeners = inherited_listeners()
    bus = DbusSystemd()
    await bus.connect()
    if stale:
        # A stale record costs a restart, never a wrong port or card.
        with contextlib.suppress(Exception):  # the front's own start says what fails
            await bus.stop_unit(worker_unit(slug))
    backoff_file = paths.backoff_file(slug)
    keys = apikeys.load()  # the credential providerd-keys, while the keys file exists
    apikeys.report(keys, log)
    # While either file exists the worker's conditions kept systemd from starting it.
    with_front = provider.starts_with_front and not backoff_file.exists() and keys is None
    saved = None if with_front else saved_backoff.load(backoff_file, provider)
    worker = SystemdWorker(
        bus, slug, provider.start_timeout_s, with_front=with_front, ready=provider.ready
    )
    if early.start is not None and early.start.job:
        worker.adopt(early.start.job, early.start.env, early.start.devices)
    front = Front(
        provider,
        worker,
        listeners,
        exit_on_idle=True,
        notify=notify,
        log=log,
        admission=admission_for(provider, worker, early),
        worker_port=provider.known_worker_port,
        backoff_file=backoff_file,
        keys=keys,
    )
    if saved is not None:
        front.restore_backoff(saved)
    if early.start is not None:
        front.first_port = early.start.port
        front.first_start_over = worker.drop_adopted
    front.start_accepting()
    notify("READY=1")
    cause = preload.activation_cause(provider)
    if keys is None or cause == preload.CAUSE:
        # A connection, a plain start, the boot. With API keys on, a connection alone
        # starts nothing: the first request whose key may start the model does.
        front.warm(cause)
    server = await rpc.serve(paths.control_socket(slug), front.handle)
    loop = asyncio.get_running_loop()
    grace = provider.stop_timeout_s
    stopping: set[asyncio.Task[dict[str, Any]]] = set()
    with signals.handling(
        loop,
        {
            signal.SIGTERM: lambda: stopping.add(
                loop.create_task(front.stop(grace, by_systemd=True))
            )
        },
    ):
        await front.done.wait()
    server.close()
    bus.close()
    return 0


def admission_for(
    provider: Provider, worker: WorkerControl, early: Early | None = None
) -> Admission:
    """GPU admission for GPU providers; CPU providers always fit. What an early start
    (agent.front.early) admitted, read and opened is taken over."""
    if not provider.uses_gpu:
        return Admission()
    from agent.front.gpu_hooks import GpuAdmission

    if early is not None and early.gpu_read:
        headroom = early.headroom_bytes  # read, and its problems noted, already
    else:
        headroom, problems = gpu_headroom()
        for problem in problems:
            logging.getLogger("providerd").warning("%s", problem)
    start = early.start if early is not None else None
    return GpuAdmission(
        provider,
        worker,
        nvml=early.nvml if early is not None else None,
        admitted=start.admitted if start is not None else None,
        headroom_bytes=headroom,
    )


def main(argv: list[str], early: Early | None = None) -> int:
    from agent.log import setup
    from agent.net import loop

    if len(argv) != 1:
        print("usage: python3 -m agent.front SLUG", flush=True)
        return 2
    setup(journal=True)
    with contextlib.suppress(KeyboardInterrupt):
        return loop.run(run_systemd(argv[0], early))
    return 0
