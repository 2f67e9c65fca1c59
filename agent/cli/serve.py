"""`providerctl serve`: the whole agent in the foreground, without systemd.

The same `Front` as under systemd; the differences are where the sockets come from
(bound here), where the worker runs (a child process, not a unit) and what idle means
(the worker stops, the port stays open). No cgroup limits: they are listed at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys

from agent import signals
from agent.front.front import Front, admission_for
from agent.net import rpc
from agent.net.bind import BindError, listen_on
from agent.router.router import Router, RouterError, close_foreground, foreground
from agent.spec import apikeys, paths
from agent.spec.apikeys import KeySet
from agent.spec.provider import Address, Provider
from agent.systemd import preload
from agent.systemd.units import worker_argv
from agent.worker.control import ProcessWorker

log = logging.getLogger("providerd")


def bind(address: Address) -> socket.socket:
    """A listening socket for one manifest address. Raises BindError."""
    return listen_on(address)


def unenforced(provider: Provider) -> list[str]:
    """What the manifest asks for that only systemd can enforce."""
    out = []
    for name, value in (
        ("limits.memory_max", provider.memory_max),
        ("limits.memory_high", provider.memory_high),
        ("limits.cpu_quota", provider.cpu_quota),
        ("limits.tasks_max", provider.tasks_max),
    ):
        if value is not None:
            out.append(name)
    if provider.allow:
        out.append("listen.allow")
    if provider.weight_paths:
        out.append("weights.paths (not bound read-only)")
    if provider.network == "private":
        out.append('isolation.network = "private" (the worker shares the host network)')
    if provider.uses_gpu:
        out.append("GPU device rules (CUDA_VISIBLE_DEVICES is still set)")
    return out


def make_front(
    provider: Provider, listeners: list[socket.socket], keys: KeySet | None = None
) -> Front:
    flog = logging.getLogger(f"providerd.{provider.slug}")
    worker = ProcessWorker(
        provider.slug,
        worker_argv(provider, sys.executable),
        environment=dict(provider.environment),
        working_directory=provider.working_directory,
        start_timeout_s=provider.start_timeout_s,
        stop_timeout_s=provider.stop_timeout_s,
        log=lambda line: flog.info("worker: %s", line),
        credentials=provider.credentials,
    )
    return Front(
        provider,
        worker,
        listeners,
        exit_on_idle=False,
        log=flog,
        admission=admission_for(provider, worker),
        keys=keys,
    )


async def serve(providers: list[Provider]) -> int:
    listeners: dict[str, list[socket.socket]] = {}
    router: Router | None = None
    keys = apikeys.load()  # the keys file itself: no systemd credential here
    apikeys.report(keys, log)
    try:
        for provider in providers:
            listeners[provider.slug] = [bind(a) for a in provider.addresses]
        router = foreground(providers, bind, keys)  # when providerd.toml enables it
    except (BindError, RouterError) as e:
        for socks in listeners.values():
            for s in socks:
                s.close()
        log.error("%s", e)
        return 1

    fronts = [make_front(p, listeners[p.slug], keys) for p in providers]
    servers = []
    for front in fronts:
        p = front.provider
        servers.append(await rpc.serve(paths.control_socket(p.slug), front.handle))
        front.start_accepting()
        where = ", ".join(str(a) for a in p.addresses)
        log.info(
            "Serving %s on %s (%s), idle timeout %g s", p.slug, where, p.protocol, p.idle_timeout_s
        )
        if missing := unenforced(p):
            log.warning("%s: not enforced without systemd: %s", p.slug, ", ".join(missing))
        if p.preload:
            front.warm(preload.CAUSE)  # this start is the foreground's boot

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    with signals.handling(loop, {signal.SIGINT: stop.set, signal.SIGTERM: stop.set}):
        await stop.wait()
        await _stop(fronts, servers, router)
    log.info("Stopped")
    return 0


async def _stop(
    fronts: list[Front], servers: list[asyncio.AbstractServer], router: Router | None
) -> None:
    """Stop every provider (a second Ctrl-C while this runs changes nothing)."""
    log.info("Stopping %d provider(s)", len(fronts))
    if router is not None:
        await close_foreground(router)
    for server in servers:
        server.close()
    await asyncio.gather(*(f.stop(f.provider.stop_timeout_s) for f in fronts))
    for front in fronts:
        front.stop_accepting()
        with contextlib.suppress(FileNotFoundError):
            paths.control_socket(front.provider.slug).unlink()
        for address in front.provider.addresses:
            if address.path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(address.path)
