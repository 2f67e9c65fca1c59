"""The worker's start, asked for first: a front that decides its worker's start (a GPU
placement, a port chosen per start) decides it and sends `StartUnit` before anything else.

`begin()` runs before the event loop, dbus-next and the rest of the front are imported:
the manifest; whether this activation starts the worker at all (not with API keys on,
nor while a saved backoff exists, nor for a worker systemd starts beside the front); the
port; GPU admission at once (`agent.gpu.quick`); worker.env; `DeviceAllow=` when it must
change; `StartUnit` over a blocking bus connection (`agent.systemd.syncbus`). The front's
start then follows that job as it follows a start it asks for itself
(`agent.worker.control.SystemdWorker.adopt`): one start, the same waiting, the same
failures, and nothing done twice (worker.env, `DeviceAllow=`).

What it decides from comes from the generator's record of the provider
(`agent.systemd.early_record`) while the manifest and the files around it are as they were
when it was written: nothing of `agent.spec`'s validation is imported then (the front
validates the manifest in full after the StartUnit). Else it validates the manifest itself.
Either way this module's imports are kept to what the path it takes needs: `logging`, for
one, only where a module it calls may log (the manifest's validation). A GPU provider's
start decided from the record imports no more than a CPU provider's but the GPU's own
modules, which import neither logging nor `dataclasses`, `typing` or `pathlib`: the
record carries the GPU request (`agent.gpu.placement.Request`), the placement reads the
cards (NVML), the other fronts' reservations and the footprint, and what it would have
logged (a footprint that cannot be read) is said here, in the front's log, once it is set
up.

What it cannot decide at once (the GPU lock held by another front's admission, a fit that
needs a provider retired, NVML or the bus failing) it leaves, having undone what it did,
to the front's own start, which then does everything as before. It never raises.
"""

from __future__ import annotations

import os
import time

from agent.errors import ProviderdError

# Not `typing.TYPE_CHECKING`: importing typing (and collections.abc) costs milliseconds on the
# way to StartUnit, for names only annotations use (mypy reads this one as typing's).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import logging
    from collections.abc import Mapping, Sequence
    from typing import Any

    from agent.gpu.placement import GpuRequest, Request
    from agent.gpu.reservations import Admitted
    from agent.spec.provider import Provider

SD = "org.freedesktop.systemd1"
SD_PATH = "/org/freedesktop/systemd1"
INFO, WARNING, ERROR = 20, 30, 40  # logging's levels, without importing it


class Note:
    """A line of the early start's own, logged by `Early.replay` with the provider's logger."""

    __slots__ = ("args", "exc", "levelno", "msg", "name")

    def __init__(
        self, name: str, level: int, msg: str, args: tuple[Any, ...], exc: BaseException | None
    ) -> None:
        self.name, self.levelno, self.msg, self.args, self.exc = name, level, msg, args, exc

    def getMessage(self) -> str:  # as logging.LogRecord's
        return self.msg % self.args if self.args else self.msg


