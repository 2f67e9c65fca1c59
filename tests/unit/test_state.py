"""The state table, pair by pair: every (state, event) has an expected outcome here, in each
mode, and the front's journeys through it are walked step by step."""

from __future__ import annotations

import pytest

from agent.front.backoff import Backoff
from agent.front.state import TABLE, TABLES, Action, Event, Mode, State, step

S, E, A = State, Event, Action
# What was reserved goes back before the held requests hear of the failure.
FAIL = (A.ARM_BACKOFF, A.REPORT_START_FAILURE, A.GIVE_BACK, A.FAIL_WAITERS)

FOREGROUND = {
    (S.IDLE, E.DEMAND): (S.STARTING, (A.START_WORKER,)),
    (S.IDLE, E.BACKOFF_RESUMED): (S.BACKOFF, (A.RESUME_BACKOFF,)),
    (S.STARTING, E.STARTED): (
        S.READY,
        (A.NOTE_READY, A.RESET_BACKOFF, A.WAKE_WAITERS, A.ARM_IDLE, A.WATCH),
    ),
    (S.STARTING, E.START_FAILED): (S.BACKOFF, FAIL),
    (S.STARTING, E.RELEASE): (S.STOPPING, (A.STOP_WORKER,)),
    (S.STARTING, E.STOP): (S.STOPPING, (A.STOP_WORKER,)),
    (S.STARTING, E.RETIRE): (S.STOPPING, (A.COUNT_RETIREMENT, A.STOP_WORKER)),
    (S.READY, E.DEMAND): (S.READY, (A.WAKE_WAITERS,)),
    (S.READY, E.WORKER_EXITED): (
        S.BACKOFF,
        (A.REPORT_EXIT, A.ARM_BACKOFF, A.FAIL_WAITERS, A.GIVE_BACK),
    ),
    (S.READY, E.RELEASE): (S.STOPPING, (A.STOP_WORKER,)),
    (S.READY, E.IDLE): (S.STOPPING, (A.COUNT_IDLE, A.STOP_WORKER)),
    (S.READY, E.STOP): (S.STOPPING, (A.STOP_WORKER,)),
    (S.READY, E.RETIRE): (S.STOPPING, (A.COUNT_RETIREMENT, A.STOP_WORKER)),
    (S.STOPPING, E.STOPPED): (S.IDLE, (A.RETRY_WAITERS,)),
    (S.BACKOFF, E.DEMAND): (S.BACKOFF, (A.FAIL_WAITERS,)),
    (S.BACKOFF, E.BACKOFF_OVER): (S.IDLE, ()),
}
LEAVE_QUIETLY = (S.LEAVING, (A.LEAVE, A.LOG_CAUSE))
ACTIVATED = {
    **FOREGROUND,
    (S.IDLE, E.IDLE): LEAVE_QUIETLY,
    (S.READY, E.IDLE): (S.LEAVING, (A.LEAVE, A.COUNT_IDLE, A.STOP_WORKER)),
    (S.STOPPING, E.IDLE): LEAVE_QUIETLY,
    (S.BACKOFF, E.IDLE): LEAVE_QUIETLY,
    (S.IDLE, E.STOP): LEAVE_QUIETLY,
    (S.STARTING, E.STOP): (S.LEAVING, (A.LEAVE, A.STOP_WORKER)),
    (S.READY, E.STOP): (S.LEAVING, (A.LEAVE, A.STOP_WORKER)),
    (S.STOPPING, E.STOP): LEAVE_QUIETLY,
    (S.BACKOFF, E.STOP): LEAVE_QUIETLY,
    (S.STARTING, E.RETIRE): (S.LEAVING, (A.LEAVE, A.COUNT_RETIREMENT, A.STOP_WORKER)),
    (S.READY, E.RETIRE): (S.LEAVING, (A.LEAVE, A.COUNT_RETIREMENT, A.STOP_WORKER)),
}
EXPECTED = {Mode.FOREGROUND: FOREGROUND, Mode.ACTIVATED: ACTIVATED}


@pytest.mark.parametrize("mode", list(Mode))
def test_table_is_complete(mode: Mode) -> None:
    assert set(TABLES[mode]) == {(s, e) for s in State for e in Event}
    assert TABLE is TABLES[Mode.FOREGROUND]


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("event", list(Event))
def test_pair(mode: Mode, state: State, event: Event) -> None:
    # Pairs not listed must change nothing: a stray event is harmless.
    assert step(state, event, mode) == EXPECTED[mode].get((state, event), (state, ()))


