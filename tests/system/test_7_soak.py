"""A short soak: 100 activation → request → release cycles leave nothing behind.

`make soak` runs the long one (1,000 cycles) with the same code (tests/system/soak.py).
"""

from __future__ import annotations

from . import soak
from .conftest import FIGURES
from .nspawn import Container

CYCLES = 100
# File descriptors PID 1 and journald may legitimately open meanwhile (a varlink or
# bus connection of their own); a leak per cycle would be 100 or more.
FD_SLACK = 3
# PID 1's memory grows a little with its unit and journal caches; a leak per cycle of
# even a unit's worth of state would exceed this.
RSS_SLACK_KB = 8 * 1024


def test_a_hundred_cycles_fail_nothing_and_leak_nothing(ct: Container) -> None:
    try:
        result = soak.run(ct, CYCLES)
    finally:
        soak.remove(ct)
    FIGURES.extend(f"soak: {line}" for line in result.lines())
    report = "\n".join(result.lines())
    assert result.cycles == CYCLES
    assert not result.failed, report
    assert not result.leftover_processes, report
    assert not result.leftover_units, report
    for key in ("pid1_fds", "journald_fds"):
        assert result.after[key] <= result.before[key] + FD_SLACK, report
    assert result.after["pid1_rss_kb"] <= result.before["pid1_rss_kb"] + RSS_SLACK_KB, report
