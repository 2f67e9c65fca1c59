"""The metrics service: every provider in Prometheus' text format, waking none of them.

There is no long-running daemon to scrape: an idle provider runs no process. So
`providerd-metrics.socket` holds the scrape address and PID 1 starts this service
on the first scrape (`python3 -m agent.metrics`); it answers `GET /metrics` and
exits once `--idle-timeout` seconds pass without a scrape. Each scrape reads:

- the manifests, so every provider appears, idle ones included;
- each running front over its control socket (`{"op": "status"}`: state, requests
  in flight and waiting, VRAM, the worker's memory, and the counters). A control
  socket exists only while a front runs, and `status` never starts anything;
- for a provider whose front is not running, the counters its last front left in
  `/var/lib/providerd/counters/SLUG.json` (`agent.net.counters`), so counters carry on
  across idle releases instead of going back to zero;
- the router's counters, which it saves within 5 s of a request and when it exits
  (`/var/lib/providerd/router-counters.json`).

`--listen HOST:PORT` binds the address itself (foreground use, tests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.net import counters, rpc
from agent.net.bind import BindError, listen_on
from agent.spec import paths
from agent.spec.toml_strict import Invalid
from agent.spec.values import parse_address

log = logging.getLogger("providerd.metrics")

STATES = ("inactive", "idle", "starting", "ready", "stopping", "backoff")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_HEAD = 8192
HEAD_TIMEOUT_S = 10.0
STATUS_TIMEOUT_S = 2.0
DEFAULT_IDLE_S = 300.0


@dataclass
class Sample:
    """What one scrape knows of one provider."""

    slug: str
    state: str = "inactive"
    in_flight: int = 0
    waiting: int = 0
    vram_reserved: int = 0
    vram_used: int = 0
    memory: int = 0
    counters: dict[str, Any] = field(default_factory=lambda: counters.Counters().to_json())


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def sample_from_status(slug: str, status: Mapping[str, Any]) -> Sample:
    """A running front's status object → `Sample`."""
    gpu = status.get("gpu") or {}
    memory = status.get("memory") or {}
    state = str(status.get("state", "idle"))
    raw = status.get("counters")
    kept = counters.Counters.from_json(raw if isinstance(raw, dict) else {}).to_json()
    return Sample(
        slug,
        state if state in STATES else "idle",
        _int(status.get("in_flight")),
        _int(status.get("waiting")),
        _int(gpu.get("need_bytes")),
        _int(gpu.get("used_bytes")),
        _int(memory.get("current")),
        kept,
    )


async def gather(slugs: Iterable[str], runtime_dir: Path | None = None) -> list[Sample]:
    """One `Sample` per provider: from its front if one runs, else from its counters file."""
    root = runtime_dir if runtime_dir is not None else paths.runtime_dir()
    running = {p.parent.name for p in root.glob("*/control.sock")}
    names = sorted(set(slugs) | running)

    async def one(slug: str) -> Sample:
        if slug in running:
            try:
                st = await rpc.acall(
                    root / slug / "control.sock", {"op": "status"}, STATUS_TIMEOUT_S
                )
                return sample_from_status(slug, st)
            except (rpc.RpcError, ValueError, OSError) as e:
                log.debug("No status from %s: %s; using its saved counters", slug, e)
        saved = counters.read(slug)
        return Sample(slug, counters=saved) if saved is not None else Sample(slug)

    return list(await asyncio.gather(*(one(s) for s in names)))


# Per-provider gauges (name, help, the sample's value) and counters (name, help, the
# key in the saved counters), in the order a scrape lists them.
GAUGES: list[tuple[str, str, Callable[[Sample], float]]] = [
    ("providerd_requests_in_flight", "Requests being served", lambda s: s.in_flight),
    ("providerd_requests_waiting", "Requests held while the worker starts", lambda s: s.waiting),
    (
        "providerd_vram_reserved_bytes",
        "GPU memory admission reserved per card",
        lambda s: s.vram_reserved,
    ),
    ("providerd_vram_used_bytes", "GPU memory the worker's processes use", lambda s: s.vram_used),
    ("providerd_worker_memory_bytes", "The worker's memory (its cgroup's)", lambda s: s.memory),
]
COUNTERS = [
    ("providerd_requests_served", "Requests answered by the worker", "served"),
    ("providerd_cold_starts", "Worker starts that became ready", "cold_starts"),
    ("providerd_start_failures", "Worker starts that failed", "start_failures"),
    ("providerd_idle_releases", "Workers released after idle_timeout_s", "idle_releases"),
    (
        "providerd_gpu_retirements",
        "Times the worker was retired for another provider",
        "gpu_retirements",
    ),
]


