"""A worker that systemd starts on the front's own activation, and the backoff that
outlives a front: what the front, its SystemdWorker and the rendered units decide."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from agent.front import backoff as saved_backoff
from agent.front.front import Front
from agent.front.state import State
from agent.spec.provider import PRIVATE_WORKER_PORT, Address, Provider, Ready
from agent.systemd import units
from agent.worker.control import StartFailed, SystemdWorker
from tests.fakes.fake_systemd import Behaviour, FakeSystemd
from tests.unit.test_front import InProcessWorker, get, listener, shutdown

UNIT = "provider-worker@demo.service"


@pytest.fixture(autouse=True)
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PROVIDERD_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def provider(**kw: object) -> Provider:
    base: dict[str, object] = {
        "slug": "demo",
        "source": Path("/etc/providerd/providers/demo.toml"),
        "addresses": (Address("127.0.0.1", 8008),),
        "command": ("/opt/m", "--port", "{port}"),
    }
    base.update(kw)
    return Provider(**base)  # type: ignore[arg-type]


# ---------------------------------------------------------------- which providers


def test_only_providers_with_nothing_to_decide_start_with_the_front() -> None:
    assert provider().starts_with_front
    assert provider().known_worker_port == PRIVATE_WORKER_PORT
    assert provider(network="host", worker_port=9000).starts_with_front
    # Decided at run time: a free port on the host network, or a GPU's placement.
    assert not provider(network="host").starts_with_front
    assert provider(network="host").known_worker_port == 0
    assert not provider(gpu_devices="auto").starts_with_front


def test_the_worker_dropin_lifts_the_front_only_condition_for_them() -> None:
    text = units.render_worker(provider())
    unit, service = text.split("[Service]")
    assert "ConditionPathExists=\nConditionPathExists=!/run/providerd/%i.backoff\n" in unit
    assert f'Environment="PROVIDERD_WORKER_PORT={PRIVATE_WORKER_PORT}"' in service
    for decided in (provider(network="host"), provider(gpu_devices="auto")):
        assert "ConditionPathExists" not in units.render_worker(decided)
    # The front picks the port per start and writes it into worker.env; the model's command
    # takes it from there.
    decided = units.render_worker(provider(network="host"))
    assert 'Environment="PROVIDERD_WORKER_PORT' not in decided
    assert "--port ${PROVIDERD_WORKER_PORT}" in decided


def test_the_front_starts_after_a_worker_that_runs_the_model_itself() -> None:
    """Ordered after a Type=exec worker on the same activation (it is started at the
    model's exec, and its mount namespace is not built beside the front's); never after a
    worker it starts itself, or one whose start ends only when the model is ready."""
    after = ("Unit", "After", "provider-worker@%i.service")
    assert after in units.front_assignments(provider())
    for other in (
        provider(network="host"),  # the front picks the port: it starts the worker
        provider(gpu_devices="auto"),  # the front places it
        provider(ready=Ready("notify")),  # READY=1 only once the model is loaded
        provider(credentials=(("T", "/etc/t"),)),  # the wrapper: READY=1 once it answers
    ):
        assert after not in units.front_assignments(other), other


def test_the_backoff_condition_names_the_front_backoff_file(runtime: Path) -> None:
    from agent.spec import paths

    assert str(paths.backoff_file("x")) == f"{runtime}/x.backoff"
    assert units.BACKOFF_FILE.replace("%i", "x") == str(paths.RUNTIME_DIR / "x.backoff")


def test_the_template_keeps_the_front_only_condition_for_the_rest() -> None:
    template = (Path(__file__).parents[2] / "units" / "provider-worker@.service").read_text()
    assert "ConditionPathExists=/run/providerd/%i/worker.env" in template


# ---------------------------------------------------------------- joining the start


def worker(fake: FakeSystemd, with_front: bool = True, **behaviour: object) -> SystemdWorker:
    fake.unit(UNIT).behaviour = Behaviour(**behaviour)  # type: ignore[arg-type]
    return SystemdWorker(fake, "demo", start_timeout_s=5, with_front=with_front)


def test_the_front_joins_a_start_still_under_way_without_a_second_start() -> None:
    fake = FakeSystemd()
    w = worker(fake, delay_s=0.2)

    async def go() -> None:
        fake.start_with_front(UNIT)
        await asyncio.sleep(0.05)
        await w.start({"PROVIDERD_WORKER_PORT": "8000"}, None)

    asyncio.run(go())
    assert fake.unit(UNIT).active == "active" and fake.unit(UNIT).starts == 1


def test_the_front_finds_a_worker_already_ready() -> None:
    fake = FakeSystemd()
    w = worker(fake)

    async def go() -> None:
        await fake.start_with_front(UNIT)
        await w.start({}, None)

    asyncio.run(go())
    assert fake.unit(UNIT).active == "active" and fake.unit(UNIT).starts == 1


def test_a_start_that_failed_before_the_front_asked_is_reported_not_repeated() -> None:
    fake = FakeSystemd()
    w = worker(fake, result="exit-code", status=3)

    async def go() -> None:
        await fake.start_with_front(UNIT)
        await w.start({}, None)

    with pytest.raises(StartFailed, match="status 3"):
        asyncio.run(go())
    assert fake.unit(UNIT).starts == 1


def test_a_start_beside_the_front_that_failed_at_the_cgroup_step_is_asked_for_once_more() -> None:
    """The activation's own start job failed with 219 (the unit never became active: for a
    Type=exec worker its exec never ran) before the front asked: asked for once more."""
    fake = FakeSystemd()
    w = worker(fake, result="exit-code", status=219)

    async def go() -> None:
        await fake.start_with_front(UNIT)
        fake.unit(UNIT).behaviour = Behaviour()  # the race is over
        await w.start({}, None)

    asyncio.run(go())
    assert fake.unit(UNIT).starts == 2 and fake.unit(UNIT).active == "active"


def test_a_worker_beside_the_front_that_ran_and_exited_219_is_not_started_again() -> None:
    """Active, then gone with status 219 before the front asked: the model's own status."""
    fake = FakeSystemd()
    w = worker(fake)

    async def go() -> None:
        await fake.start_with_front(UNIT)
        fake.crash(UNIT, "exit-code", 219)
        await w.start({}, None)

    with pytest.raises(StartFailed, match="219"):
        asyncio.run(go())
    assert fake.unit(UNIT).starts == 1


