"""Starting, watching and stopping the worker.

Two implementations of one interface:
- `SystemdWorker` starts `provider-worker@<slug>.service` through systemd's D-Bus API.
  The unit runs the model itself (`Type=exec`) or the wrapper (`Type=notify`): for `tcp`
  and `http:` readiness the front's own probe says when the model answers, and the job's
  end does not; for `notify`, the job ends at the model's READY=1.
- `ProcessWorker` runs the same wrapper command as a child process (foreground mode),
  giving it a notify socket of its own so the wrapper's READY=1 means the same thing.

Why this module is over 400 lines: the two implementations must mean the same thing by
"started", "ready" and "stopped", and keeping them side by side is how that is
checked when either changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agent.errors import ProviderdError
from agent.spec import paths
from agent.spec.files import write_atomic
from agent.spec.provider import Address, Ready
from agent.systemd.bus import REFUSED, Systemd
from agent.systemd.envfile import environment_file
from agent.systemd.names import worker_unit
from agent.systemd.syncbus import same_device_rules
from agent.worker import wrapper as worker
from agent.worker.readiness import until_answers

ExitCallback = Callable[[str], None]
DeviceRules = Sequence[tuple[str, str]]


class StartFailed(ProviderdError):
    """The worker did not become ready."""

    code = "start_failed"

    def __init__(
        self,
        reason: str,
        log_tail: Sequence[str] = (),
        *,
        result: object = None,
        status: object = None,
        job_failed: bool = False,
        stopped: bool = False,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.log_tail = list(log_tail)
        # systemd's Result= and ExecMainStatus= as read for this failure (None: not read),
        # and whether this attempt's start job itself ended failed (not "done").
        self.result = result
        self.status = status
        self.job_failed = job_failed
        # PID 1 stopped the worker (or is stopping it) while it started: not the model's
        # failure, and nothing to keep the next activation from starting it.
        self.stopped = stopped


class WorkerControl(Protocol):
    def on_exit(self, callback: ExitCallback) -> None:
        """`callback(reason)` when the worker goes away without being asked to."""
        ...

    async def start(self, env: Mapping[str, str], devices: DeviceRules | None) -> None:
        """Start the worker and return once it answers; raises StartFailed."""
        ...

    async def stop(self) -> None:
        """Stop the worker and return once it is gone."""
        ...

    def leave_stop_to_systemd(self) -> None:
        """From now on, stopping is PID 1's: it is stopping the front and stops the worker
        after it (the front's unit is ordered after the worker's), so a stop of ours,
        queued behind the front's own, would never end while the front waits for it."""
        ...

    async def answered(self, timeout_s: float) -> bool:
        """Wait, at most `timeout_s`, until every start asked of PID 1 is answered (a caller
        cancelled meanwhile included): whether they all are. A front leaves only then, so
        that PID 1 sees a late start while the front's own stop is still under way, and
        refuses it."""
        ...

    def answers_by(self, deadline: float) -> None:
        """Every wait for PID 1's answers from now on (a stop's, `answered`'s) ends at
        `deadline` (the event loop's clock) at the latest: a leaving front's one budget."""
        ...

    def sending(self) -> bool:
        """Whether a `start` is under way that may still ask PID 1 for a start: entered, and
        not yet through a cancel (once it has taken one, any StartUnit it made is counted
        by `answered`, and it sends none after)."""
        ...

    async def pids(self) -> list[int]: ...

    async def memory(self) -> dict[str, int | None]:
        """{"current": bytes, "max": bytes} where known."""
        ...


def write_env_file(path: Path, env: Mapping[str, str]) -> None:
    """Write an EnvironmentFile= atomically (temp + rename)."""
    write_atomic(path, environment_file(env))


# ---------------------------------------------------------------------------- systemd


@dataclass(frozen=True)
class _Adopted:
    """A start of the worker asked for on another connection, and what it was asked with."""

    job: str
    env: dict[str, str]
    devices: list[tuple[str, str]] | None


def _job_path(job: object) -> str:
    """The path in a unit's Job= property, (id, path); "" where it has no job (id 0)."""
    return str(job[1]) if isinstance(job, (list, tuple)) and len(job) == 2 and job[0] else ""


def _rules(devices: DeviceRules | None) -> list[tuple[str, str]] | None:
    return None if devices is None else [(str(p), str(a)) for p, a in devices]


