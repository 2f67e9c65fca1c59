"""The state table, pair by pair: every (state, event) has an expected outcome here."""

from __future__ import annotations

import pytest

from agent.front.state import TABLE, Action, Backoff, Event, State, step

S, E, A = State, Event, Action

EXPECTED = {
    (S.IDLE, E.DEMAND): (S.STARTING, (A.START_WORKER,)),
    (S.STARTING, E.STARTED): (S.READY, (A.RESET_BACKOFF, A.WAKE_WAITERS, A.ARM_IDLE)),
    (S.STARTING, E.START_FAILED): (S.BACKOFF, (A.ARM_BACKOFF, A.FAIL_WAITERS)),
    (S.STARTING, E.WORKER_EXITED): (S.BACKOFF, (A.ARM_BACKOFF, A.FAIL_WAITERS)),
    (S.STARTING, E.RELEASE): (S.STOPPING, (A.STOP_WORKER,)),
    (S.READY, E.WORKER_EXITED): (S.BACKOFF, (A.ARM_BACKOFF, A.FAIL_WAITERS)),
    (S.READY, E.RELEASE): (S.STOPPING, (A.STOP_WORKER,)),
    (S.STOPPING, E.STOPPED): (S.IDLE, ()),
    (S.BACKOFF, E.DEMAND): (S.BACKOFF, (A.FAIL_WAITERS,)),
    (S.BACKOFF, E.BACKOFF_OVER): (S.IDLE, ()),
}


def test_table_is_complete() -> None:
    assert set(TABLE) == {(s, e) for s in State for e in Event}


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("event", list(Event))
def test_pair(state: State, event: Event) -> None:
    # Pairs not listed in EXPECTED must change nothing: a stray event is harmless.
    assert step(state, event) == EXPECTED.get((state, event), (state, ()))


def test_one_start_serves_every_demand() -> None:
    state, actions = step(S.IDLE, E.DEMAND)
    starts = actions.count(A.START_WORKER)
    for _ in range(50):
        state, actions = step(state, E.DEMAND)
        starts += actions.count(A.START_WORKER)
    assert (state, starts) == (S.STARTING, 1)


def test_backoff_grows_and_resets() -> None:
    b = Backoff(first_s=1, cap_s=5)
    assert [b.next_delay() for _ in range(5)] == [1, 2, 4, 5, 5]
    b.reset()
    assert b.next_delay() == 1
