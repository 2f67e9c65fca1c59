"""Logging: every module's lines reach the one configured handler."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from agent import log

MODULES = (
    "agent.gpu.admission",
    "agent.gpu.vram",
    "agent.net.proxy",
    "agent.gpu.footprint",
    "agent.front.gpu_hooks",
)


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    own = {n: (logging.getLogger(n).level, logging.getLogger(n).propagate) for n in log.OWN_LOGGERS}
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    for name, (level, propagate) in own.items():
        logging.getLogger(name).setLevel(level)
        logging.getLogger(name).propagate = propagate


def test_module_loggers_reach_the_handler_at_info(capsys: pytest.CaptureFixture[str]) -> None:
    log.setup(journal=False)
    for name in (*MODULES, "providerd", "providerd.esm"):
        logging.getLogger(name).info("info from %s", name)
        logging.getLogger(name).debug("debug from %s", name)
    err = capsys.readouterr().err
    for name in (*MODULES, "providerd", "providerd.esm"):
        assert f"{name}: info from {name}" in err
    assert "debug from" not in err


def test_warnings_go_through_the_handler_not_last_resort(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log.setup(journal=False)
    logging.getLogger("agent.gpu.vram").warning("Failed to sample VRAM")
    lines = capsys.readouterr().err.splitlines()
    # logging.lastResort would print the bare message, without the logger's name.
    assert len(lines) == 1 and lines[0].endswith(" agent.gpu.vram: Failed to sample VRAM")


def test_verbose_and_a_second_setup_keep_one_handler(capsys: pytest.CaptureFixture[str]) -> None:
    log.setup(journal=False)
    log.setup(journal=False, verbose=True)
    logging.getLogger("agent.net.proxy").debug("relay detail")
    logging.getLogger("some.library").info("library chatter")
    logging.getLogger("some.library").warning("library warning")
    err = capsys.readouterr().err.splitlines()
    assert [line.split(" ", 1)[1] for line in err] == [
        "agent.net.proxy: relay detail",
        "some.library: library warning",
    ]
