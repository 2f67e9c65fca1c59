"""Rate-limited log lines for the answers the data path makes up itself."""

from __future__ import annotations

import logging

import pytest

from agent.net import ratelog
from agent.net.ratelog import RateLog


def test_a_burst_per_kind_then_one_line_counting_the_rest(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr(ratelog.time, "monotonic", lambda: now[0])
    rl = RateLog(logging.getLogger("t"), interval_s=10, burst=2)
    with caplog.at_level(logging.INFO):
        for _ in range(5):
            rl.log("503", "Answered 503")
        rl.log("400", "Answered 400")
        now[0] += 11
        rl.log("503", "Answered 503")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "Answered 503",
        "Answered 503",
        "Answered 400",
        "3 more such answer(s) (503) in the last 10 s not logged",
        "Answered 503",
    ]
