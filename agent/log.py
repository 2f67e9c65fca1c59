"""Logging: the journal under systemd, stderr in the foreground.

One handler, on the root logger, so that every module's lines reach it: the
`providerd.*` loggers the front and the router name per provider, and the
`agent.*` module loggers (`getLogger(__name__)`) of admission, VRAM sampling, the
proxy and footprints. Under systemd the unit's `LogExtraFields=PROVIDER=%i` adds
the provider's field to each of them. Only providerd's own loggers log at INFO (or
DEBUG); anything else, such as a library, reaches the journal from WARNING up.
"""

from __future__ import annotations

import logging
import sys

OWN_LOGGERS = ("providerd", "agent")


def _installed(handler: logging.Handler) -> bool:
    """Whether `setup` installed this handler (a second call replaces it)."""
    return getattr(handler, "_providerd", False) is True


def setup(*, journal: bool, verbose: bool = False) -> None:
    root = logging.getLogger()
    for old in [h for h in root.handlers if _installed(h)]:
        root.removeHandler(old)
    if root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)
    for name in OWN_LOGGERS:
        own = logging.getLogger(name)
        own.setLevel(logging.DEBUG if verbose else logging.INFO)
        own.propagate = True
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
    handler._providerd = True  # type: ignore[attr-defined]
    root.addHandler(handler)
