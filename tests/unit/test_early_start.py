"""The worker's start asked for before the front's own start (agent.front.early): what it
decides, writes and sends to a bus made of dbus-next's marshalling, when it leaves the start
to the front, and how the front's bus then follows that job (agent.systemd.bus.follow)."""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from dbus_next.message import Message
from dbus_next.signature import Variant as DVariant

from agent.front import early
from agent.gpu.footprint import Footprints
from agent.gpu.nvml import GIB, FakeCard, FakeNvml
from agent.gpu.placement import Placement, device_allow
from agent.gpu.quick import admit_now
from agent.gpu.reservations import Reservation, read_reservations
from agent.spec.provider import Provider
from agent.systemd.bus import DbusSystemd
from tests.fakes.fake_bus import FakeBus

JOB = "/org/freedesktop/systemd1/job/99"
UNIT = "provider-worker@g.service"
GPU = '[listen]\naddress = "127.0.0.1:18241"\n[runtime]\ncommand = ["/bin/true"]\n'
GPU += '[gpu]\ndevices = "auto"\nvram_budget_gb = 4\n'
HOST = '[listen]\naddress = "127.0.0.1:18242"\n[runtime]\ncommand = ["/bin/true"]\n'
HOST += '[isolation]\nnetwork = "host"\n'
PRIVATE = '[listen]\naddress = "127.0.0.1:18243"\n[runtime]\ncommand = ["/bin/true"]\n'


@pytest.fixture(autouse=True)
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    manifests = tmp_path / "providers"
    manifests.mkdir(mode=0o755)
    manifests.chmod(0o755)
    for var, value in {
        "PROVIDERD_MANIFEST_DIRS": manifests,
        "PROVIDERD_RUNTIME_DIR": tmp_path / "run",
        "PROVIDERD_STATE_DIR": tmp_path / "state",
        "PROVIDERD_CONFIG": tmp_path / "providerd.toml",
        "PROVIDERD_KEYS": tmp_path / "keys.toml",
        "PROVIDERD_TRUSTED_UID": os.getuid(),
        "PROVIDERD_NVML_FAKE": tmp_path / "gpus",
        "DBUS_SYSTEM_BUS_ADDRESS": f"unix:path={tmp_path / 'bus'}",
    }.items():
        monkeypatch.setenv(var, str(value))
    monkeypatch.delenv("PROVIDERD_MANIFEST", raising=False)
    (tmp_path / "gpus").mkdir()
    cards = [{"uuid": "GPU-a", "total": 16 * GIB}, {"uuid": "GPU-b", "total": 16 * GIB}]
    (tmp_path / "gpus" / "cards.json").write_text(json.dumps(cards))
    return tmp_path


def add(host: Path, slug: str, text: str) -> None:
    f = host / "providers" / f"{slug}.toml"
    f.write_text(text)
    f.chmod(0o644)


def said(got: early.Early) -> list[str]:
    return [r.getMessage() for r in got.records]


def systemd(
    device_allow: list[list[str]] | None = None, start_error: str = "", start_lost: bool = False
) -> Any:
    """PID 1 as the early start meets it; `device_allow`: the unit's rules now."""

    def answer(m: Message) -> list[Message]:
        if m.member == "Hello":
            return [Message.new_method_return(m, "s", [":1.7"])]
        if m.member == "Get":
            return [Message.new_method_return(m, "v", [DVariant("a(ss)", device_allow or [])])]
        if m.member == "SetUnitProperties":
            return [Message.new_method_return(m)]
        if m.member == "StartUnit" and start_lost:
            return None  # taken, perhaps, but the answer never comes
        if m.member == "StartUnit" and start_error:
            return [Message.new_error(m, "org.freedesktop.DBus.Error.AccessDenied", start_error)]
        if m.member == "StartUnit":
            return [Message.new_method_return(m, "o", [JOB])]
        return [Message.new_error(m, "org.freedesktop.DBus.Error.UnknownMethod", m.member)]

    return answer


def test_a_gpu_start_is_decided_written_and_asked_for(host: Path) -> None:
    add(host, "g", GPU)
    bus = FakeBus(host / "bus", systemd())
    got = early.begin(["g"])
    bus.thread.join(5)
    assert got.start is not None, said(got)
    start = got.start
    assert start.job == JOB and start.admitted is not None and start.set_devices
    assert "DeviceAllow= set" in start.describe()
    # The card with the most free memory (both equal: the first), its device rules, set
    # (the unit had none) before StartUnit, all on one connection.
    assert [m.member for m in bus.calls] == ["Hello", "Get", "SetUnitProperties", "StartUnit"]
    unit, runtime, props = bus.calls[2].body
    assert (unit, runtime) == ("provider-worker@g.service", True)
    assert props[0][1].value == []
    assert ["/dev/nvidia0", "rw"] in props[1][1].value
    # Job mode "fail": a start that would undo a stop job is refused, never replaces it.
    assert bus.calls[3].body == ["provider-worker@g.service", "fail"]
    env = (host / "run" / "g" / "worker.env").read_text()
    assert 'CUDA_VISIBLE_DEVICES="GPU-a"' in env
    assert f'PROVIDERD_WORKER_PORT="{start.port}"' in env
    # The reservation is written under the lock, as admission's own.
    (r,) = read_reservations(host / "run")
    assert (r.slug, r.cards, r.owner_pid) == ("g", ("GPU-a",), os.getpid())