class SystemdWorker:
    def __init__(
        self,
        systemd: Systemd,
        slug: str,
        start_timeout_s: float,
        *,
        with_front: bool = False,
        ready: Ready | None = None,
    ) -> None:
        self.systemd = systemd
        self.slug = slug
        # How the front sees for itself that the model answers, while the start job runs
        # (agent.worker.readiness); None: the job's end alone says so.
        self.ready = ready if ready is not None and ready.kind != "notify" else None
        self.unit = worker_unit(slug)
        self.start_timeout_s = start_timeout_s
        # systemd started the worker on the front's own activation: the first start joins
        # that one (or reports its failure) instead of starting the model a second time.
        self._with_front = with_front
        self._on_exit: ExitCallback = lambda _reason: None
        self._watching = False
        self._running = False  # we started it and did not ask it to stop
        self._exit_task: asyncio.Task[None] | None = None
        self._exited: asyncio.Future[None] | None = None  # set while a start waits
        self._stop_left_to_systemd = False
        self._sending = False  # `sending`
        self._adopted: _Adopted | None = None

    def on_exit(self, callback: ExitCallback) -> None:
        self._on_exit = callback

    def adopt(self, job: str, env: Mapping[str, str], devices: DeviceRules | None) -> None:
        """A start asked for already, on another connection (`agent.front.early`): worker.env
        written with `env`, `DeviceAllow=` made `devices`, StartUnit answered with `job`.
        The next start with the same `env` and `devices` follows that job and does none of
        it again; a start decided otherwise does everything, as any start."""
        self._adopted = _Adopted(job, dict(env), _rules(devices))

    def _state_changed(self, active: str, _sub: str) -> None:
        ended = active in ("failed", "inactive", "deactivating")
        if ended and self._exited is not None and not self._exited.done():
            self._exited.set_result(None)  # it ended while the front waits for it to answer
        if self._running and active in ("failed", "inactive", "deactivating"):
            self._running = False
            self._exit_task = asyncio.get_running_loop().create_task(self._report_exit())

    async def _report_exit(self) -> None:
        self._on_exit((await self._failure("exited"))[0])

    async def _failed(self, *, job_failed: bool = False, stopped: bool = False) -> StartFailed:
        """The failed start, with why and what systemd's Result= and ExecMainStatus= say."""
        stopped = stopped or await self._stop_job() != ""
        if stopped:
            reason, result, status = "worker was stopped while it started", None, None
        else:
            reason, result, status = await self._failure("failed to start")
        tail = await journal_tail(self.unit)
        return StartFailed(
            reason, tail, result=result, status=status, job_failed=job_failed, stopped=stopped
        )

    async def _stop_job(self) -> str:
        """The path of the unit's stop job, "" where it has none (or the bus says nothing)."""
        try:
            path = _job_path(await self.systemd.get(self.unit, "Unit", "Job"))
            return path if path and await self.systemd.job_type(path) == "stop" else ""
        except Exception:
            return ""

    async def _failure(self, what: str) -> tuple[str, object, object]:
        """Why the worker `what` (exited, failed to start), and Result=, ExecMainStatus=."""
        try:
            result = await self.systemd.get(self.unit, "Service", "Result")
            status = await self.systemd.get(self.unit, "Service", "ExecMainStatus")
        except Exception as e:  # the bus went away: say what we know
            return f"worker {what} ({e})", None, None
        return self._reason(what, result, status), result, status

    def _reason(self, what: str, result: object, status: object) -> str:
        if result == "oom-kill":
            return f"worker {what}: killed by the kernel for exceeding its memory limit (oom-kill)"
        if result == "timeout":
            return f"worker {what}: did not become ready within {self.start_timeout_s:g} s"
        if result == "exit-code":
            if isinstance(status, int) and status in _SETUP_STATUS:  # before the model ran
                return f"worker {what}: status {status}/{_SETUP_STATUS[status]}"
            return f"worker {what} with status {status}"
        if result == "signal":
            return f"worker {what}: killed by signal {status}"
        return f"worker {what} (result: {result})"

    def drop_adopted(self) -> None:
        """The first start attempt is over, whatever its outcome (it may have failed before
        it got here): no later start follows the adopted job."""
        self._adopted = None

    async def start(self, env: Mapping[str, str], devices: DeviceRules | None) -> None:
        self._sending = True
        try:
            await self._start(env, devices)
        finally:
            self._sending = False

    async def _start(self, env: Mapping[str, str], devices: DeviceRules | None) -> None:
        adopted, self._adopted = self._adopted, None
        if adopted is not None and (adopted.env, adopted.devices) != (dict(env), _rules(devices)):
            # Decided otherwise: the adopted job (or the worker it started) runs with the
            # other worker.env and card, and a StartUnit would join it. Stopped first.
            adopted = None
            if not self._stop_left_to_systemd:
                await self.systemd.stop_unit(self.unit)
        if adopted is None:
            write_env_file(paths.worker_env_file(self.slug), env)
            if devices is not None and not await self._devices_are(devices):
                rules = list(devices)
                await self.systemd.set_properties(
                    self.unit, [("DeviceAllow", "a(ss)", []), ("DeviceAllow", "a(ss)", rules)]
                )
        try:
            await self._start_job(adopted, env)
        except StartFailed as e:
            if not _failed_at_cgroup(e):
                raise
            # PID 1 could not move the worker's first process into the unit's cgroup: a race
            # in systemd 252's legacy (hybrid) cgroup hierarchy, seen when the start comes
            # tens of milliseconds after the front's activation skipped the worker (its
            # condition). A new start goes through.
            logging.getLogger(f"providerd.{self.slug}").warning(
                "Worker's start failed at systemd's CGROUP step (status %s/CGROUP), "
                "asking for it once more",
                _CGROUP_STATUS,
            )
            await self._start_job(None, env)

    async def _start_job(self, adopted: _Adopted | None, env: Mapping[str, str]) -> None:
        """The start job (or the adopted one) until the model answers; raises StartFailed."""
        beside: str | None = None
        if self._with_front:
            self._with_front = False
            beside = await self._beside_front()
        watching: asyncio.Future[None] | None = None
        if not self._watching:
            # Set up while the start runs: it only matters once the worker is ready.
            watching = asyncio.ensure_future(self.systemd.watch(self.unit, self._state_changed))
            self._watching = True
        job: asyncio.Future[str]
        if adopted is not None:
            job = asyncio.ensure_future(self.systemd.follow(self.unit, adopted.job))
        elif beside == "":  # running already: nothing to ask PID 1 for
            job = asyncio.get_running_loop().create_future()
            job.set_result("done")
        elif beside is not None:
            job = asyncio.ensure_future(self.systemd.follow(self.unit, beside))
        else:
            job = asyncio.ensure_future(self.systemd.start_unit(self.unit))
        try:
            await self._until_started(job, self._probe(env), watching)
        except BaseException as e:
            # Whatever ends a start here (its failure, a timeout, a cancel), systemd's job
            # may still run: the worker is stopped, as ProcessWorker ends its child.
            self._running = False
            if isinstance(e, asyncio.CancelledError):
                self._sending = False  # its StartUnit, if any, went out: `answered` has it
            if not self._stop_left_to_systemd:
                with contextlib.suppress(Exception):
                    await self.systemd.stop_unit(self.unit)
            raise

    async def _until_started(
        self,
        job: asyncio.Future[str],
        answered: asyncio.Future[None] | None,
        watching: asyncio.Future[None] | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        done: set[asyncio.Future[Any]] = set()  # a cancel may come before the first wait ends
        try:
            waited: set[asyncio.Future[Any]] = {job} if answered is None else {job, answered}
            done, _ = await asyncio.wait(
                waited, timeout=self.start_timeout_s + 30, return_when=asyncio.FIRST_COMPLETED
            )
            if answered in done and job not in done and answered.exception() is not None:
                # The probe broke, it did not see the model: the job alone decides.
                done, _ = await asyncio.wait({job}, timeout=self.start_timeout_s + 30)
            elif answered is not None and answered not in done and _ended(job, "done"):
                # The job ended once the model's program runs (Type=exec), or at the
                # wrapper's READY=1: the front's own probe says when the model answers,
                # unless the worker ends first, within the start timeout.
                if watching is not None:  # its exit is seen once it is set up
                    await asyncio.wait({watching})  # a cancel of ours must not cancel it
                exited = self._exited = loop.create_future()
                if await self.systemd.get(self.unit, "Unit", "ActiveState") != "active":
                    raise await self._failed()
                left = self.start_timeout_s - (loop.time() - began)
                done, _ = await asyncio.wait(
                    {answered, exited},
                    timeout=max(0.0, left),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if exited in done:
                    raise await self._failed()
                if answered in done and answered.exception() is None:
                    done = {answered}
                elif answered in done:  # the probe broke: the running unit decides
                    done = {job}
        finally:
            self._exited = None
            if answered is not None:
                answered.cancel()
            if not job.done() and not (answered is not None and answered in done):
                job.cancel()  # cancelled, or timed out: the job's result no longer matters
            if watching is not None:
                # The start's own failure, if any, comes first.
                failing = sys.exc_info()[1] or (
                    job.exception() if job.done() and not job.cancelled() else None
                )
                try:
                    await watching
                except BaseException as e:
                    self._watching = False  # the next start tries again
                    if failing is None or isinstance(e, asyncio.CancelledError):
                        raise  # (a cancel is the caller's, whatever failed before it)
        if not done:
            raise StartFailed(
                f"worker did not become ready within {self.start_timeout_s:g} s",
                await journal_tail(self.unit),
            )
        if job not in done:
            # The model answers the front: it is ready, whatever the job still does. A job
            # that ends otherwise than "done" from here on is the worker's exit.
            self._running = True
            if not job.done():
                job.add_done_callback(self._job_ended)
            return
        if job.result() == "done":
            if await self.systemd.get(self.unit, "Unit", "ActiveState") == "active":
                self._running = True
                return
            raise await self._failed()  # done, and not active: its condition, say
        # "canceled": a stop replaced the start job (PID 1's, or another client's);
        # REFUSED: PID 1 took the StartUnit while a stop job was queued or running (the
        # worker's, or the front's own, which the worker's BindsTo= pulls in).
        r = job.result()
        raise await self._failed(job_failed=r != REFUSED, stopped=r in ("canceled", REFUSED))

    async def _devices_are(self, devices: DeviceRules) -> bool:
        """Whether the unit's DeviceAllow= is `devices` already (set so for an earlier start
        on the same card, and kept until reboot): reading it needs no polkit check, setting
        it does, on the way to StartUnit."""
        try:
            current = await self.systemd.get(self.unit, "Service", "DeviceAllow")
        except Exception:  # the bus says nothing useful: set them
            return False
        return same_device_rules(current, devices)

    def _probe(self, env: Mapping[str, str]) -> asyncio.Future[None] | None:
        """The front's own probe of the model (where its readiness can be probed)."""
        port = env.get("PROVIDERD_WORKER_PORT", "")
        if self.ready is None or not port.isdigit():
            return None
        address = Address(env.get("PROVIDERD_WORKER_HOST", "127.0.0.1"), int(port))
        return asyncio.ensure_future(until_answers(address, self.ready))

    def _job_ended(self, job: asyncio.Future[str]) -> None:
        if job.cancelled() or job.exception() is not None:
            return
        if job.result() != "done" and self._running:
            self._running = False
            self._exit_task = asyncio.get_running_loop().create_task(self._report_exit())

    async def _beside_front(self) -> str | None:
        """The start systemd made beside the front, as the front finds it: the path of its
        job still under way (followed), "" for a worker running already, None where it is
        to be asked for (StartUnit); raises StartFailed if that start has failed already,
        or if the worker is being stopped.

        The activation enqueued a start job for the worker with the front's; it is either
        still under way, done (the unit active), or failed before the front asked: "failed"
        with no job can only be that start's end, since a start job clears an earlier
        failure when it runs. No StartUnit for a start made already: PID 1 takes one from
        the front only once polkit allows it, tens of milliseconds later, or hundreds on a
        busy host; by then the model may have answered the front, and `providerctl stop`
        may have stopped it, and the late start would then start the worker again and,
        by its BindsTo=, the front that was leaving. Nor for a worker being stopped (a
        stop job, queued behind the front's own for a Type=exec worker, or "deactivating"):
        a StartUnit would replace that stop. The job's own JobType says what it is: the
        unit's state, read beside it, cannot tell a start job from a stop job.
        """
        job, active = await asyncio.gather(  # sent together: one round trip, not two
            self.systemd.get(self.unit, "Unit", "Job"),
            self.systemd.get(self.unit, "Unit", "ActiveState"),
        )
        path = _job_path(job)
        if path:
            kind = await self.systemd.job_type(path)
            if kind in ("start", "restart"):
                return path  # followed, whatever the state read beside it said
            if kind == "stop":
                raise await self._failed(stopped=True)
            if not kind:  # over since: how it ended is the unit's state now
                active = await self.systemd.get(self.unit, "Unit", "ActiveState")
                if active == "inactive" and not await self._skipped():
                    raise await self._failed(stopped=True)  # a stop's end, or a start's undone
        if active == "failed":
            raise await self._failed(job_failed=await self._never_active())
        if active in ("active", "reloading"):
            return ""
        if active == "inactive":
            return None  # not started yet, or skipped by its conditions: asked for
        raise await self._failed(stopped=True)  # "deactivating": never asked to start

    async def _skipped(self) -> bool:
        """Whether the unit's last start was skipped by its conditions (keys on and no
        worker.env yet, say): the front is to start it itself."""
        try:
            return await self.systemd.get(self.unit, "Unit", "ConditionResult") is False
        except Exception:
            return False

    async def _never_active(self) -> bool:
        """Whether the unit has not been active since it last left "inactive": its start
        job failed (a Type=exec worker's, before its exec), rather than the worker exiting
        after its start."""
        try:
            entered, left = await asyncio.gather(  # one round trip
                self.systemd.get(self.unit, "Unit", "ActiveEnterTimestampMonotonic"),
                self.systemd.get(self.unit, "Unit", "InactiveExitTimestampMonotonic"),
            )
        except Exception:
            return False
        return isinstance(entered, int) and isinstance(left, int) and entered < left

    async def stop(self) -> None:
        self._running = False
        if not self._stop_left_to_systemd:
            await self.systemd.stop_unit(self.unit)

    def leave_stop_to_systemd(self) -> None:
        self._stop_left_to_systemd = True

    async def answered(self, timeout_s: float) -> bool:
        return await self.systemd.answered(timeout_s)

    def answers_by(self, deadline: float) -> None:
        self.systemd.answers_by(deadline)

    def sending(self) -> bool:
        return self._sending

    async def pids(self) -> list[int]:
        return await self.systemd.unit_pids(self.unit)

    async def memory(self) -> dict[str, int | None]:
        def known(value: object) -> int | None:
            return value if isinstance(value, int) and value < 2**63 else None

        try:
            current = await self.systemd.get(self.unit, "Service", "MemoryCurrent")
            limit = await self.systemd.get(self.unit, "Service", "MemoryMax")
        except Exception:
            return {"current": None, "max": None}
        return {"current": known(current), "max": known(limit)}


# systemd's own exit statuses for a unit that failed before its command ran
# (systemd.exec(5), "Process Exit Codes"): the common ones, by the name systemd logs.
_CGROUP_STATUS = 219
_SETUP_STATUS = {
    200: "CHDIR (the working directory)",
    203: "EXEC (the command cannot be run: does the program exist?)",
    217: "USER",
    _CGROUP_STATUS: "CGROUP (systemd could not put the process into the unit's cgroup)",
    226: "NAMESPACE (the sandbox's mounts: a path it binds may be missing)",
    243: "CREDENTIALS (a credential file cannot be read)",
}


def _failed_at_cgroup(e: StartFailed) -> bool:
    """Whether this attempt's own start job (or the activation's, which the front's first
    start joins) failed at systemd's CGROUP step (status 219), as read when it failed.

    For a Type=exec worker that is proof the model never ran: its job ends "done" once the
    exec succeeds, so a job that fails failed before it. For a Type=notify worker (the
    wrapper, or a model that sends READY=1 itself) the job also fails when the process
    exits before READY=1, and the wrapper exits with the model's own status: a model that
    itself exits with 219 before it is ready is started a second time, to fail the same
    way. That costs one more failed start of a model that fails anyway, and is accepted."""
    return e.job_failed and e.result == "exit-code" and e.status == _CGROUP_STATUS


def _ended(job: asyncio.Future[str], result: str) -> bool:
    return job.done() and not job.cancelled() and job.exception() is None and job.result() == result


async def journal_tail(unit: str, lines: int = 10) -> list[str]:
    """The unit's last log lines, from the journal (empty where it cannot be read).

    No `this_boot()`: it reads /proc/sys, which the front's sandbox hides (ProcSubset=pid).
    """

    def read() -> list[str]:
        try:
            from systemd import journal

            reader = journal.Reader()
            try:
                reader.add_match(_SYSTEMD_UNIT=unit)
                reader.seek_tail()
                out: list[str] = []
                for _ in range(lines):
                    entry = reader.get_previous()
                    if not entry:
                        break
                    out.append(str(entry.get("MESSAGE", "")))
                return out[::-1]
            finally:
                reader.close()
        except Exception:  # the journal is an aid to the message, never a reason to fail
            return []

    return await asyncio.get_running_loop().run_in_executor(None, read)


# ---------------------------------------------------------------------------- foreground


class _Child:
    """A child process watched through a pidfd: its exit status, without a watcher thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = loop.create_future()
        self._fd = os.pidfd_open(pid)
        loop.add_reader(self._fd, self._reap)

    def _reap(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 0
        if pid == 0:
            return
        asyncio.get_running_loop().remove_reader(self._fd)
        os.close(self._fd)
        self.returncode = os.waitstatus_to_exitcode(status)
        self._exited.set_result(self.returncode)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


def _spawn(argv: Sequence[str], env: Mapping[str, str], cwd: str | None, out: int) -> int:
    """Start the worker wrapper with its output on `out`, in a session of its own.

    The wrapper (`python3 -m agent.worker ...`) is forked from this interpreter, where
    agent.worker.wrapper is already imported, and runs there: the same code as under systemd,
    without paying for a second interpreter's start (~10 ms) on every cold start. Any
    other command is executed as it is.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    in_process = list(argv[1:3]) == ["-m", "agent.worker"]
    pid = os.fork()
    if pid:
        return pid
    code = 127
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)  # the parent's event loop must not hear the child's signals
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # listeners, the loop's own fds
        if cwd is not None:
            os.chdir(cwd)
        if in_process:
            os.environ.clear()
            os.environ.update(env)
            sys.argv = [str(a) for a in argv]
            code = worker.main(list(argv[3:]))
        else:
            os.execvpe(argv[0], list(argv), dict(env))
    except BaseException as e:  # the child must never return into the parent's code
        with contextlib.suppress(Exception):
            os.write(2, f"Failed to run the worker wrapper: {e}\n".encode())
        code = 127
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    return 0  # not reached


class ProcessWorker:
    """The worker wrapper as a child process: foreground mode, no cgroup limits."""

    def __init__(
        self,
        slug: str,
        argv: Sequence[str],
        *,
        environment: Mapping[str, str],
        working_directory: str | None,
        start_timeout_s: float,
        stop_timeout_s: float,
        log: Callable[[str], None],
        credentials: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.slug = slug
        self.credentials = list(credentials)
        self.credentials_dir: str | None = None
        self.argv = list(argv)
        self.environment = dict(environment)
        self.working_directory = working_directory
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log = log
        self.tail: deque[str] = deque(maxlen=10)
        self.proc: _Child | None = None
        self._on_exit: ExitCallback = lambda _reason: None
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        worker.preload()  # _spawn forks the wrapper from here: it finds ctypes loaded

    def on_exit(self, callback: ExitCallback) -> None:
        self._on_exit = callback

    async def start(self, env: Mapping[str, str], devices: DeviceRules | None) -> None:
        loop = asyncio.get_running_loop()
        self._stopping = False
        self.tail.clear()
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        address = f"\0providerd-{os.getpid()}-{self.slug}-{time.monotonic_ns()}"
        notify.bind(address)
        notify.setblocking(False)
        child_env = {
            **os.environ,
            **self.environment,
            **env,
            "NOTIFY_SOCKET": "@" + address[1:],
            "PROVIDERD_DIE_WITH_PARENT": str(os.getpid()),
        }
        child_env.pop("LISTEN_FDS", None)
        child_env.pop("LISTEN_PID", None)
        child_env.pop("CREDENTIALS_DIRECTORY", None)
        if self.credentials:
            try:
                child_env["CREDENTIALS_DIRECTORY"] = self._load_credentials()
            except StartFailed:
                notify.close()
                raise
        ready: asyncio.Future[None] = loop.create_future()

        def on_datagram() -> None:
            while True:
                try:
                    data = notify.recv(4096)
                except BlockingIOError:
                    return
                for line in data.decode(errors="replace").splitlines():
                    if line == "READY=1" and not ready.done():
                        ready.set_result(None)

        loop.add_reader(notify.fileno(), on_datagram)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        try:
            proc = self.proc = _Child(_spawn(self.argv, child_env, self.working_directory, out_w))
        except OSError as e:
            loop.remove_reader(notify.fileno())
            notify.close()
            os.close(out_r)
            self._drop_credentials()
            raise StartFailed(f"failed to run the worker wrapper: {e}") from None
        finally:
            os.close(out_w)
        self._tasks = [loop.create_task(self._pump_output(out_r))]
        exited = loop.create_task(proc.wait())
        try:
            waited: set[asyncio.Future[Any]] = {ready, exited}
            done, _ = await asyncio.wait(
                waited, timeout=self.start_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if ready in done:
                self._tasks.append(loop.create_task(self._watch(proc)))
                return
            if exited in done:
                await asyncio.sleep(0.05)  # let the last output lines arrive
                self._drop_credentials()
                raise StartFailed(
                    f"worker failed to start: {describe_status(exited.result())}", list(self.tail)
                )
            await self._terminate(proc)
            raise StartFailed(
                f"worker did not become ready within {self.start_timeout_s:g} s", list(self.tail)
            )
        except asyncio.CancelledError:
            await self._terminate(proc)  # a cancelled start leaves no process and no credentials
            raise
        finally:
            loop.remove_reader(notify.fileno())
            notify.close()
            if not ready.done():
                ready.cancel()

    def _load_credentials(self) -> str:
        """What LoadCredential= does, without systemd: a private copy of each file in a
        directory only this user can read, removed when the worker is gone."""
        self._drop_credentials()
        directory = tempfile.mkdtemp(prefix=f"providerd-{self.slug}-credentials-")
        self.credentials_dir = directory
        for name, source in self.credentials:
            try:
                with open(source, "rb") as f:
                    data = f.read()
                fd = os.open(
                    os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400
                )
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
            except OSError as e:
                self._drop_credentials()
                raise StartFailed(
                    f"Failed to load credential {name} from {source}: {e.strerror or e}"
                ) from None
        return directory

    def _drop_credentials(self) -> None:
        if self.credentials_dir is not None:
            shutil.rmtree(self.credentials_dir, ignore_errors=True)
            self.credentials_dir = None

    async def _pump_output(self, fd: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
        )
        try:
            while line := await reader.readline():
                text = line.decode(errors="replace").rstrip("\n")
                self.tail.append(text)
                self.log(text)
        finally:
            transport.close()

    async def _watch(self, proc: _Child) -> None:
        status = await proc.wait()
        _kill_group(proc.pid)
        self._drop_credentials()
        if not self._stopping:
            await asyncio.sleep(0.05)
            self._on_exit(f"worker exited: {describe_status(status)}")

    async def _terminate(self, proc: _Child) -> None:
        """SIGTERM to the wrapper, SIGKILL to everything left after the stop timeout."""
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.stop_timeout_s)
        except TimeoutError:
            self.log(f"Worker did not stop within {self.stop_timeout_s:g} s, killing it")
        _kill_group(proc.pid)
        await proc.wait()
        self._drop_credentials()

    def leave_stop_to_systemd(self) -> None:
        pass  # no systemd here: the front stops its child itself

    async def answered(self, timeout_s: float) -> bool:
        return True  # a child is started at once, nothing waits for an answer

    def answers_by(self, deadline: float) -> None:
        pass

    def sending(self) -> bool:
        return False

    async def stop(self) -> None:
        self._stopping = True
        if self.proc is not None:
            await self._terminate(self.proc)
        for task in self._tasks:
            task.cancel()
        self._tasks = []

    async def pids(self) -> list[int]:
        if self.proc is None or self.proc.returncode is not None:
            return []
        return process_group(self.proc.pid)

    async def memory(self) -> dict[str, int | None]:
        total = 0
        for pid in await self.pids():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf(
                    "SC_PAGE_SIZE"
                )
        return {"current": total or None, "max": None}


def describe_status(status: int) -> str:
    if status < 0:
        return f"killed by signal {signal.Signals(-status).name}"
    return f"status {status}"


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def process_group(pgid: int) -> list[int]:
    """The live processes of one process group."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out
