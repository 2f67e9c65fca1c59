"""SystemdWorker against the fake D-Bus boundary: what a start, a failure and a crash look like."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from agent.spec.provider import Ready
from agent.systemd.bus import property_values
from agent.worker.control import StartFailed, SystemdWorker
from tests.fakes.fake_systemd import Behaviour, FakeSystemd

UNIT = "provider-worker@demo.service"
# The loop's clock (libuv's) counts whole milliseconds: a timer may read as fired up to one
# millisecond before its time.
TICK = 0.001


@pytest.fixture(autouse=True)
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PROVIDERD_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def make(fake: FakeSystemd, **behaviour: object) -> SystemdWorker:
    fake.unit(UNIT).behaviour = Behaviour(**behaviour)  # type: ignore[arg-type]
    return SystemdWorker(fake, "demo", start_timeout_s=5)


def test_start_writes_env_then_starts(runtime: Path) -> None:
    fake = FakeSystemd()
    worker = make(fake, condition_path=str(runtime / "demo" / "worker.env"))

    async def go() -> None:
        await worker.start({"PROVIDERD_WORKER_PORT": "4242", "X": 'a "b" $c'}, None)

    asyncio.run(go())
    text = (runtime / "demo" / "worker.env").read_text()
    assert 'PROVIDERD_WORKER_PORT="4242"' in text
    assert 'X="a \\"b\\" \\$c"' in text
    assert fake.unit(UNIT).active == "active"
    assert fake.unit(UNIT).starts == 1


def test_failed_start_names_the_cause() -> None:
    fake = FakeSystemd()
    worker = make(fake, result="exit-code", status=3)
    with pytest.raises(StartFailed, match="status 3"):
        asyncio.run(worker.start({}, None))


def test_timeout_names_the_timeout() -> None:
    fake = FakeSystemd()
    worker = make(fake, result="timeout")
    with pytest.raises(StartFailed, match="within 5 s"):
        asyncio.run(worker.start({}, None))


def test_condition_unmet_is_a_failure() -> None:
    fake = FakeSystemd()
    worker = make(fake, condition_path="/nonexistent/worker.env")
    # The env file is written to the runtime dir, not to the condition path: the job is
    # "done" but the unit stays inactive, which must not count as ready.
    with pytest.raises(StartFailed):
        asyncio.run(worker.start({}, None))


def test_device_rules_replace_the_list() -> None:
    fake = FakeSystemd()
    worker = make(fake)
    fake.unit(UNIT).properties["DeviceAllow"] = [("/dev/nvidia7", "rw")]
    rules = [("/dev/nvidiactl", "rw"), ("/dev/nvidia0", "rw")]
    asyncio.run(worker.start({}, rules))
    assert fake.unit(UNIT).properties["DeviceAllow"] == rules


def test_device_rules_already_in_place_are_not_set_again() -> None:
    """A start on the same card as the last one: no SetUnitProperties (a polkit check)."""
    fake = FakeSystemd()
    worker = make(fake)
    rules = [("/dev/nvidiactl", "rw"), ("/dev/nvidia0", "rw")]

    async def go() -> None:
        await worker.start({}, rules)
        await worker.stop()
        await worker.start({}, rules)
        await worker.stop()
        await worker.start({}, [("/dev/nvidiactl", "rw"), ("/dev/nvidia1", "rw")])

    asyncio.run(go())
    assert [c for c in fake.calls if c[0] == "set-property"] == [("set-property", UNIT)] * 2
    assert fake.unit(UNIT).properties["DeviceAllow"] == [
        ("/dev/nvidiactl", "rw"),
        ("/dev/nvidia1", "rw"),
    ]


def test_device_rules_in_pid1s_own_order_are_the_same_rules() -> None:
    """PID 1 gives DeviceAllow= back newest first: the same rules in another order are
    not set again."""
    fake = FakeSystemd()
    worker = make(fake)
    rules = [("/dev/nvidiactl", "rw"), ("/dev/nvidia0", "rw")]
    fake.unit(UNIT).properties["DeviceAllow"] = rules[::-1]
    asyncio.run(worker.start({}, rules))
    assert not [c for c in fake.calls if c[0] == "set-property"]


RULES = [("/dev/nvidiactl", "rw"), ("/dev/nvidia0", "rw")]
ENV = {"PROVIDERD_WORKER_PORT": "4242"}


def test_an_adopted_start_is_followed_and_nothing_is_done_twice(runtime: Path) -> None:
    """The early start wrote worker.env, set DeviceAllow= and sent StartUnit: the front's
    start follows that job and neither writes, reads nor sets anything again."""
    fake = FakeSystemd()
    worker = make(fake, delay_s=0.02)

    async def go() -> None:
        job = fake.start_elsewhere(UNIT)
        worker.adopt(job, ENV, RULES)
        await worker.start(dict(ENV), list(RULES))

    asyncio.run(go())
    assert not (runtime / "demo" / "worker.env").exists()  # the early start's to write
    assert [c[0] for c in fake.calls] == ["start-elsewhere", "follow"]
    assert fake.unit(UNIT).active == "active" and fake.unit(UNIT).starts == 1


def test_an_adopted_start_that_fails_fails_the_start() -> None:
    fake = FakeSystemd()
    worker = make(fake, result="exit-code", status=3)

    async def go() -> None:
        worker.adopt(fake.start_elsewhere(UNIT), ENV, None)
        await worker.start(dict(ENV), None)

    with pytest.raises(StartFailed, match="status 3"):
        asyncio.run(go())
    assert ("start", UNIT) not in fake.calls


def test_an_adoption_serves_one_start_and_only_the_start_it_was_asked_with(
    runtime: Path,
) -> None:
    fake = FakeSystemd()
    worker = make(fake)

    async def go() -> None:
        worker.adopt(fake.start_elsewhere(UNIT), ENV, RULES)
        await asyncio.sleep(0.01)
        # Decided otherwise since (another card): asked for as any start.
        await worker.start(dict(ENV), [("/dev/nvidiactl", "rw"), ("/dev/nvidia1", "rw")])
        await worker.stop()
        await worker.start(dict(ENV), list(RULES))

    asyncio.run(go())
    assert [c[0] for c in fake.calls if c[0] in ("follow", "start")] == ["start", "start"]
    assert (runtime / "demo" / "worker.env").exists()
    assert fake.unit(UNIT).properties["DeviceAllow"] == RULES


def test_a_start_decided_otherwise_than_the_adopted_one_stops_it_first(runtime: Path) -> None:
    """The early job still runs with its worker.env and card; a StartUnit would join it, and
    the worker would keep the early decision while the front probes and accounts the new
    one. The adopted start is stopped, then the worker is started as decided now."""
    fake = FakeSystemd()
    worker = make(fake, delay_s=0.05)
    other = [("/dev/nvidiactl", "rw"), ("/dev/nvidia1", "rw")]

    async def go() -> None:
        worker.adopt(fake.start_elsewhere(UNIT), ENV, RULES)
        await asyncio.sleep(0.01)  # the early job runs: the unit is activating
        assert fake.unit(UNIT).active == "activating"
        await worker.start({"PROVIDERD_WORKER_PORT": "4343"}, other)

    asyncio.run(go())
    assert [c[0] for c in fake.calls if c[0] != "set-property"] == [
        "start-elsewhere",
        "stop",
        "start",
    ]
    assert fake.unit(UNIT).starts == 2  # the early start, stopped; the start decided now
    assert fake.unit(UNIT).properties["DeviceAllow"] == other
    assert 'PROVIDERD_WORKER_PORT="4343"' in (runtime / "demo" / "worker.env").read_text()


def test_a_dropped_adoption_is_not_followed_by_a_later_start() -> None:
    """The first start attempt failed before it reached the worker (the front calls
    drop_adopted whatever the outcome): a later start with the same decision starts the
    worker, rather than follow a job long over and report the unit inactive."""
    fake = FakeSystemd()
    worker = make(fake)

    async def go() -> None:
        job = fake.start_elsewhere(UNIT)
        await asyncio.sleep(0.01)
        await fake.stop_unit(UNIT)  # the early start's worker, gone since
        worker.adopt(job, ENV, None)
        worker.drop_adopted()
        await worker.start(dict(ENV), None)

    asyncio.run(go())
    assert fake.unit(UNIT).active == "active"
    assert [c[0] for c in fake.calls if c[0] in ("follow", "start")] == ["start"]


def test_a_job_over_before_the_front_follows_it_leaves_the_units_state_to_decide() -> None:
    fake = FakeSystemd()
    worker = make(fake, condition_path="/nonexistent/worker.env")

    async def go() -> None:
        job = fake.start_elsewhere(UNIT)
        await asyncio.sleep(0.01)  # its condition failed: done, and the unit inactive
        worker.adopt(job, ENV, None)
        await worker.start(dict(ENV), None)

    with pytest.raises(StartFailed):
        asyncio.run(go())


class CgroupRace(FakeSystemd):
    """PID 1 failing the worker's first start at its CGROUP step (status 219), then not."""

    async def _run_start(self, name: str, job: int = 0) -> str:
        result = await super()._run_start(name, job)
        self.unit(name).behaviour = Behaviour()
        return result


