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

What it cannot decide at once (the GPU lock held by another front's admission, a fit that
needs a provider retired, NVML or the bus failing) it leaves, having undone what it did,
to the front's own start, which then does everything as before. It never raises.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.errors import ProviderdError
from agent.spec.provider import Provider

SD = "org.freedesktop.systemd1"
SD_PATH = "/org/freedesktop/systemd1"


@dataclass
class Early:
    """What `begin()` did: the provider it loaded, and the start it asked for, if any."""

    provider: Provider | None = None
    start: Started | None = None
    nvml: Any = None  # agent.gpu.nvml.Nvml, opened for admission: the front keeps using it
    headroom_bytes: int | None = None  # providerd.toml's, once read (`gpu_read`)
    gpu_read: bool = False
    # What was logged on the way, for the handlers `agent.log.setup()` installs later.
    records: list[logging.LogRecord] = field(default_factory=list)

    def replay(self) -> None:
        """Hand the records kept on the way to the handlers there are now."""
        records, self.records = self.records, []
        for record in records:
            logging.getLogger(record.name).handle(record)


@dataclass(frozen=True)
class Started:
    """A start asked for: its job, and what the front's start task needs to follow it."""

    job: str  # the start job's object path; "" when StartUnit went out with no answer
    port: int
    env: dict[str, str]  # as written to worker.env
    devices: list[tuple[str, str]] | None
    admitted: Any = None  # agent.gpu.reservations.Admitted for a GPU provider
    # From begin() to StartUnit's reply, and its parts: the manifest, the decision (the
    # GPU's admission, worker.env), the bus (connection, DeviceAllow=, StartUnit).
    took_ms: float = 0.0
    parts_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)
    set_devices: bool = False  # DeviceAllow= had to change (SetUnitProperties: polkit)

    def describe(self) -> str:
        m, d, b = self.parts_ms
        what = ", DeviceAllow= set" if self.set_devices else ""
        return (
            f"{self.took_ms:.1f} ms into the front: manifest {m:.1f}, decision {d:.1f}, "
            f"bus {b:.1f} ms{what}"
        )


def free_port() -> int:
    """A free loopback port for the worker (in the front's network namespace)."""
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


class _Held(logging.Handler):
    """Keeps what is logged before logging is set up: `agent.log.setup()` imports the
    journal's module, which is not worth its time on the way to StartUnit."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def begin(argv: Sequence[str]) -> Early:
    """Decide the worker's start and ask for it, if this front may do so at once."""
    began = time.perf_counter()
    early = Early()
    if len(argv) != 1:
        return early
    held = _Held()
    root = logging.getLogger()
    own = [logging.getLogger(name) for name in ("providerd", "agent")]  # as agent.log's
    levels = [logger.level for logger in own]
    root.addHandler(held)
    for logger in own:
        logger.setLevel(logging.INFO)
    log = logging.getLogger(f"providerd.{argv[0]}")
    try:
        _begin(argv[0], early, began, log)
    except Exception as e:  # a bug: the front's own start does it all, and says what failed
        early.start = None
        log.error("Failed to ask for the worker's start first: %r", e, exc_info=e)
    finally:
        root.removeHandler(held)
        for logger, level in zip(own, levels, strict=True):
            logger.setLevel(level)
        early.records = held.records
    return early


def _begin(slug: str, early: Early, began: float, log: logging.Logger) -> None:
    from agent.spec import apikeys, paths
    from agent.spec.manifest import ManifestError
    from agent.systemd.manifests import load

    try:
        provider = early.provider = load(slug)
    except ManifestError:
        return  # the front's own start loads it again and logs every problem
    loaded = time.perf_counter()
    if provider.starts_with_front:
        return  # systemd started the worker beside the front
    if apikeys.keys_on() or os.path.lexists(paths.backoff_file(slug)):
        return  # a request whose key may start it decides; the saved backoff may refuse
    from agent.systemd.names import worker_unit
    from agent.systemd.units import worker_host

    port = provider.known_worker_port or free_port()
    host = worker_host(provider)
    gpu_env: dict[str, str] = {}
    devices: list[tuple[str, str]] | None = None
    admitted = None
    if provider.uses_gpu:
        admitted = _admit(provider, early, log)
        if admitted is None:
            return
    decided = time.perf_counter()
    try:
        if admitted is not None:
            from agent.gpu.placement import device_allow, worker_env

            gpu_env, devices = worker_env(admitted.placement), device_allow(admitted.placement)
        env = worker_environment(port, host, gpu_env)
        from agent.atomic import write_atomic
        from agent.systemd.quoting import environment_file

        write_atomic(paths.worker_env_file(slug), environment_file(env))
        decided = time.perf_counter()
        job, set_devices = _start(worker_unit(slug), devices)
    except _Unanswered as e:
        # PID 1 may have taken the start: the front's own start keeps this decision (the
        # port, the card and its reservation), so its StartUnit joins the same job.
        log.info("Asked for the worker's start first, with no answer (%s); following it", e)
        early.start = Started("", port, env, devices, admitted)
        return
    except Exception as e:
        if admitted is not None:
            admitted.release()
        log.info("Failed to ask for the worker's start first: %s; asking again", e)
        return
    done = time.perf_counter()
    parts = ((loaded - began) * 1000, (decided - loaded) * 1000, (done - decided) * 1000)
    took = (done - began) * 1000
    early.start = Started(job, port, env, devices, admitted, took, parts, set_devices)
    log.info("Asked for the worker's start first, %s", early.start.describe())


def _admit(provider: Provider, early: Early, log: logging.Logger) -> Any:
    """GPU admission at once, or None (and a line why not)."""
    from agent.gpu.footprint import Footprints
    from agent.gpu.nvml import NvmlUnavailable, open_nvml
    from agent.gpu.quick import admit_now

    early.headroom_bytes, problems = gpu_headroom()
    early.gpu_read = True
    for problem in problems:
        log.warning("%s", problem)
    try:
        early.nvml = open_nvml()
        admitted = admit_now(
            provider, early.nvml, Footprints(), headroom_bytes=early.headroom_bytes
        )
    except NvmlUnavailable:
        return None  # the front's own admission reports it
    if admitted is None:
        why = "waits for another front's admission or must make room on the GPU"
        log.info("Not asking for the worker's start first: admission %s", why)
    return admitted


def _start(unit: str, devices: list[tuple[str, str]] | None) -> tuple[str, bool]:
    """`DeviceAllow=` set when it must change, then StartUnit: the job's path, and whether
    the device rules were set."""
    from agent.systemd.syncbus import (
        PROPERTIES,
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
            (job,) = bus.call(SD, SD_PATH, SD + ".Manager", "StartUnit", "ss", (unit, "replace"))
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