class Early:
    """What `begin()` did: the provider it loaded (None where it decided from the
    generator's record), and the start it asked for, if any."""

    def __init__(self, slug: str = "") -> None:
        self.slug = slug
        self.provider: Provider | None = None
        self.start: Started | None = None
        self.nvml: Any = None  # agent.gpu.nvml.Nvml, opened for admission: the front keeps it
        self.headroom_bytes: int | None = None  # providerd.toml's, once read (`gpu_read`)
        self.gpu_read = False
        # What was said on the way (its own Notes, and the LogRecords of the modules it
        # called), for the handlers `agent.log.setup()` installs later.
        self.records: list[Any] = []
        self._undo: Any = None  # puts logging back as it was, while records are held

    def stale(self, provider: Provider) -> bool:
        """Whether the start was decided from a record that says otherwise than `provider`,
        the manifest as the front has loaded and validated it (a port, an address or a GPU
        request changed within the record's check). Such a start is dropped here, its GPU
        reservation released: the caller stops the worker, and the front's own start decides
        afresh."""
        start = self.start
        if start is None or not start.from_record or start.request == request(provider):
            return False
        self.start = None
        if start.admitted is not None:
            start.admitted.release()
        self.note(
            WARNING,
            "The generator's record of %s says otherwise than its manifest; stopping the "
            "worker's early start, to start it as the manifest says",
            self.slug,
        )
        self.replay()
        return True

    def note(
        self, level: int, msg: str, *args: Any, exc: BaseException | None = None, logger: str = ""
    ) -> None:
        """A line for the provider's logger, or for `logger` (a module's, said for it)."""
        self.records.append(Note(logger or f"providerd.{self.slug}", level, msg, args, exc))

    def hold(self) -> None:
        """From now on, keep what modules log until logging is set up: `agent.log.setup()`
        imports the journal's module, which is not worth its time on the way to StartUnit."""
        if self._undo is not None:
            return
        import logging

        records = self.records

        class Held(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append(record)

        held = Held(logging.DEBUG)
        root = logging.getLogger()
        own = [logging.getLogger(name) for name in ("providerd", "agent")]  # as agent.log's
        levels = [logger.level for logger in own]
        root.addHandler(held)
        for logger in own:
            logger.setLevel(logging.INFO)

        def undo() -> None:
            root.removeHandler(held)
            for logger, level in zip(own, levels, strict=True):
                logger.setLevel(level)

        self._undo = undo

    def unhold(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    def replay(self) -> None:
        """Hand what was said on the way to the handlers there are now."""
        import logging

        records, self.records = self.records, []
        for record in records:
            logger = logging.getLogger(record.name)
            if isinstance(record, Note):
                logger.log(record.levelno, record.msg, *record.args, exc_info=record.exc)
            else:
                logger.handle(record)


class Started:
    """A start asked for: its job, and what the front's start task needs to follow it."""

    __slots__ = (
        "admitted",
        "devices",
        "env",
        "from_record",
        "job",
        "parts_ms",
        "port",
        "request",
        "set_devices",
        "took_ms",
    )

    def __init__(
        self,
        job: str,  # the start job's object path; "" when StartUnit went out with no answer
        port: int,
        env: dict[str, str],  # as written to worker.env
        devices: list[tuple[str, str]] | None,
        admitted: Admitted | None = None,  # for a GPU provider
        took_ms: float = 0.0,
        # From begin() to StartUnit's reply, and its parts: the manifest (or the record), the
        # decision (the GPU's admission, worker.env), the bus (connection, DeviceAllow=, StartUnit).
        parts_ms: tuple[float, float, float] = (0.0, 0.0, 0.0),
        set_devices: bool = False,  # DeviceAllow= had to change (SetUnitProperties: polkit)
        from_record: bool = False,  # decided from the generator's record, not the manifest
        request: tuple[Any, ...] = (),  # what it was decided from (`request`)
    ) -> None:
        self.job, self.port, self.env, self.devices = job, port, env, devices
        self.admitted, self.took_ms, self.parts_ms = admitted, took_ms, parts_ms
        self.set_devices, self.from_record, self.request = set_devices, from_record, request

    def describe(self) -> str:
        m, d, b = self.parts_ms
        what = ", DeviceAllow= set" if self.set_devices else ""
        source = "record" if self.from_record else "manifest"
        return (
            f"{self.took_ms:.1f} ms into the front: {source} {m:.1f}, decision {d:.1f}, "
            f"bus {b:.1f} ms{what}"
        )


class _Decision:
    """What the start is decided from: the manifest's Provider, or the generator's record."""

    __slots__ = ("gpu", "headroom", "host", "port")

    def __init__(self, port: int, host: str, gpu: GpuRequest | None, headroom: int | None) -> None:
        self.port = port  # 0: a free one, chosen now
        self.host = host
        self.gpu = gpu  # the provider's GPU request (its Provider, or the record's); or None
        self.headroom = headroom  # providerd.toml's GPU headroom; None: not read yet

    def request(self) -> tuple[Any, ...]:
        return _request(self.port, self.host, self.gpu)


def _request(port: int, host: str, gpu: GpuRequest | None) -> tuple[Any, ...]:
    if gpu is None:
        return (port, host, None)
    return (port, host, (gpu.gpu_devices, gpu.gpu_count, gpu.vram_budget_gb, gpu.gpu_priority))


def request(provider: Provider) -> tuple[Any, ...]:
    """What a start is decided from, as the validated manifest says: the worker's port (0:
    chosen at each start) and address, and the GPU request (None without a GPU)."""
    from agent.systemd.units import worker_host

    gpu = provider if provider.uses_gpu else None
    return _request(provider.known_worker_port, worker_host(provider), gpu)


def free_port() -> int:
    """A free loopback port for the worker (in the front's network namespace)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def worker_environment(port: int, host: str, gpu_env: Mapping[str, str]) -> dict[str, str]:
    """worker.env for one start: the port, the GPU's variables, a host-network worker's
    own loopback address."""
    env = {"PROVIDERD_WORKER_PORT": str(port), **gpu_env}
    if host != "127.0.0.1":
        env["PROVIDERD_WORKER_HOST"] = host
    return env


def gpu_headroom() -> tuple[int | None, list[str]]:
    """providerd.toml's GPU headroom (None: the default) and the problems reading it."""
    from agent.spec import settings

    try:
        return settings.load().gpu.headroom_bytes, []
    except settings.ConfigError as e:
        return None, [f"{problem}; using the default GPU headroom" for problem in e.problems]


def begin(argv: Sequence[str]) -> Early:
    """Decide the worker's start and ask for it, if this front may do so at once."""
    began = time.perf_counter()
    early = Early(argv[0] if len(argv) == 1 else "")
    if len(argv) != 1:
        return early
    try:
        _begin(argv[0], early, began)
    except Exception as e:  # a bug: the front's own start does it all, and says what failed
        early.start = None
        early.note(ERROR, "Failed to ask for the worker's start first: %r", e, exc=e)
    finally:
        early.unhold()
    return early


def _from_record(slug: str) -> _Decision | None:
    """The decision's inputs from the generator's record, while it matches the manifest."""
    from agent.systemd import early_record

    manifest = os.environ.get("PROVIDERD_MANIFEST", "")
    fields = early_record.read(slug, manifest) if manifest else None
    if fields is None:
        return None
    try:
        gpu = None
        if fields["gpu"] != "none":
            gpu = _gpu_request(slug, fields)
        headroom = int(fields["headroom"]) if "headroom" in fields else None
        return _Decision(int(fields["port"]), fields["host"], gpu, headroom)
    except ValueError:
        return None  # not as the generator writes it: the manifest decides


def _gpu_request(slug: str, fields: Mapping[str, str]) -> Request:
    """The provider's GPU request, as GPU admission reads it, from the record alone."""
    from agent.gpu.placement import Request

    kind, _, listed = fields["gpu"].partition(" ")
    devices: Any = kind
    if kind == "list":
        devices = tuple(int(d) if d.isdigit() else d for d in listed.split())
    elif kind != "auto":
        raise ValueError(fields["gpu"])
    budget = fields["vram_budget_gb"]
    return Request(
        slug,
        devices,
        int(fields["gpu_count"]),
        None if budget == "-" else float(budget),
        int(fields.get("gpu_priority", "0")),
    )


def _from_manifest(slug: str, early: Early) -> _Decision | None:
    """The decision's inputs from the manifest, validated; None where it has problems (the
    front's own start loads it again and logs every one) or systemd starts the worker."""
    from agent.spec.manifest import ManifestError
    from agent.systemd.manifests import load
    from agent.systemd.units import worker_host

    try:
        provider = early.provider = load(slug)
    except ManifestError:
        return None
    if provider.starts_with_front:
        return None  # systemd started the worker beside the front
    gpu = provider if provider.uses_gpu else None
    return _Decision(provider.known_worker_port, worker_host(provider), gpu, None)


def _begin(slug: str, early: Early, began: float) -> None:
    decision = _from_record(slug)
    if decision is None:
        early.hold()  # validation's modules may log
        decision = _from_manifest(slug, early)
        if decision is None:
            return
    loaded = time.perf_counter()
    from agent.spec import locations

    if locations.keys_on() or os.path.lexists(locations.backoff_file(slug)):
        return  # a request whose key may start it decides; the saved backoff may refuse
    from agent.systemd.names import worker_unit

    port = decision.port or free_port()
    gpu_env: dict[str, str] = {}
    devices: list[tuple[str, str]] | None = None
    admitted = None
    if decision.gpu is not None:
        admitted = _admit(decision, early)
        if admitted is None:
            return
    decided = time.perf_counter()
    try:
        if admitted is not None:
            from agent.gpu.placement import device_allow, worker_env

            gpu_env, devices = worker_env(admitted.placement), device_allow(admitted.placement)
        env = worker_environment(port, decision.host, gpu_env)
        from agent.atomic import write_atomic
        from agent.systemd.envfile import environment_file

        write_atomic(locations.worker_env_file(slug), environment_file(env))
        decided = time.perf_counter()
        job, set_devices = _start(worker_unit(slug), devices)
    except _Unanswered as e:
        # PID 1 may have taken the start: the front's own start keeps this decision (the
        # port, the card and its reservation), so its StartUnit joins the same job.
        why = "Asked for the worker's start first, with no answer (%s); following it"
        early.note(INFO, why, e)
        from_record, request = early.provider is None, decision.request()
        early.start = Started("", port, env, devices, admitted, from_record=from_record)
        early.start.request = request
        return
    except Exception as e:
        if admitted is not None:
            admitted.release()
        early.note(INFO, "Failed to ask for the worker's start first: %s; asking again", e)
        return
    done = time.perf_counter()
    parts = ((loaded - began) * 1000, (decided - loaded) * 1000, (done - decided) * 1000)
    took = (done - began) * 1000
    from_record = early.provider is None
    early.start = Started(
        job, port, env, devices, admitted, took, parts, set_devices, from_record, decision.request()
    )
    early.note(INFO, "Asked for the worker's start first, %s", early.start.describe())


def _admit(decision: _Decision, early: Early) -> Admitted | None:
    """GPU admission at once, or None (and a line why not)."""
    from agent.gpu import footprint
    from agent.gpu.nvml import NvmlUnavailable, open_nvml
    from agent.gpu.quick import admit_now

    assert decision.gpu is not None
    if decision.headroom is None:
        early.hold()  # reading providerd.toml (the record has no headroom) may log
        early.headroom_bytes, problems = gpu_headroom()
        for problem in problems:
            early.note(WARNING, "%s", problem)
    else:
        early.headroom_bytes = decision.headroom
    early.gpu_read = True

    def warn(problem: str) -> None:  # a footprint that cannot be read: as the module logs it
        early.note(WARNING, "%s", problem, logger=footprint.__name__)

    try:
        early.nvml = open_nvml()
        footprints = footprint.Footprints(warn=warn)
        admitted = admit_now(
            decision.gpu, early.nvml, footprints, headroom_bytes=early.headroom_bytes
        )
    except NvmlUnavailable:
        return None  # the front's own admission reports it
    if admitted is None:
        why = "waits for another front's admission or must make room on the GPU"
        early.note(INFO, "Not asking for the worker's start first: admission %s", why)
    return admitted


def _start(unit: str, devices: list[tuple[str, str]] | None) -> tuple[str, bool]:
    """`DeviceAllow=` set when it must change, then StartUnit: the job's path, and whether
    the device rules were set.

    This StartUnit is not one `answered()` (agent.systemd.bus) waits for, and cannot be:
    it goes out before the front's event loop and bus connection exist, and the call
    blocks until PID 1 answers or the socket's timeout (SyncBus, 25 s) passes, the
    connection then closed. Answered, nothing is left to wait for. Unanswered, a late
    answer would come to a closed connection, so no wait could see it; the front then
    sends its own StartUnit for the same decision (`_Unanswered`), and that one is
    followed and waited for. The unanswered early call itself is not: a stop the front
    sends later does not wait for it, and PID 1 may still take it after that stop.
    """
    from agent.systemd.syncbus import (
        PROPERTIES,
        START_MODE,
        BusError,
        SyncBus,
        Variant,
        same_device_rules,
        unit_path,
    )

    bus = SyncBus()
    changed = False
    try:
        if devices is not None:
            try:
                (current,) = bus.call(
                    SD, unit_path(unit), PROPERTIES, "Get", "ss", (SD + ".Service", "DeviceAllow")
                )
                same = same_device_rules(current.value, devices)
            except Exception:  # the bus says nothing useful: set them
                same = False
            if not same:
                props = [
                    ("DeviceAllow", Variant("a(ss)", [])),  # an empty list first replaces them
                    ("DeviceAllow", Variant("a(ss)", devices)),
                ]
                args = (unit, True, props)
                bus.call(SD, SD_PATH, SD + ".Manager", "SetUnitProperties", "sba(sv)", args)
                changed = True
        try:
            (job,) = bus.call(SD, SD_PATH, SD + ".Manager", "StartUnit", "ss", (unit, START_MODE))
        except BusError as e:
            if e.name:  # PID 1 (or polkit) answered no
                raise
            raise _Unanswered(str(e)) from None
        except OSError as e:
            raise _Unanswered(str(e)) from None
        return str(job), changed
    finally:
        bus.close()


class _Unanswered(ProviderdError):
    """StartUnit went out and no answer came back (the bus failed or timed out)."""

    code = "start_unanswered"