class SlowToAuthorize(FakeSystemd):
    """PID 1 takes the front's StartUnit only once polkit allows it (the front runs as its
    own user): tens of milliseconds later, hundreds on a busy host."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    async def start_unit(self, name: str) -> str:
        await asyncio.sleep(self.delay_s)
        return await super().start_unit(name)


def test_a_stop_right_after_the_first_answer_is_not_undone_by_a_late_start() -> None:
    """The worker systemd started beside the front answers the front's probe at once, and
    the stop comes (the front's STOPPING=1 has PID 1 stop it by its BindsTo=) before a
    StartUnit of the front's could have passed polkit: the worker stays stopped. A late
    StartUnit would start it again, and by its BindsTo= the front that was leaving."""
    fake = SlowToAuthorize(0.3)
    model = listener()
    port = model.getsockname()[1]
    w = SystemdWorker(fake, "demo", start_timeout_s=5, with_front=True, ready=Ready("tcp"))

    async def go() -> None:
        await fake.start_with_front(UNIT)  # Type=exec: done once the model's program runs
        await w.start({"PROVIDERD_WORKER_PORT": str(port)}, None)
        await w.stop()
        await asyncio.sleep(0.6)  # what was on its way to PID 1 has arrived

    try:
        asyncio.run(go())
    finally:
        model.close()
    assert fake.unit(UNIT).active == "inactive"
    assert fake.unit(UNIT).starts == 1
    assert ("start", UNIT) not in fake.calls


def test_the_front_follows_the_start_job_made_beside_it() -> None:
    fake = FakeSystemd()
    w = worker(fake, delay_s=0.2)

    async def go() -> None:
        fake.start_with_front(UNIT)
        await asyncio.sleep(0.05)  # the job runs: the unit is activating
        await w.start({}, None)

    asyncio.run(go())
    assert fake.unit(UNIT).active == "active" and fake.unit(UNIT).starts == 1
    assert ("follow", UNIT) in fake.calls and ("start", UNIT) not in fake.calls


def test_a_worker_with_a_stop_job_queued_is_not_asked_to_start() -> None:
    """A Type=exec worker's stop waits behind its front's own (the front is ordered after
    it): the unit is still "active" with a stop job. A StartUnit would replace that stop,
    and by the worker's BindsTo= start the front again."""
    fake = FakeSystemd()
    w = worker(fake)

    async def go() -> None:
        await fake.start_with_front(UNIT)
        fake.queue_stop(UNIT)
        await w.start({}, None)

    with pytest.raises(StartFailed, match="stopped while it started") as failed:
        asyncio.run(go())
    assert failed.value.stopped
    assert ("start", UNIT) not in fake.calls and fake.unit(UNIT).starts == 1
    assert fake.unit(UNIT).active == "active" and fake.unit(UNIT).job  # left to PID 1


def test_a_deactivating_worker_is_not_asked_to_start() -> None:
    fake = FakeSystemd()
    w = worker(fake)

    async def go() -> None:
        await fake.start_with_front(UNIT)
        fake.unit(UNIT).active, fake.unit(UNIT).sub = "deactivating", "stop-sigterm"
        await w.start({}, None)

    with pytest.raises(StartFailed, match="stopped while it started") as failed:
        asyncio.run(go())
    assert failed.value.stopped
    assert ("start", UNIT) not in fake.calls


class StaleState(FakeSystemd):
    """ActiveState as read beside Job says `state`, whatever the unit does."""

    def __init__(self, state: str) -> None:
        super().__init__()
        self.state: str | None = state

    async def get(self, name: str, interface: str, prop: str) -> object:
        if (interface, prop) == ("Unit", "ActiveState") and self.state is not None:
            state, self.state = self.state, None
            return state
        return await super().get(name, interface, prop)


@pytest.mark.parametrize("state", ["active", "deactivating", "inactive", "failed"])
def test_a_start_job_is_followed_whatever_the_state_read_beside_it(state: str) -> None:
    fake = StaleState(state)
    w = worker(fake, delay_s=0.2)

    async def go() -> None:
        fake.start_with_front(UNIT)
        await asyncio.sleep(0.05)  # the job runs
        await w.start({}, None)

    asyncio.run(go())
    assert fake.unit(UNIT).active == "active" and fake.unit(UNIT).starts == 1
    assert ("follow", UNIT) in fake.calls and ("start", UNIT) not in fake.calls


class JobEndsBetweenReads(FakeSystemd):
    """The unit's job ends after its Job was read and before its JobType is: a queued stop
    runs (the worker stops), or, `skipped`, a start its conditions skip."""

    def __init__(self, skipped: bool) -> None:
        super().__init__()
        self.skipped = skipped

    async def job_type(self, job: str) -> str:
        unit = self.unit(UNIT)
        unit.job = 0
        if self.skipped:
            unit.condition_result = False
        else:
            self._set(unit, "inactive", "dead")
        return await super().job_type(job)


def test_a_job_that_ends_between_the_reads_is_no_reason_to_start() -> None:
    fake = JobEndsBetweenReads(skipped=False)
    w = worker(fake)

    async def go() -> None:
        await fake.start_with_front(UNIT)
        fake.queue_stop(UNIT)
        await w.start({}, None)

    with pytest.raises(StartFailed, match="stopped while it started"):
        asyncio.run(go())
    assert ("start", UNIT) not in fake.calls and fake.unit(UNIT).active == "inactive"


def test_a_start_skipped_by_its_conditions_between_the_reads_is_asked_for() -> None:
    fake = JobEndsBetweenReads(skipped=True)
    w = worker(fake)

    async def go() -> None:
        fake.unit(UNIT).job = 99  # the activation's start job, about to be skipped
        fake._job_types[99] = "start"
        await w.start({}, None)

    fake.unit(UNIT).condition_result = True
    asyncio.run(go())
    assert ("start", UNIT) in fake.calls and fake.unit(UNIT).active == "active"


def test_a_start_job_a_stop_cancels_is_a_stop_not_a_failure() -> None:
    fake = FakeSystemd()
    w = worker(fake, delay_s=0.3)

    async def go() -> None:
        fake.start_with_front(UNIT)
        await asyncio.sleep(0.05)
        stop = asyncio.get_running_loop().call_later(
            0.1, lambda: asyncio.ensure_future(fake.stop_unit(UNIT))
        )
        try:
            await w.start({}, None)
        finally:
            stop.cancel()

    with pytest.raises(StartFailed) as failed:
        asyncio.run(go())
    assert failed.value.stopped and failed.value.job_failed
    assert ("start", UNIT) not in fake.calls


def test_a_start_stopped_by_pid1_keeps_no_backoff_for_the_next_activation(
    runtime: Path,
) -> None:
    """The backoff file's condition would keep the worker from starting on the next
    activation: a stop is no broken model."""
    path = runtime / "demo.backoff"
    fake = FakeSystemd()
    w = worker(fake)

    async def go() -> tuple[bytes, State]:
        await fake.start_with_front(UNIT)
        fake.queue_stop(UNIT)
        sock = listener()
        front = Front(provider(), w, [sock], exit_on_idle=False, worker_port=0, backoff_file=path)
        front.start_accepting()
        answer = await get(sock.getsockname()[1])
        state = front.state
        await shutdown(front, w)
        return answer, state

    answer, state = asyncio.run(go())
    assert answer.startswith(b"HTTP/1.1 503") and b"stopped while it started" in answer, answer
    assert state == State.BACKOFF
    assert not path.exists()
    assert ("start", UNIT) not in fake.calls


def test_after_the_first_start_a_failed_worker_is_started_again() -> None:
    fake = FakeSystemd()
    w = worker(fake, result="exit-code", status=3)

    async def go() -> None:
        await fake.start_with_front(UNIT)
        with pytest.raises(StartFailed):
            await w.start({}, None)
        fake.unit(UNIT).behaviour = Behaviour()  # fixed meanwhile; the backoff ran out
        await w.start({}, None)

    asyncio.run(go())
    assert fake.unit(UNIT).starts == 2 and fake.unit(UNIT).active == "active"


def test_without_the_activation_start_a_failed_unit_is_started() -> None:
    fake = FakeSystemd()
    fake.unit(UNIT).active = "failed"  # from an earlier activation
    w = worker(fake, with_front=False)
    asyncio.run(w.start({}, None))
    assert fake.unit(UNIT).starts == 1 and fake.unit(UNIT).active == "active"


# ---------------------------------------------------------------- the backoff file


def saved(failures: int, until: float, reason: str = "status 3") -> saved_backoff.Saved:
    return saved_backoff.Saved(failures, until, reason, saved_backoff.manifest_key(provider()))


def test_saved_backoff_round_trips_and_ignores_garbage(tmp_path: Path) -> None:
    path = tmp_path / "demo.backoff"
    assert saved_backoff.load(path, provider()) is None
    one = saved(3, 1234.5, "worker failed to start with status 3")
    saved_backoff.save(path, one)
    assert saved_backoff.load(path, provider()) == one
    for garbage in (
        "",
        "{",
        '{"failures": "x"}',
        "[]",
        '{"failures": 0, "until": 1, "reason": ""}',
    ):
        path.write_text(garbage)
        assert saved_backoff.load(path, provider()) is None, garbage
    saved_backoff.clear(path)
    saved_backoff.clear(path)  # gone already: fine
    assert not path.exists()


def test_a_changed_manifest_starts_afresh(tmp_path: Path) -> None:
    path = tmp_path / "demo.backoff"
    saved_backoff.save(path, saved(3, time.monotonic() + 60))
    assert saved_backoff.load(path, provider()) is not None
    assert saved_backoff.load(path, provider(command=("/opt/fixed", "{port}"))) is None


def test_a_failed_start_is_saved_and_a_good_one_clears_it(runtime: Path) -> None:
    path = runtime / "demo.backoff"

    async def go() -> tuple[saved_backoff.Saved | None, bool]:
        sock = listener()
        w = InProcessWorker(fail="worker failed to start with status 3")
        front = Front(provider(), w, [sock], exit_on_idle=False, worker_port=0, backoff_file=path)
        front.start_accepting()
        await get(sock.getsockname()[1])
        saved = saved_backoff.load(path, provider())
        w.fail = None
        front.backoff.until = 0
        front._dispatch(front_event("BACKOFF_OVER"))
        await get(sock.getsockname()[1])
        cleared = not path.exists()
        await shutdown(front, w)
        return saved, cleared

    saved, cleared = asyncio.run(go())
    assert saved is not None and saved.failures == 1 and "status 3" in saved.reason
    assert saved.until > time.monotonic()
    assert cleared


def front_event(name: str) -> object:
    from agent.front.state import Event

    return Event[name]


def test_a_new_front_goes_on_with_the_saved_backoff_then_starts_once(runtime: Path) -> None:
    path = runtime / "demo.backoff"
    saved_backoff.save(path, saved(2, time.monotonic() + 0.3))

    async def go() -> tuple[bytes, int, bytes, int, bool]:
        sock = listener()
        port = sock.getsockname()[1]
        w = InProcessWorker()
        front = Front(provider(), w, [sock], exit_on_idle=False, worker_port=0, backoff_file=path)
        kept = saved_backoff.load(path, provider())
        assert kept is not None
        front.restore_backoff(kept)
        front.start_accepting()
        front.warm("activation")
        refused, starts_then = await get(port), w.starts
        while front.state == State.BACKOFF:
            await asyncio.sleep(0.02)
        served = await get(port)
        gone = not path.exists()
        failures = front.backoff.failures
        await shutdown(front, w)
        return refused, starts_then, served, failures, gone

    refused, starts_then, served, failures, gone = asyncio.run(go())
    assert refused.startswith(b"HTTP/1.1 503") and b"status 3" in refused, refused
    assert starts_then == 0
    assert served.startswith(b"HTTP/1.1 200"), served
    assert failures == 0 and gone


def test_a_saved_backoff_that_ran_out_keeps_its_count_and_lets_the_start_go(
    runtime: Path,
) -> None:
    async def go() -> tuple[State, int]:
        with listener() as sock:
            front = Front(provider(), InProcessWorker(), [sock], exit_on_idle=False)
            front.restore_backoff(saved(4, time.monotonic() - 1))
            return front.state, front.backoff.failures

    assert asyncio.run(go()) == (State.IDLE, 4)


def test_a_host_network_worker_gets_the_resolver_back_and_a_private_one_does_not() -> None:
    binds = [
        v
        for _, k, v in units.worker_assignments(provider(network="host"))
        if k == "BindReadOnlyPaths"
    ]
    assert binds == ["-/run/systemd/resolve -/run/NetworkManager/resolv.conf -/run/resolvconf"]
    private = units.worker_assignments(provider())
    assert not [v for _, k, v in private if k == "BindReadOnlyPaths"]


def test_only_an_absolute_program_runs_without_the_wrapper() -> None:
    """systemd's ExecStart= searches no PATH= of the unit's and takes no relative path: a
    bare program name (found on the manifest's PATH, say a venv) keeps the wrapper."""
    assert units.runs_model_directly(provider(command=("/opt/m", "--port", "{port}")))
    assert units.runs_model_directly(provider(command=("{python}", "-m", "x")))
    for command in (("serve", "--port", "{port}"), ("./serve",), ("bin/serve",)):
        p = provider(command=command)
        assert not units.runs_model_directly(p), command
        assert "-m agent.worker" in units.render_worker(p)
