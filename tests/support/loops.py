"""The event loops a data-path test runs on: asyncio's, and uvloop's where installed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from agent.net import loop as net_loop


def loops() -> Iterator[Any]:
    """pytest params of a `run(coroutine)` for each loop."""
    yield pytest.param(asyncio.run, id="asyncio")
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return
    yield pytest.param(net_loop.run, id="uvloop")