def test_device_rules_already_right_are_not_set_again(host: Path) -> None:
    add(host, "g", GPU)
    card = FakeCard(0, "GPU-a", 16 * GIB)
    nvml = FakeNvml([card])
    # As PID 1 gives them back: newest first, the reverse of the order they were set in.
    wanted = [list(r) for r in reversed(device_allow(Placement(tuple(nvml.cards()))))]
    bus = FakeBus(host / "bus", systemd(device_allow=wanted))
    got = early.begin(["g"])
    bus.thread.join(5)
    assert got.start is not None, said(got)
    assert [m.member for m in bus.calls] == ["Hello", "Get", "StartUnit"]
    assert not got.start.set_devices


def test_a_refused_start_undoes_the_reservation_and_leaves_the_start_to_the_front(
    host: Path,
) -> None:
    add(host, "g", GPU)
    bus = FakeBus(host / "bus", systemd(start_error="not allowed"))
    got = early.begin(["g"])
    bus.thread.join(5)
    assert got.start is None and got.provider is not None
    assert read_reservations(host / "run") == []
    assert any("not allowed" in line for line in said(got)), said(got)
    assert got.nvml is not None  # the front's admission goes on with it


def test_a_start_asked_for_with_no_answer_keeps_its_decision_for_the_front(host: Path) -> None:
    """PID 1 may have taken a StartUnit whose answer never came: the front's own start must
    ask again with the same port and card (its StartUnit joins that job), not pick anew."""
    add(host, "g", GPU)
    bus = FakeBus(host / "bus", systemd(start_lost=True))
    got = early.begin(["g"])
    bus.thread.join(5)
    assert got.start is not None and got.start.job == "", said(got)
    assert got.start.admitted is not None
    (r,) = read_reservations(host / "run")  # kept, for the front's own start
    assert r.slug == "g"
    env = (host / "run" / "g" / "worker.env").read_text()
    assert f'PROVIDERD_WORKER_PORT="{got.start.port}"' in env


def test_a_host_network_provider_gets_a_port_of_its_own_and_its_loopback(host: Path) -> None:
    add(host, "h", HOST)
    bus = FakeBus(host / "bus", systemd())
    got = early.begin(["h"])
    bus.thread.join(5)
    assert got.start is not None and got.start.devices is None
    assert [m.member for m in bus.calls] == ["Hello", "StartUnit"]
    env = got.start.env
    assert env["PROVIDERD_WORKER_PORT"] == str(got.start.port) and got.start.port > 0
    assert (
        env["PROVIDERD_WORKER_HOST"].startswith("127.")
        and env["PROVIDERD_WORKER_HOST"] != "127.0.0.1"
    )


