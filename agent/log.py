"""Logging: the journal under systemd, stderr in the foreground."""

from __future__ import annotations

import logging
import sys


def setup(*, journal: bool, verbose: bool = False) -> None:
    root = logging.getLogger("providerd")
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False
    for old in list(root.handlers):
        root.removeHandler(old)
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    if journal:
        try:
            from systemd.journal import JournalHandler

            handler = JournalHandler(SYSLOG_IDENTIFIER="providerd")
        except ImportError:
            handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
        )
    root.addHandler(handler)