def test_a_start_failed_at_systemds_cgroup_step_is_asked_for_once_more() -> None:
    fake = CgroupRace()
    worker = make(fake, result="exit-code", status=219)

    async def go() -> None:
        worker.adopt(fake.start_elsewhere(UNIT), ENV, None)
        await worker.start(dict(ENV), None)

    asyncio.run(go())
    assert [c[0] for c in fake.calls if c[0] in ("follow", "start")] == ["follow", "start"]
    assert fake.unit(UNIT).active == "active"


def test_a_start_failing_at_the_cgroup_step_twice_fails_with_the_step_named() -> None:
    fake = FakeSystemd()
    worker = make(fake, result="exit-code", status=219)
    with pytest.raises(StartFailed, match="219/CGROUP"):
        asyncio.run(worker.start({}, None))
    assert [c for c in fake.calls if c[0] == "start"] == [("start", UNIT)] * 2


def test_the_cgroup_retry_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    fake = CgroupRace()
    worker = make(fake, result="exit-code", status=219)
    asyncio.run(worker.start(dict(ENV), None))
    lines = [r.getMessage() for r in caplog.records if "CGROUP" in r.getMessage()]
    assert lines == [
        "Worker's start failed at systemd's CGROUP step (status 219/CGROUP), "
        "asking for it once more"
    ]