@pytest.mark.parametrize("why", ["beside", "keys", "backoff", "lock", "full", "manifest", "argv"])
def test_what_it_leaves_to_the_front(host: Path, why: str) -> None:
    slug = "g"
    add(host, slug, PRIVATE if why == "beside" else GPU)
    if why == "keys":
        (host / "keys.toml").write_text("")
    if why == "backoff":
        (host / "run").mkdir()
        (host / "run" / f"{slug}.backoff").write_text("{}")
    if why == "manifest":
        add(host, slug, "nonsense = 1\n")
    lock = None
    if why == "lock":  # another front is admitting (a flock conflicts across open files)
        (host / "run").mkdir()
        lock = os.open(host / "run" / "gpu.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
    if why == "full":  # another front's worker holds the room: a retirement is admission's
        (host / "run" / "other").mkdir(parents=True)
        other = Reservation("other", ("GPU-a", "GPU-b"), 15 * GIB, (), os.getpid(), 0.0)
        (host / "run" / "other" / "gpu.json").write_text(other.to_json())
    got = early.begin([slug] if why != "argv" else [])
    if lock is not None:
        os.close(lock)
    assert got.start is None
    assert not (host / "run" / slug / "worker.env").exists()
    assert [r.slug for r in read_reservations(host / "run")] == (["other"] if why == "full" else [])
    assert (got.provider is None) == (why in ("manifest", "argv"))


def gpu(slug: str, budget_gib: float) -> Provider:
    return Provider(slug, Path(f"/m/{slug}.toml"), gpu_devices="auto", vram_budget_gb=budget_gib)


def test_admission_at_once_takes_the_lock_only_when_free(tmp_path: Path) -> None:
    provider = gpu("p", 2.0)
    nvml = FakeNvml([FakeCard(0, "GPU-a", 8 * GIB), FakeCard(1, "GPU-b", 8 * GIB)])
    fp = Footprints(tmp_path / "fp")
    rt = tmp_path / "run"
    rt.mkdir()
    fd = os.open(rt / "gpu.lock", os.O_RDWR | os.O_CREAT, 0o600)
    other = os.open(rt / "gpu.lock", os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_EX)
    try:
        assert admit_now(provider, nvml, fp, runtime_dir=rt) is None
    finally:
        fcntl.flock(other, fcntl.LOCK_UN)
        os.close(other)
        os.close(fd)
    a = admit_now(provider, nvml, fp, runtime_dir=rt)
    assert a is not None and a.placement.uuids == ("GPU-a",)
    # The next one sees that reservation and goes to the other card.
    b = admit_now(gpu("q", 2.0), nvml, fp, runtime_dir=rt)
    assert b is not None and b.placement.uuids == ("GPU-b",)
    # Too big for what is left on either without retiring someone: not decided here.
    big = gpu("r", 5.5)
    assert admit_now(big, nvml, fp, runtime_dir=rt) is None
    assert sorted(r.slug for r in read_reservations(rt)) == ["p", "q"]


# ------------------------------------------------------------------ following the job


class Following(DbusSystemd):
    """DbusSystemd with its property reads answered here (the bus is the fake)."""

    def __init__(self, job_now: Any, during: str | None = None) -> None:
        super().__init__()
        self.job_now = job_now
        self.during = during  # a JobRemoved result that arrives while Job is read
        self.reads = 0
        self.started: list[str] = []

        class Manager:
            async def call_start_unit(inner, name: str, mode: str) -> str:
                self.started.append(name)
                return "/org/freedesktop/systemd1/job/100"

        self._manager = Manager()

    async def get(self, name: str, interface: str, prop: str) -> Any:
        assert (name, interface, prop) == (UNIT, "Unit", "Job")
        self.reads += 1
        await asyncio.sleep(0)
        if self.during is not None:
            self._on_job_removed(99, JOB, UNIT, self.during)
        return self.job_now


def test_a_job_still_running_is_followed_to_its_jobremoved() -> None:
    async def go() -> str:
        bus = Following([99, JOB])
        task = asyncio.ensure_future(bus.follow(UNIT, JOB))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done()
        bus._on_job_removed(99, JOB, UNIT, "failed")
        result = await task
        assert bus.started == []  # followed, not asked for again
        return result

    assert asyncio.run(go()) == "failed"


def test_a_jobremoved_that_came_after_subscribe_but_before_following_is_kept() -> None:
    async def go() -> tuple[str, int]:
        bus = Following([0, "/"])
        bus._on_job_removed(99, JOB, UNIT, "timeout")
        return await bus.follow(UNIT, JOB), bus.reads

    assert asyncio.run(go()) == ("timeout", 0)


def test_a_jobremoved_during_the_read_is_the_result() -> None:
    async def go() -> str:
        bus = Following([0, "/"], during="failed")
        return await bus.follow(UNIT, JOB)

    assert asyncio.run(go()) == "failed"


def test_a_job_over_before_subscribe_leaves_the_outcome_to_the_units_state() -> None:
    async def go() -> tuple[str, str]:
        bus = Following([0, "/"])
        first = await bus.follow(UNIT, JOB)
        # Followed once: the next start is asked for as usual.
        second_job = "/org/freedesktop/systemd1/job/100"
        bus._on_job_removed(100, second_job, UNIT, "done")
        second = await bus.start_unit(UNIT)
        assert bus.started == [UNIT]
        return first, second

    assert asyncio.run(go()) == ("done", "done")


def test_what_it_logs_waits_for_the_fronts_logging_with_its_logger(
    host: Path, caplog: pytest.LogCaptureFixture
) -> None:
    add(host, "g", GPU)
    (host / "state" / "footprints").mkdir(parents=True)
    (host / "state" / "footprints" / "g.json").write_text("{ not json")
    bus = FakeBus(host / "bus", systemd())
    handlers = list(logging.getLogger().handlers)
    got = early.begin(["g"])
    bus.thread.join(5)
    assert logging.getLogger().handlers == handlers  # nothing of its own left behind
    by = {(r.name, r.levelno) for r in got.records}
    assert ("agent.gpu.footprint", logging.WARNING) in by
    assert ("providerd.g", logging.INFO) in by
    caplog.clear()
    with caplog.at_level(logging.INFO):
        got.replay()
    assert got.records == []
    assert any(
        r.name == "agent.gpu.footprint" and "VRAM footprint" in r.getMessage()
        for r in caplog.records
    )
    assert any("Asked for the worker's start first" in r.getMessage() for r in caplog.records)
