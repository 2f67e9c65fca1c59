"""The provider's state table: a pure function from (state, event) to (state, actions).

One method of the front (`Front._dispatch`) owns the state and is its only writer;
connections, timers, the start and stop tasks and control requests only send it events,
and it does what the table returns. Every (state, event) pair is listed, so nothing
happens by accident: a pair that does not apply maps to itself with no action.

    idle ──demand──▶ starting ──started──▶ ready ──release/idle/stop/retire──▶ stopping
      ▲                 │                    │                                    │
      │           start_failed         worker_exited                           stopped
      │                 ▼                    ▼                                    │
      └──backoff_over── backoff ◀────────────┘                  idle ◀────────────┘

A release, `stop` or `retire` while the worker starts goes to stopping too: the stop
cancels the start. A request held while the worker stops is told to demand again once
it is stopped (RETRY_WAITERS): the first such demand starts a fresh worker, the others
join it.

Two modes differ in three events. In the foreground (`providerctl serve`) idle, `stop`
and `retire` stop the worker and the front stays. A systemd-activated front lets go for
good instead: it stops accepting, stops the worker and exits (LEAVING, shown as
"stopping"); what it has not accepted waits in the kernel for the next front.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    IDLE = "idle"  # no worker; the next demand starts one
    STARTING = "starting"  # a worker start is under way; demands wait for it
    READY = "ready"  # the worker answers; requests are proxied
    STOPPING = "stopping"  # the worker is being released; demands wait, then start again
    BACKOFF = "backoff"  # the last start failed or the worker crashed; demands are refused
    LEAVING = "leaving"  # an activated front lets go for good; it exits once the worker is gone

    @property
    def shown(self) -> str:
        """The name status and metrics use: a front that is leaving shows as stopping."""
        return State.STOPPING.value if self is State.LEAVING else self.value


class Event(enum.Enum):
    DEMAND = "demand"  # a request (or `warm`) wants the worker
    STARTED = "started"  # the worker answers
    START_FAILED = "start_failed"  # the start failed, timed out or was refused
    WORKER_EXITED = "worker_exited"  # the worker went away on its own
    RELEASE = "release"  # stop the worker, the front stays (over its VRAM budget, say)
    IDLE = "idle"  # nothing in flight or waiting for idle_timeout_s
    STOP = "stop"  # `providerctl stop` (or the front's SIGTERM)
    RETIRE = "retire"  # another provider needs the card, and nothing is in flight here
    STOPPED = "stopped"  # the worker is gone after a release
    BACKOFF_OVER = "backoff_over"  # the backoff after a failure has run out
    BACKOFF_RESUMED = "backoff_resumed"  # an earlier front's backoff still runs (at start-up)


class Mode(enum.Enum):
    FOREGROUND = "foreground"  # `providerctl serve`: the front outlives its workers
    ACTIVATED = "activated"  # systemd: the front exits when it lets its worker go


class Action(enum.Enum):
    START_WORKER = "start_worker"  # a task starts it and reports STARTED or START_FAILED
    STOP_WORKER = "stop_worker"  # a task stops it, cancelling a start under way; then STOPPED
    GIVE_BACK = "give_back"  # no worker after a failure: give back what admission reserved
    WATCH = "watch"  # the worker answers: admission starts watching it
    NOTE_READY = "note_ready"  # a new worker generation: log, count and record the start
    WAKE_WAITERS = "wake_waiters"  # held requests go on to the worker
    RETRY_WAITERS = "retry_waiters"  # held requests demand again (the worker is stopped)
    FAIL_WAITERS = "fail_waiters"  # held requests get the failure
    ARM_BACKOFF = "arm_backoff"  # remember the failure and wait a growing delay
    RESUME_BACKOFF = "resume_backoff"  # wait out the rest of an earlier front's backoff
    RESET_BACKOFF = "reset_backoff"  # a start succeeded: the next failure starts small again
    REPORT_START_FAILURE = "report_start_failure"  # log why, and for how long requests are refused
    REPORT_EXIT = "report_exit"  # log the unexpected exit
    ARM_IDLE = "arm_idle"  # start the idle timer if nothing is in flight
    COUNT_IDLE = "count_idle"  # an idle release, for the counters
    COUNT_RETIREMENT = "count_retirement"  # a retirement, for the counters
    LEAVE = "leave"  # stop accepting, say STOPPING=1, exit once the worker is gone
    LOG_CAUSE = "log_cause"  # nothing to stop: log why the front leaves


S, E, A = State, Event, Action

_NOTHING: tuple[Action, ...] = ()
_FAIL = (A.ARM_BACKOFF, A.REPORT_START_FAILURE, A.GIVE_BACK, A.FAIL_WAITERS)
_CRASH = (A.REPORT_EXIT, A.ARM_BACKOFF, A.FAIL_WAITERS, A.GIVE_BACK)

# Pairs that do something, in the foreground; every other pair changes nothing.
_FOREGROUND: dict[tuple[State, Event], tuple[State, tuple[Action, ...]]] = {
    # idle: nothing runs
    (S.IDLE, E.DEMAND): (S.STARTING, (A.START_WORKER,)),
    (S.IDLE, E.BACKOFF_RESUMED): (S.BACKOFF, (A.RESUME_BACKOFF,)),
    # starting: one start serves every demand; it reports its own outcome (a worker that
    # exits while it starts fails the start), and a release stops it
    (S.STARTING, E.STARTED): (
        S.READY,
        (A.NOTE_READY, A.RESET_BACKOFF, A.WAKE_WAITERS, A.ARM_IDLE, A.WATCH),
    ),
    (S.STARTING, E.START_FAILED): (S.BACKOFF, _FAIL),
    (S.STARTING, E.RELEASE): (S.STOPPING, (A.STOP_WORKER,)),
    (S.STARTING, E.STOP): (S.STOPPING, (A.STOP_WORKER,)),
    (S.STARTING, E.RETIRE): (S.STOPPING, (A.COUNT_RETIREMENT, A.STOP_WORKER)),
    # ready: requests flow (a demand here is answered at once, whoever asks)
    (S.READY, E.DEMAND): (S.READY, (A.WAKE_WAITERS,)),
    (S.READY, E.WORKER_EXITED): (S.BACKOFF, _CRASH),
    (S.READY, E.RELEASE): (S.STOPPING, (A.STOP_WORKER,)),
    (S.READY, E.IDLE): (S.STOPPING, (A.COUNT_IDLE, A.STOP_WORKER)),
    (S.READY, E.STOP): (S.STOPPING, (A.STOP_WORKER,)),
    (S.READY, E.RETIRE): (S.STOPPING, (A.COUNT_RETIREMENT, A.STOP_WORKER)),
    # stopping: demands wait; once stopped they demand again (the stop cancelled any start,
    # so no start's outcome arrives here; nor in leaving, where demands wait for the exit)
    (S.STOPPING, E.STOPPED): (S.IDLE, (A.RETRY_WAITERS,)),
    # backoff: a broken model is not restarted once per request
    (S.BACKOFF, E.DEMAND): (S.BACKOFF, (A.FAIL_WAITERS,)),
    (S.BACKOFF, E.BACKOFF_OVER): (S.IDLE, ()),
}

# Where an activated front differs: idle, `stop` and `retire` let the front go.
_ACTIVATED = {
    **_FOREGROUND,
    (S.IDLE, E.IDLE): (S.LEAVING, (A.LEAVE, A.LOG_CAUSE)),
    (S.READY, E.IDLE): (S.LEAVING, (A.LEAVE, A.COUNT_IDLE, A.STOP_WORKER)),
    (S.STOPPING, E.IDLE): (S.LEAVING, (A.LEAVE, A.LOG_CAUSE)),
    (S.BACKOFF, E.IDLE): (S.LEAVING, (A.LEAVE, A.LOG_CAUSE)),
    (S.IDLE, E.STOP): (S.LEAVING, (A.LEAVE, A.LOG_CAUSE)),
    (S.STARTING, E.STOP): (S.LEAVING, (A.LEAVE, A.STOP_WORKER)),
    (S.READY, E.STOP): (S.LEAVING, (A.LEAVE, A.STOP_WORKER)),
    (S.STOPPING, E.STOP): (S.LEAVING, (A.LEAVE, A.LOG_CAUSE)),
    (S.BACKOFF, E.STOP): (S.LEAVING, (A.LEAVE, A.LOG_CAUSE)),
    (S.STARTING, E.RETIRE): (S.LEAVING, (A.LEAVE, A.COUNT_RETIREMENT, A.STOP_WORKER)),
    (S.READY, E.RETIRE): (S.LEAVING, (A.LEAVE, A.COUNT_RETIREMENT, A.STOP_WORKER)),
}


def _complete(
    pairs: dict[tuple[State, Event], tuple[State, tuple[Action, ...]]],
) -> dict[tuple[State, Event], tuple[State, tuple[Action, ...]]]:
    return {(s, e): pairs.get((s, e), (s, _NOTHING)) for s in State for e in Event}


TABLES = {Mode.FOREGROUND: _complete(_FOREGROUND), Mode.ACTIVATED: _complete(_ACTIVATED)}
TABLE = TABLES[Mode.FOREGROUND]


def step(
    state: State, event: Event, mode: Mode = Mode.FOREGROUND
) -> tuple[State, tuple[Action, ...]]:
    """The next state and what to do, for one event."""
    return TABLES[mode][(state, event)]
