"""Counters that survive the front: persisted, reloaded, never going back."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from agent.front.front import Front
from agent.front.state import State
from agent.net import counters
from agent.net.counters import BUCKETS, Counters
from agent.net.proxy import Unavailable
from tests.unit.test_front import InProcessWorker, get, listener, provider, shutdown

LOG = logging.getLogger("test")


def test_round_trip_and_histogram() -> None:
    c = Counters()
    c.count_served()
    c.count_refused("gpu_unavailable")
    c.count_start(0.3)
    c.count_start(70.0)
    c.count_start_failure()
    c.count_idle_release()
    c.count_retirement()
    d = c.to_json()
    assert d["refused"] == {
        "gpu_unavailable": 1,
        "start_failed": 0,
        "too_many_waiting": 0,
        "unauthorized": 0,
        "forbidden": 0,
    }
    buckets = dict((b, n) for b, n in d["start_seconds"]["buckets"])
    assert buckets[0.25] == 0 and buckets[0.5] == 1 and buckets[60.0] == 1 and buckets[120.0] == 2
    assert d["start_seconds"]["count"] == 2 and d["start_seconds"]["sum"] == pytest.approx(70.3)
    assert Counters.from_json(json.loads(json.dumps(d))).to_json() == d
    assert len(d["start_seconds"]["buckets"]) == len(BUCKETS)


@pytest.mark.parametrize(
    "text",
    ["", "[]", "{", '{"served": -3}', '{"served": true, "refused": [1]}', '{"start_seconds": 7}'],
)
def test_a_damaged_file_counts_as_zero_and_never_raises(text: str, tmp_path: Path) -> None:
    f = counters.counters_file("x")
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)
    loaded = counters.load("x")
    assert loaded.served == 0 and loaded.cold_starts == 0


def test_save_writes_only_what_changed(tmp_path: Path) -> None:
    c = Counters()
    counters.save("y", c, LOG)
    assert not counters.counters_file("y").exists()
    c.count_served()
    counters.save("y", c, LOG)
    assert counters.read("y")["served"] == 1  # type: ignore[index]
    assert not c.dirty


def test_counters_continue_across_fronts() -> None:
    """Each idle exit ends a front; the next one starts where it left off."""

    async def one_front(requests: int) -> dict[str, object]:
        sock = listener()
        worker = InProcessWorker()
        front = Front(provider(idle_timeout_s=0.2), worker, [sock], exit_on_idle=True)
        front.start_accepting()
        for _ in range(requests):
            await get(sock.getsockname()[1])
        await asyncio.wait_for(front.done.wait(), 10)  # idle exit: it persists
        status = await front.status()
        await shutdown(front, worker)
        sock.close()
        return dict(status["counters"])

    first = asyncio.run(one_front(3))
    assert first["served"] == 3 and first["cold_starts"] == 1 and first["idle_releases"] == 1
    assert counters.read("t") == first
    second = asyncio.run(one_front(2))
    assert second["served"] == 5 and second["cold_starts"] == 2 and second["idle_releases"] == 2


def test_refusals_are_counted_by_cause() -> None:
    async def go() -> dict[str, int]:
        sock = listener()
        worker = InProcessWorker(fail="the model fell over")
        front = Front(provider(max_held=1), worker, [sock], exit_on_idle=False)
        with pytest.raises(Unavailable):
            await front.ready()  # the start fails: this request is refused
        assert front.state == State.BACKOFF
        with pytest.raises(Unavailable):
            await front.ready()  # refused during the backoff
        front.waiters.append(asyncio.get_running_loop().create_future())  # one held already
        with pytest.raises(Unavailable):
            await front.ready()  # over max_held
        front.waiters.clear()
        with pytest.raises(Unavailable):
            await front.ready("warm")  # `providerctl warm` is not a refused request
        await shutdown(front, worker)
        sock.close()
        return dict(front.counters.to_json()["refused"])

    refused = asyncio.run(go())
    assert refused == {
        "start_failed": 2,
        "too_many_waiting": 1,
        "gpu_unavailable": 0,
        "unauthorized": 0,
        "forbidden": 0,
    }