def render(samples: list[Sample], router: counters.RouterCounters | None = None) -> bytes:
    """The Prometheus text exposition of `samples` and the router's counters
    (prometheus_client's own writer)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    def families() -> list[Any]:
        p = ["provider"]
        state = GaugeMetricFamily(
            "providerd_provider_state", "1 for the provider's current state, else 0",
            labels=["provider", "state"],
        )  # fmt: skip
        gauges = [(GaugeMetricFamily(name, text, labels=p), get) for name, text, get in GAUGES]
        plain = [(CounterMetricFamily(name, text, labels=p), key) for name, text, key in COUNTERS]
        c_refused = CounterMetricFamily(
            "providerd_requests_refused", "Requests refused, by cause", labels=["provider", "cause"]
        )
        h_start = HistogramMetricFamily(
            "providerd_cold_start_duration_seconds", "How long cold starts took", labels=p
        )
        for s in samples:
            for name in STATES:
                state.add_metric([s.slug, name], 1.0 if s.state == name else 0.0)
            for family, get in gauges:
                family.add_metric([s.slug], get(s))
            c = s.counters
            for counter, key in plain:
                counter.add_metric([s.slug], c[key])
            for cause, n in sorted(c["refused"].items()):
                c_refused.add_metric([s.slug, cause], n)
            hist = c["start_seconds"]
            buckets = [(str(float(bound)), n) for bound, n in hist["buckets"]]
            buckets.append(("+Inf", hist["count"]))
            h_start.add_metric([s.slug], buckets, sum_value=hist["sum"])
        c_router = CounterMetricFamily(
            "providerd_router_requests",
            "Requests the router answered, by provider, declared model name and status",
            labels=["provider", "model", "code"],
        )
        for (slug, model, status), n in sorted(
            (router or counters.RouterCounters()).requests.items()
        ):
            c_router.add_metric([slug, model, str(status)], n)
        return [
            state, *(f for f, _ in gauges), *(f for f, _ in plain), c_refused, h_start, c_router,
        ]  # fmt: skip

    class Collector:
        def collect(self) -> list[Any]:
            return families()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())  # type: ignore[arg-type]
    data: bytes = generate_latest(registry)
    return data


async def scrape() -> bytes:
    """Everything, as one `GET /metrics` answers it."""
    from agent.systemd.manifests import discover

    try:
        slugs = list(discover().providers)
    except Exception as e:  # a scrape reports what it can; a bad manifest is `check`'s job
        log.warning("Failed to read the manifests: %s; listing running providers only", e)
        slugs = []
    return render(await gather(slugs), counters.load_router())


# ---------------------------------------------------------------------------- the server


def _response(status: str, body: bytes, content_type: str, head_only: bool = False) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head if head_only else head + body


async def answer(head: bytes) -> bytes:
    """The response to one request head (`GET /metrics`; anything else is refused)."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return _response("400 Bad Request", b"Bad request\n", "text/plain")
    method, target = parts[0], parts[1].split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        return _response("405 Method Not Allowed", b"Only GET and HEAD\n", "text/plain")
    if target != "/metrics":
        return _response("404 Not Found", b"Metrics are at /metrics\n", "text/plain")
    return _response("200 OK", await scrape(), CONTENT_TYPE, head_only=method == "HEAD")


class MetricsServer:
    """Serves scrapes on `listeners`; `done` is set `idle_s` after the last one."""

    def __init__(self, listeners: list[socket.socket], idle_s: float) -> None:
        self.listeners = listeners
        self.idle_s = idle_s
        self.done = asyncio.Event()
        self.servers: list[asyncio.AbstractServer] = []
        self.active = 0
        self.scrapes = 0
        self._timer: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        for sock in self.listeners:
            self.servers.append(await asyncio.start_server(self._client, sock=sock))
        self._arm()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self.idle_s, self._idle)

    def _idle(self) -> None:
        if self.active:
            self._arm()
            return
        log.info("No scrape for %g s, exiting", self.idle_s)
        self.done.set()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.active += 1
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                return
            except ConnectionError:
                return
            if len(head) > MAX_HEAD:
                data = _response(
                    "431 Request Header Fields Too Large", b"Too large\n", "text/plain"
                )
            else:
                data = await answer(head)
                self.scrapes += 1
            writer.write(data)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        except Exception as e:  # one scrape's failure never ends the service
            log.error("Failed to answer a scrape: %s", e, exc_info=e)
        finally:
            self.active -= 1
            self._arm()
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for server in self.servers:
            server.close()


def bind(address: str) -> socket.socket:
    """`--listen HOST:PORT` (an address as a manifest writes it). Raises Invalid or
    BindError."""
    return listen_on(parse_address(address), backlog=64)


async def run(listeners: list[socket.socket], idle_s: float, systemd: bool) -> int:
    from agent.systemd.notify import notify

    server = MetricsServer(listeners, idle_s)
    await server.start()
    if systemd:
        notify("READY=1\nSTATUS=Serving scrapes")
    began = time.monotonic()
    await server.done.wait()
    if systemd:
        notify(f"STOPPING=1\nSTATUS=No scrape for {idle_s:g} s")
    await server.close()
    log.info("Served %d scrape(s) in %.0f s", server.scrapes, time.monotonic() - began)
    return 0


def main(argv: list[str]) -> int:
    from agent.log import setup
    from agent.net import loop

    p = argparse.ArgumentParser(prog="python3 -m agent.metrics")
    p.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_S, metavar="S")
    p.add_argument("--listen", metavar="HOST:PORT", help="bind this address (no systemd)")
    args = p.parse_args(argv)
    if args.idle_timeout <= 0:
        p.error("--idle-timeout must be positive")
    setup(journal=args.listen is None)
    if args.listen:
        try:
            listeners = [bind(args.listen)]
        except (Invalid, BindError) as e:
            print(
                f"providerd-metrics: cannot listen on {args.listen}: {e.message}", file=sys.stderr
            )
            return 1
    else:
        from agent.systemd.activation import inherited_listeners
        from agent.systemd.names import METRICS_SOCKET

        listeners = inherited_listeners(METRICS_SOCKET)
    with contextlib.suppress(KeyboardInterrupt):
        return loop.run(run(listeners, args.idle_timeout, systemd=args.listen is None))
    return 0