def walk(
    events: list[Event], mode: Mode = Mode.FOREGROUND, state: State = S.IDLE
) -> tuple[State, list[Action]]:
    done: list[Action] = []
    for event in events:
        state, actions = step(state, event, mode)
        done += actions
    return state, done


def test_one_start_serves_every_demand() -> None:
    state, actions = walk([E.DEMAND] * 51)
    assert (state, actions.count(A.START_WORKER)) == (S.STARTING, 1)
    state, actions = walk([E.STARTED, *[E.DEMAND] * 20], state=state)
    assert state == S.READY and A.START_WORKER not in actions


def test_a_demand_held_over_a_stop_starts_a_fresh_worker_once() -> None:
    """The waiters are told to demand again once the worker is stopped; only the first
    of their demands starts it (no re-demand inside the writer)."""
    state, actions = walk([E.DEMAND, E.STARTED, E.RELEASE, E.DEMAND, E.DEMAND])
    assert state == S.STOPPING and actions.count(A.START_WORKER) == 1
    state, actions = walk([E.STOPPED, E.DEMAND, E.DEMAND], state=state)
    assert state == S.STARTING
    assert actions == [A.RETRY_WAITERS, A.START_WORKER]


@pytest.mark.parametrize("mode", list(Mode))
def test_idle_never_stops_a_start_under_way(mode: Mode) -> None:
    assert step(S.STARTING, E.IDLE, mode) == (S.STARTING, ())


@pytest.mark.parametrize("event", list(Event))
def test_a_front_that_leaves_never_starts_again(event: Event) -> None:
    state, actions = step(S.LEAVING, event, Mode.ACTIVATED)
    assert (state, actions) == (S.LEAVING, ())


def test_the_foreground_front_never_leaves() -> None:
    table = TABLES[Mode.FOREGROUND]
    moves = [v for (here, _), v in table.items() if here != S.LEAVING]
    assert all(to != S.LEAVING and A.LEAVE not in acts for to, acts in moves)


def test_a_failed_start_refuses_until_the_backoff_is_over_then_starts_once() -> None:
    state, actions = walk([E.DEMAND, E.START_FAILED, E.DEMAND, E.DEMAND])
    assert state == S.BACKOFF and actions.count(A.FAIL_WAITERS) == 3
    assert actions.count(A.ARM_BACKOFF) == 1 and actions.count(A.START_WORKER) == 1
    state, actions = walk([E.BACKOFF_OVER, E.DEMAND, E.DEMAND], state=state)
    assert state == S.STARTING and actions == [A.START_WORKER]


def test_an_earlier_fronts_backoff_is_resumed_only_by_a_fresh_front() -> None:
    assert step(S.IDLE, E.BACKOFF_RESUMED) == (S.BACKOFF, (A.RESUME_BACKOFF,))
    for state in set(State) - {S.IDLE}:
        assert step(state, E.BACKOFF_RESUMED) == (state, ())


@pytest.mark.parametrize("mode", list(Mode))
def test_every_state_is_reachable_and_every_action_used(mode: Mode) -> None:
    seen, todo = {S.IDLE}, [S.IDLE]
    while todo:
        here = todo.pop()
        for event in Event:
            to, _ = step(here, event, mode)
            if to not in seen:
                seen.add(to)
                todo.append(to)
    expect = set(State) if mode == Mode.ACTIVATED else set(State) - {S.LEAVING}
    assert seen == expect
    used = {a for _, acts in TABLES[Mode.ACTIVATED].values() for a in acts}
    assert used == set(Action)


def test_status_shows_the_documented_names() -> None:
    shown = {s.shown for s in State}
    assert shown == {"idle", "starting", "ready", "stopping", "backoff"}
    assert S.LEAVING.shown == "stopping"


def test_backoff_grows_and_resets() -> None:
    b = Backoff(first_s=1, cap_s=5)
    assert [b.next_delay() for _ in range(5)] == [1, 2, 4, 5, 5]
    assert b.last_s == 5 and 4 < b.left() <= 5
    b.reset()
    assert b.next_delay() == 1
    assert b.failures == 1
