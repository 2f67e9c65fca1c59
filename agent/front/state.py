"""The provider's state table: a pure function from (state, event) to (state, actions).

One task in the front owns the state and is its only writer; everything else sends
it events. Every (state, event) pair is listed, so nothing happens by accident:
a pair that does not apply maps to itself with no action.

    idle ──demand──▶ starting ──started──▶ ready ──idle/stop──▶ stopping ──stopped──▶ idle
                        │                    │
                  start_failed         worker_exited
                        ▼                    ▼
                     backoff ◀───────────────┘ ──backoff_over──▶ idle
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    IDLE = "idle"  # no worker; the next demand starts one
    STARTING = "starting"  # a worker start is under way; demands wait for it
    READY = "ready"  # the worker answers; requests are proxied
    STOPPING = (
        "stopping"  # the worker is being released; demands wait for the stop, then start again
    )
    BACKOFF = (
        "backoff"  # the last start failed or the worker crashed; demands are refused until it ends
    )


class Event(enum.Enum):
    DEMAND = "demand"  # a request (or `warm`) wants the worker
    STARTED = "started"  # the worker answers
    START_FAILED = "start_failed"  # the start failed, timed out or was refused
    WORKER_EXITED = "worker_exited"  # the worker went away on its own
    RELEASE = "release"  # idle timeout, `stop`, or retirement for another provider
    STOPPED = "stopped"  # the worker is gone after a release
    BACKOFF_OVER = "backoff_over"  # the backoff after a failure has run out


class Action(enum.Enum):
    START_WORKER = "start_worker"
    STOP_WORKER = "stop_worker"
    WAKE_WAITERS = "wake_waiters"  # held requests go on to the worker
    FAIL_WAITERS = "fail_waiters"  # held requests get the failure
    ARM_BACKOFF = "arm_backoff"  # remember the failure for a growing backoff
    RESET_BACKOFF = "reset_backoff"  # a start succeeded: the next failure starts small again
    ARM_IDLE = "arm_idle"  # start the idle timer if nothing is in flight


S, E, A = State, Event, Action

TABLE: dict[tuple[State, Event], tuple[State, tuple[Action, ...]]] = {
    # idle: nothing runs
    (S.IDLE, E.DEMAND): (S.STARTING, (A.START_WORKER,)),
    (S.IDLE, E.STARTED): (S.IDLE, ()),
    (S.IDLE, E.START_FAILED): (S.IDLE, ()),
    (S.IDLE, E.WORKER_EXITED): (S.IDLE, ()),
    (S.IDLE, E.RELEASE): (S.IDLE, ()),
    (S.IDLE, E.STOPPED): (S.IDLE, ()),
    (S.IDLE, E.BACKOFF_OVER): (S.IDLE, ()),
    # starting: one start serves every demand
    (S.STARTING, E.DEMAND): (S.STARTING, ()),
    (S.STARTING, E.STARTED): (S.READY, (A.RESET_BACKOFF, A.WAKE_WAITERS, A.ARM_IDLE)),
    (S.STARTING, E.START_FAILED): (S.BACKOFF, (A.ARM_BACKOFF, A.FAIL_WAITERS)),
    (S.STARTING, E.WORKER_EXITED): (S.BACKOFF, (A.ARM_BACKOFF, A.FAIL_WAITERS)),
    (S.STARTING, E.RELEASE): (S.STOPPING, (A.STOP_WORKER,)),
    (S.STARTING, E.STOPPED): (S.STARTING, ()),
    (S.STARTING, E.BACKOFF_OVER): (S.STARTING, ()),
    # ready: requests flow
    (S.READY, E.DEMAND): (S.READY, ()),
    (S.READY, E.STARTED): (S.READY, ()),
    (S.READY, E.START_FAILED): (S.READY, ()),
    (S.READY, E.WORKER_EXITED): (S.BACKOFF, (A.ARM_BACKOFF, A.FAIL_WAITERS)),
    (S.READY, E.RELEASE): (S.STOPPING, (A.STOP_WORKER,)),
    (S.READY, E.STOPPED): (S.READY, ()),
    (S.READY, E.BACKOFF_OVER): (S.READY, ()),
    # stopping: demands wait; the front starts again once stopped if anyone waits
    (S.STOPPING, E.DEMAND): (S.STOPPING, ()),
    (S.STOPPING, E.STARTED): (S.STOPPING, ()),
    (S.STOPPING, E.START_FAILED): (S.STOPPING, ()),
    (S.STOPPING, E.WORKER_EXITED): (S.STOPPING, ()),
    (S.STOPPING, E.RELEASE): (S.STOPPING, ()),
    (S.STOPPING, E.STOPPED): (S.IDLE, ()),
    (S.STOPPING, E.BACKOFF_OVER): (S.STOPPING, ()),
    # backoff: a broken model is not restarted once per request
    (S.BACKOFF, E.DEMAND): (S.BACKOFF, (A.FAIL_WAITERS,)),
    (S.BACKOFF, E.STARTED): (S.BACKOFF, ()),
    (S.BACKOFF, E.START_FAILED): (S.BACKOFF, ()),
    (S.BACKOFF, E.WORKER_EXITED): (S.BACKOFF, ()),
    (S.BACKOFF, E.RELEASE): (S.BACKOFF, ()),
    (S.BACKOFF, E.STOPPED): (S.BACKOFF, ()),
    (S.BACKOFF, E.BACKOFF_OVER): (S.IDLE, ()),
}


def step(state: State, event: Event) -> tuple[State, tuple[Action, ...]]:
    """The next state and what to do, for one event."""
    return TABLE[(state, event)]


class Backoff:
    """A growing delay after failures, shared by every waiter: 1 s, 2 s, 4 s … up to a cap."""

    def __init__(self, first_s: float = 1.0, cap_s: float = 60.0) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self.failures = 0

    def next_delay(self) -> float:
        delay = min(self.cap_s, self.first_s * float(2**self.failures))
        self.failures += 1
        return delay

    def reset(self) -> None:
        self.failures = 0
