"""Rate-limited log lines for what the data path answers by itself (400, 413, 503, 504 …).

A client error can come thousands of times a second; the journal gets the first lines of
each kind in every interval and then one line saying how many were left out, so
`journalctl -u provider@SLUG` explains what clients saw without drowning in it.
"""

from __future__ import annotations

import logging
import time

INTERVAL_S = 10.0
BURST = 5  # lines of one kind per interval before they are counted instead


class RateLog:
    """`log(kind, message)` writes at most BURST lines per kind per INTERVAL_S; the rest are
    counted and reported in one line when the next interval begins."""

    def __init__(
        self, log: logging.Logger, interval_s: float = INTERVAL_S, burst: int = BURST
    ) -> None:
        self.logger = log
        self.interval_s = interval_s
        self.burst = burst
        self._window: dict[str, tuple[float, int]] = {}  # kind → (window start, lines in it)

    def log(self, kind: str, message: str, *args: object, level: int = logging.WARNING) -> None:
        now = time.monotonic()
        began, count = self._window.get(kind, (0.0, 0))
        if now - began >= self.interval_s:
            if count > self.burst:
                self.logger.log(
                    level,
                    "%d more such answer(s) (%s) in the last %g s not logged",
                    count - self.burst,
                    kind,
                    self.interval_s,
                )
            began, count = now, 0
        count += 1
        if len(self._window) > 1024:  # kinds are few; never let them grow unbounded
            self._window.clear()
        self._window[kind] = (began, count)
        if count <= self.burst:
            self.logger.log(level, message, *args)