def test_a_status_219_left_from_an_earlier_run_is_not_this_starts_cgroup_failure() -> None:
    """The start's job ends "done" with the unit inactive (its condition): Result= and
    ExecMainStatus= still say exit-code/219 from an earlier run, and no second start
    is asked for."""
    fake = FakeSystemd()
    worker = make(fake, condition_path="/nonexistent/worker.env")
    fake.unit(UNIT).result, fake.unit(UNIT).status = "exit-code", 219
    with pytest.raises(StartFailed):
        asyncio.run(worker.start(dict(ENV), None))
    assert [c for c in fake.calls if c[0] == "start"] == [("start", UNIT)]


def test_a_model_that_exits_219_after_its_job_is_done_is_not_started_again() -> None:
    """Type=exec: the job ends "done" once the model's program runs; its exit with 219
    while the front probes it is the model's own status, not systemd's CGROUP step."""
    fake = FakeSystemd()
    worker = probing(fake, Ready("tcp"))
    s = listener()  # bound, never listening: the probe waits

    async def go() -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, fake.crash, UNIT, "exit-code", 219)
        await worker.start({"PROVIDERD_WORKER_PORT": str(s.getsockname()[1])}, None)

    try:
        with pytest.raises(StartFailed, match="219"):
            asyncio.run(go())
    finally:
        s.close()
    assert [c for c in fake.calls if c[0] == "start"] == [("start", UNIT)]


def test_crash_after_ready_is_reported_once_with_reason() -> None:
    fake = FakeSystemd()
    worker = make(fake)
    reasons: list[str] = []
    worker.on_exit(reasons.append)

    async def go() -> None:
        await worker.start({}, None)
        fake.crash(UNIT, result="oom-kill")
        await asyncio.sleep(0.05)

    asyncio.run(go())
    assert len(reasons) == 1
    assert "memory limit" in reasons[0]


def test_requested_stop_is_not_a_crash() -> None:
    fake = FakeSystemd()
    worker = make(fake)
    reasons: list[str] = []
    worker.on_exit(reasons.append)

    async def go() -> None:
        await worker.start({}, None)
        await worker.stop()
        await asyncio.sleep(0.05)

    asyncio.run(go())
    assert reasons == []
    assert fake.unit(UNIT).active == "inactive"


def test_device_rules_marshal_as_dbus_structs() -> None:
    """dbus-next refuses a tuple for a struct ("(ss)"): the adapter must send lists."""
    from dbus_next import Message

    rules = [("/dev/nvidiactl", "rw"), ("/dev/nvidia0", "rw")]
    body = property_values([("DeviceAllow", "a(ss)", []), ("DeviceAllow", "a(ss)", rules)])
    assert body[1][1].value == [["/dev/nvidiactl", "rw"], ["/dev/nvidia0", "rw"]]
    message = Message(
        destination="org.freedesktop.systemd1",
        path="/org/freedesktop/systemd1",
        interface="org.freedesktop.systemd1.Manager",
        member="SetUnitProperties",
        signature="sba(sv)",
        body=[UNIT, True, body],
    )
    assert message._marshall()  # what the bus would receive


