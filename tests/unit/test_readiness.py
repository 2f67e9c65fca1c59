"""The front's probe cadence, and the moment of the model's last answer it keeps."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from agent.spec.provider import Address, Ready
from agent.worker import readiness
from agent.worker.readiness import (
    PROBE_DENSE_ANSWERED_S,
    PROBE_DENSE_S,
    expected_answer,
    probe_interval,
    remember_answer,
    until_answers,
)


def test_without_a_record_the_cadence_grows_with_the_time_since_the_start() -> None:
    assert probe_interval(0.0, answered=False) == readiness.PROBE_FIRST_S
    assert probe_interval(5.0, answered=False) == pytest.approx(0.01)
    assert probe_interval(600.0, answered=False) == readiness.PROBE_MAX_S
    assert probe_interval(0.2, answered=True) == pytest.approx(0.02)
    assert probe_interval(600.0, answered=True) == readiness.PROBE_ANSWERED_MAX_S


def test_around_the_last_answer_the_probes_are_dense_and_only_there() -> None:
    expected = 10.0  # window: 8.95 s to 12.05 s
    for elapsed in (8.96, 10.0, 12.0):
        assert probe_interval(elapsed, False, expected) == PROBE_DENSE_S, elapsed
        assert probe_interval(elapsed, True, expected) == PROBE_DENSE_ANSWERED_S, elapsed
    for elapsed in (1.0, 8.9, 12.1, 60.0):
        assert probe_interval(elapsed, False, expected) == probe_interval(elapsed, False), elapsed
        assert probe_interval(elapsed, True, expected) == probe_interval(elapsed, True), elapsed
    # A request per probe while the model says "not yet": 100 a second at most.
    assert PROBE_DENSE_ANSWERED_S >= 0.01
    # A long load's window is at most 1 s before and 2 s after (plus 50 ms each side).
    assert probe_interval(598.96, False, 600.0) == PROBE_DENSE_S
    assert probe_interval(598.9, False, 600.0) == probe_interval(598.9, False)
    assert probe_interval(602.04, False, 600.0) == PROBE_DENSE_S
    assert probe_interval(602.1, False, 600.0) == probe_interval(602.1, False)


def test_the_record_holds_seconds_or_nothing(tmp_path: Path) -> None:
    record = tmp_path / "demo.answered"
    assert expected_answer(record) is None  # no record yet
    remember_answer(record, 1.234567)
    assert expected_answer(record) == pytest.approx(1.234567)
    for text in ("", "soon\n", "nan\n", "inf\n", "-1\n", "0\n", "1e9\n", "\xff\n"):
        record.write_bytes(text.encode("latin-1"))
        assert expected_answer(record) is None, text
    remember_answer(tmp_path / "missing-dir" / "x.answered", 1.0)  # lost, not raised


def listening_after(delay_s: float) -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s, s.getsockname()[1]


def seen_late_by(expected: float | None, listen_at: float) -> float:
    """How long after the model starts listening (at `listen_at` s) the probe returns."""
    s, port = listening_after(listen_at)

    async def go() -> float:
        loop = asyncio.get_running_loop()
        listened: list[float] = []
        loop.call_later(listen_at, lambda: (s.listen(), listened.append(loop.time())))
        took = await until_answers(Address("127.0.0.1", port), Ready("tcp"), expected)
        assert took >= listen_at
        return loop.time() - listened[0]

    try:
        return asyncio.run(go())
    finally:
        s.close()


def test_the_last_answer_makes_the_next_one_seen_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """With probes 150 ms apart away from the window (a long load's cadence, made short
    here), the model is seen within a few ms of listening when it listens when it did last
    time, and up to 150 ms late otherwise."""
    monkeypatch.setattr(readiness, "PROBE_FIRST_S", 0.15)
    monkeypatch.setattr(readiness, "PROBE_MAX_S", 0.15)
    dense = [seen_late_by(0.32, 0.32) for _ in range(3)]
    assert max(dense) < 0.03, dense
    sparse = [seen_late_by(None, 0.32) for _ in range(3)]
    assert max(sparse) > 0.05, sparse  # the window is what made the difference


def test_until_answers_says_how_long_it_took() -> None:
    s, port = listening_after(0.0)
    s.listen()
    try:
        took = asyncio.run(until_answers(Address("127.0.0.1", port), Ready("tcp"), None))
    finally:
        s.close()
    assert 0 <= took < 0.5
