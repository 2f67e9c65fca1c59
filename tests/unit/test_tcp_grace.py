"""A raw-TCP front's new connection counts as fresh (its first-request grace) until its
lease or FIRST_REQUEST_GRACE_S, on the loop's deadline queue (agent.net.deadlines), as an
HTTP listener's connections do: no loop timer of its own per connection."""

from __future__ import annotations

import asyncio

import pytest

from agent.front import front as front_module
from agent.front.front import Front, _TcpConnection
from agent.net import deadlines
from tests.unit.test_front import InProcessWorker, listener, provider


def test_a_tcp_connections_grace_is_a_deadline_on_the_loops_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(front_module, "FIRST_REQUEST_GRACE_S", 0.2)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        sock = listener()
        front = Front(provider(protocol="tcp"), InProcessWorker(), [sock], exit_on_idle=True)
        queue = deadlines.of(loop)
        timers = len(loop._scheduled)  # type: ignore[attr-defined]
        conns = [_TcpConnection(front) for _ in range(100)]
        assert front.fresh == 100 and len(queue) == 100
        # One timer for the queue at most: none per connection.
        assert len(loop._scheduled) <= timers + 1  # type: ignore[attr-defined]
        conns[0].lease(None).release()  # its lease ends its grace, once
        conns[1].end_grace()
        conns[1].end_grace()
        assert front.fresh == 98 and len(queue) == 98
        began = loop.time()
        async with asyncio.timeout(3):
            while front.fresh:
                await asyncio.sleep(0.01)
        assert loop.time() - began >= 0.15  # the rest ran out at the grace, not before
        assert len(queue) == 0
        for conn in conns:
            conn.end_grace()  # after the grace: nothing counted twice
        assert front.fresh == 0
        sock.close()

    # asyncio's own loop: its scheduled timers can be counted.
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        runner.run(go())