class BrokenWatch(FakeSystemd):
    """A bus on which subscribing to the unit's changes fails, after a start went its way."""

    def __init__(self, start_error: Exception | None) -> None:
        super().__init__()
        self.start_error = start_error

    async def watch(self, name: str, callback: object) -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("org.freedesktop.DBus.Error.LimitsExceeded: too many matches")

    async def start_unit(self, name: str) -> str:
        if self.start_error is not None:
            raise self.start_error
        return await super().start_unit(name)


def test_a_failing_watch_does_not_hide_the_starts_own_failure() -> None:
    fake = BrokenWatch(StartFailed("worker did not become ready within 5 s"))
    worker = SystemdWorker(fake, "demo", start_timeout_s=5)
    with pytest.raises(StartFailed, match="within 5 s"):
        asyncio.run(worker.start({}, None))
    assert worker._watching is False  # the next start tries to watch again


def test_a_failing_watch_after_a_good_start_is_still_reported() -> None:
    fake = BrokenWatch(None)
    worker = SystemdWorker(fake, "demo", start_timeout_s=5)
    with pytest.raises(RuntimeError, match="LimitsExceeded"):
        asyncio.run(worker.start({}, None))


# ------------------------------------------------- the front's own probe beside the start job


def listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def probing(fake: FakeSystemd, ready: Ready, **behaviour: object) -> SystemdWorker:
    fake.unit(UNIT).behaviour = Behaviour(**behaviour)  # type: ignore[arg-type]
    return SystemdWorker(fake, "demo", start_timeout_s=5, ready=ready)


def test_the_model_answering_the_front_is_ready_before_the_job_ends() -> None:
    """The model listens long before the job ends (the worker's READY=1 still on its way
    through PID 1 and the bus): the start returns on the front's own probe."""
    fake = FakeSystemd()
    worker = probing(fake, Ready("tcp"), delay_s=3.0)
    s = listener()
    port = s.getsockname()[1]

    async def go() -> float:
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, s.listen)
        t0 = loop.time()
        await worker.start({"PROVIDERD_WORKER_PORT": str(port)}, None)
        return loop.time() - t0

    try:
        took = asyncio.run(go())
    finally:
        s.close()
    assert 0.1 - TICK <= took < 1.0, took
    assert fake.unit(UNIT).starts == 1


def test_a_job_that_fails_after_the_model_answered_is_the_workers_exit() -> None:
    fake = FakeSystemd()
    worker = probing(fake, Ready("tcp"), delay_s=0.3, result="exit-code", status=4)
    reasons: list[str] = []
    worker.on_exit(reasons.append)
    s = listener()
    s.listen()

    async def go() -> None:
        await worker.start({"PROVIDERD_WORKER_PORT": str(s.getsockname()[1])}, None)
        assert reasons == []
        await asyncio.sleep(0.6)

    try:
        asyncio.run(go())
    finally:
        s.close()
    assert len(reasons) == 1 and "status 4" in reasons[0], reasons


def test_a_job_that_fails_first_fails_the_start_while_nothing_answers() -> None:
    fake = FakeSystemd()
    worker = probing(fake, Ready("tcp"), delay_s=0.05, result="exit-code", status=3)
    s = listener()  # bound, never listening: every probe is refused
    try:
        with pytest.raises(StartFailed, match="status 3"):
            asyncio.run(worker.start({"PROVIDERD_WORKER_PORT": str(s.getsockname()[1])}, None))
    finally:
        s.close()


def serving(s: socket.socket, loading_s: float) -> tuple[list[bytes], float]:
    """Answer each connection to `s` with 503 for `loading_s`, then 200; returns the
    requests it read and when (time.monotonic()) its first 200 may come."""
    import threading
    import time

    got: list[bytes] = []
    ready_at = time.monotonic() + loading_s

    def serve() -> None:
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            with c:
                got.append(c.recv(65536))
                c.sendall(LOADING if time.monotonic() < ready_at else OK)

    threading.Thread(target=serve, daemon=True).start()
    return got, ready_at


LOADING = b"HTTP/1.1 503 Loading\r\nContent-Length: 0\r\n\r\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


