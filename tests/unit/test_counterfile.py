"""The live counters file: increments that are in the page cache at once, so a writer
killed outright loses none; and what a reader makes of any file."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.net import counterfile, counters
from agent.net.counterfile import CounterFile, parse

ROOT = Path(__file__).resolve().parents[2]


def test_values_round_trip_and_names_are_appended(tmp_path: Path) -> None:
    path = tmp_path / "x.counters"
    f = CounterFile(path, {"served": 5, "refused.start_failed": 1})
    f.add("served")
    f.add("cold_starts", 3)
    f.set_max("served", 2)  # never lowers
    assert counterfile.read(path) == {"served": 6, "refused.start_failed": 1, "cold_starts": 3}
    for i in range(600):  # more names than one page holds: the file grows
        f.add(f"name.{i:04d}", i)
    seen = counterfile.read(path)
    assert seen is not None and seen["name.0599"] == 599 and len(seen) == 603
    assert path.stat().st_size > counterfile.PAGE


def test_a_slot_takes_direct_adds_and_stays_as_the_file_grows(tmp_path: Path) -> None:
    path = tmp_path / "x.counters"
    f = CounterFile(path, {"old": 2})
    old, new = f.slot("old"), f.slot("new")
    assert counterfile.read(path) == {"old": 2, "new": 0}
    f.words[old] += 1
    f.words[new] += 5
    assert f.slot("new") == new
    for i in range(600):  # the file grows: `words` is a new view, the slots hold
        f.add(f"name.{i:04d}", i)
    f.words[new] += 1
    seen = counterfile.read(path)
    assert seen is not None and (seen["old"], seen["new"], seen["name.0599"]) == (3, 6, 599)


def test_a_router_count_is_in_the_live_file_at_once_and_its_slot_survives_growth(
    tmp_path: Path,
) -> None:
    log = logging.getLogger("test")
    r = counters.load_router(log)
    r.count("m", "m-1", 200)
    assert counters.load_router().requests == {("m", "m-1", 200): 1}  # before any save
    assert r.dirty
    for i in range(300):  # new names grow the live file past its first page
        r.count("m", f"m-{i:04d}", 404)
    assert r.live is not None and r.live.path.stat().st_size > counterfile.PAGE
    r.count("m", "m-1", 200)
    r.count("m", "m-0299", 404)
    seen = counters.load_router().requests
    assert (seen[("m", "m-1", 200)], seen[("m", "m-0299", 404)], len(seen)) == (2, 2, 301)
    assert seen == r.requests
    blocked = counters.RouterCounters()  # no live file: in memory alone
    blocked.count("m", "", 404)
    assert blocked.requests == {("m", "", 404): 1} and blocked.dirty


def test_a_fresh_file_replaces_the_old_one_atomically(tmp_path: Path) -> None:
    path = tmp_path / "x.counters"
    CounterFile(path, {"a": 1}).add("a")
    CounterFile(path, {"a": 9})
    assert counterfile.read(path) == {"a": 9}
    assert [p.name for p in tmp_path.iterdir()] == ["x.counters"]  # no temporary left


@given(st.binary(max_size=300))
def test_any_bytes_read_as_counters_or_none(data: bytes) -> None:
    out = parse(data)
    assert out is None or all(isinstance(v, int) and v >= 0 for v in out.values())


def test_a_truncated_file_is_none(tmp_path: Path) -> None:
    path = tmp_path / "x.counters"
    CounterFile(path, {"served": 5})
    data = path.read_bytes()
    assert parse(data[: counterfile.HEADER + 4]) is None
    assert parse(b"XXXXXXXX" + data[8:]) is None


WRITER = """
import sys
from pathlib import Path
from agent.net.counterfile import CounterFile
f = CounterFile(Path(sys.argv[1]), {})
n = 0
while True:
    f.add("served")
    n += 1
    if n == 20000:
        print("counted", flush=True)
"""


def test_a_writer_killed_with_sigkill_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "x.counters"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "counted\n"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    proc.stdout.close()
    seen = counterfile.read(path)
    assert seen is not None and seen["served"] >= 20000


def test_a_front_starts_from_the_larger_of_live_and_saved(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test")
    first = counters.load("p", log)  # zeros, and a live file
    for _ in range(3):
        first.count_served()
    first.count_start(0.4)
    counters.save("p", first, log)  # saved: 3
    first.count_served()  # only live: 4 (as if then killed)
    assert counters.read("p")["served"] == 4  # type: ignore[index]
    second = counters.load("p", log)
    assert second.served == 4 and second.cold_starts == 1
    assert second.start_seconds_sum == pytest.approx(0.4)
    counters.live_file("p").unlink()  # a reboot empties /run: the saved JSON carries on
    assert counters.load("p").served == 3


def test_without_a_writable_runtime_directory_counting_goes_on_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("PROVIDERD_RUNTIME_DIR", str(blocked / "below"))
    c = counters.load("p", logging.getLogger("test"))
    c.count_served()
    assert c.served == 1 and c.live is None
    assert "Failed to create" in caplog.text and "counters survive only a clean exit" in caplog.text


def test_the_router_counters_survive_too() -> None:
    log = logging.getLogger("test")
    r = counters.load_router(log)
    r.count("m", "m-1", 200)
    r.count("m", "", 404)
    again = counters.load_router()  # nothing saved: the live file answers
    assert again.requests == {("m", "m-1", 200): 1, ("m", "", 404): 1}


def test_a_router_starts_from_the_larger_of_live_and_saved_per_label() -> None:
    log = logging.getLogger("test")
    first = counters.load_router(log)
    first.count("m", "m-1", 200)
    counters.save_router(first, log)  # saved: one 200
    first.count("m", "m-1", 200)  # live only: two
    counters.router_file().write_text(
        json.dumps(
            [
                {"provider": "m", "model": "m-1", "status": 200, "requests": 1},
                {"provider": "old", "model": "", "status": 503, "requests": 7},  # saved only
            ]
        )
    )
    second = counters.load_router(log)
    assert second.requests == {("m", "m-1", 200): 2, ("old", "", 503): 7}
    second.count("m", "m-1", 200)  # the fresh live file goes on from there
    assert counters.load_router().requests[("m", "m-1", 200)] == 3