def test_http_readiness_needs_a_2xx_from_the_front_even_once_the_job_is_done() -> None:
    """The job ends when the model's program runs (Type=exec): 503 while loading is not
    ready, the front waits for its own probe's 2xx."""
    fake = FakeSystemd()
    worker = probing(fake, Ready("http", "/health"), delay_s=0.01)
    s = listener()
    s.listen()
    answered, ready_at = serving(s, loading_s=0.4)

    async def go() -> None:
        await worker.start({"PROVIDERD_WORKER_PORT": str(s.getsockname()[1])}, None)

    try:
        asyncio.run(go())
        done_at = time.monotonic()
    finally:
        s.close()
    assert done_at >= ready_at  # the first 2xx, not the job's end
    assert answered[0].startswith(b"GET /health HTTP/1.1\r\n"), answered


def start_while_nothing_listens(
    fake: FakeSystemd, worker: SystemdWorker, match: str, crash_after_s: float | None = None
) -> float:
    """Start `worker` for a model that never listens (its port bound, never listening);
    the start must fail with `match`. Returns how long it took."""
    s = listener()

    async def go() -> float:
        loop = asyncio.get_running_loop()
        if crash_after_s is not None:
            loop.call_later(crash_after_s, fake.crash, UNIT, "exit-code", 7)
        t0 = loop.time()
        with pytest.raises(StartFailed, match=match):
            await worker.start({"PROVIDERD_WORKER_PORT": str(s.getsockname()[1])}, None)
        return loop.time() - t0

    try:
        return asyncio.run(go())
    finally:
        s.close()


def test_a_model_that_exits_while_loading_fails_the_start_at_once() -> None:
    """The job is done (the program runs), the model never answers and exits: the start
    fails with its status, not at the start timeout."""
    fake = FakeSystemd()
    worker = probing(fake, Ready("tcp"), delay_s=0.02)
    took = start_while_nothing_listens(fake, worker, "status 7", crash_after_s=0.3)
    assert 0.3 - TICK <= took < 2.0, took
    assert ("stop", UNIT) in fake.calls


def test_a_model_that_never_answers_fails_at_the_start_timeout() -> None:
    fake = FakeSystemd()
    fake.unit(UNIT).behaviour = Behaviour(delay_s=0.02)
    worker = SystemdWorker(fake, "demo", start_timeout_s=0.5, ready=Ready("tcp"))
    took = start_while_nothing_listens(fake, worker, r"did not become ready within 0\.5 s")
    assert 0.5 - TICK <= took < 2.0, took
    assert ("stop", UNIT) in fake.calls  # a model left loading would hold its memory


def test_notify_models_are_not_probed() -> None:
    worker = SystemdWorker(FakeSystemd(), "demo", start_timeout_s=5, ready=Ready("notify"))
    assert worker.ready is None


def test_a_start_cancelled_after_startunit_stops_the_worker() -> None:
    """systemd's job goes on when the bus call is dropped: the worker must not be left
    starting (and holding its card) after whoever waited for it gave up."""
    fake = FakeSystemd()
    fake.unit(UNIT).behaviour = Behaviour(delay_s=0.3)
    worker = SystemdWorker(fake, "demo", start_timeout_s=5)

    async def go() -> str:
        start = asyncio.create_task(worker.start({}, None))
        await asyncio.sleep(0.05)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        await asyncio.sleep(0.4)  # past the job's own end
        return fake.unit(UNIT).active

    assert asyncio.run(go()) == "inactive"
    assert ("stop", UNIT) in fake.calls


def test_a_probe_that_breaks_is_not_taken_for_the_model_answering() -> None:
    fake = FakeSystemd()
    worker = probing(fake, Ready("tcp"), delay_s=0.3, result="exit-code", status=5)

    async def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("probe bug")

    worker._probe = lambda env: asyncio.ensure_future(broken())  # type: ignore[method-assign]
    with pytest.raises(StartFailed, match="status 5"):
        asyncio.run(worker.start({"PROVIDERD_WORKER_PORT": "9"}, None))


def test_a_stop_left_to_systemd_asks_pid1_for_nothing() -> None:
    """PID 1 is stopping the front and stops the worker after it: a stop job of ours would
    wait behind the front's own. Neither a cancelled start nor stop() asks for one."""
    fake = FakeSystemd()
    worker = probing(fake, Ready("tcp"), delay_s=0.01)
    s = listener()  # bound, never listening: the start waits for the model

    async def go() -> None:
        start = asyncio.ensure_future(
            worker.start({"PROVIDERD_WORKER_PORT": str(s.getsockname()[1])}, None)
        )
        await asyncio.sleep(0.2)
        worker.leave_stop_to_systemd()
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        await worker.stop()

    try:
        asyncio.run(go())
    finally:
        s.close()
    assert ("stop", UNIT) not in fake.calls
    assert fake.unit(UNIT).active == "active"  # PID 1 stops it once the front is gone
