"""One endpoint for many models: each request goes to the provider whose manifest names
the model its JSON body asks for.

Per request on a client connection: read the head, then the whole body (at most
`[router] max_body` bytes, else 413; `Expect: 100-continue` is answered here, since the
body must be read to route), parse the body as JSON and take its top-level `model`
(400 if there is none), look it up (`Table`: exact names first, then patterns, full
match; 404 if nobody serves it), and send the head and body exactly as received — a
chunked body stays chunked — to the provider's own first listen address. That socket
activates the provider's front as usual, which holds the request while the worker
starts and makes room on the GPU. The response is relayed as the provider produces it
(server-sent events pass through unbuffered); a `100 Continue` from the provider is
dropped when the router already sent one.

`GET /v1/models` lists every exact name (OpenAI's list format) without touching any
provider; patterns are not listed (they describe names, they are not names).
`GET /v1/models/<name>` describes one name, patterns included.

The requested name is only ever a dictionary key or a regular expression's subject:
it reaches log lines and messages through `quoted()` (JSON-escaped, cut short), never a
command line or a path.

Under systemd (`python3 -m agent.router`, socket-activated by providerd-router.socket)
the router reads the manifests at start (and on SIGHUP), exits after `idle_timeout_s`
without requests, and holds no model and no GPU. `providerctl serve` runs the same
`Router` in the foreground when `[router] enabled = true`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
from collections.abc import Callable

from agent.errors import ProviderdError
from agent.net import counters
from agent.net.client import ClientConn
from agent.net.listeners import HttpListeners
from agent.net.origin import OriginCheck
from agent.net.ratelog import RateLog
from agent.router.site import RouterSite
from agent.router.table import (
    MODELS_PATH,
    Refusal,
    Table,
    dechunk,
    model_of,
    nested_repetition,
    quoted,
    table_from,
    target_address,
)
from agent.signals import handling
from agent.spec import apikeys
from agent.spec.apikeys import KeySet
from agent.spec.provider import Address, Provider
from agent.spec.settings import RouterConfig

__all__ = [
    "MODELS_PATH",
    "Refusal",
    "Router",
    "RouterError",
    "Table",
    "dechunk",
    "model_of",
    "nested_repetition",
    "quoted",
    "target_address",
]

log = logging.getLogger("providerd.router")
refusals = RateLog(log)  # what the router answers by itself

FIRST_REQUEST_GRACE_S = 5.0  # a new connection counts as busy until its first request, this long
STOP_GRACE_S = 30.0  # on SIGTERM, requests in flight get this long to finish

Notify = Callable[[str], object]


# ============================================================================ the router


class Router:
    """Accepts on its listeners and routes every request; counts what is in flight.

    `exit_on_idle` (systemd): after `idle_timeout_s` with no request in flight, close the
    listeners (our copies: PID 1 keeps the socket), say STOPPING=1 and set `done`.
    Foreground: the listeners stay open until `close()`.
    """

    def __init__(
        self,
        table: Table,
        config: RouterConfig,
        listeners: list[socket.socket],
        *,
        exit_on_idle: bool,
        notify: Notify = lambda _s: None,
        systemd: bool = False,
        keys: KeySet | None = None,
    ) -> None:
        self.table = table
        self.config = config
        self.listeners = listeners
        self.exit_on_idle = exit_on_idle
        self.notify = notify
        self.systemd = systemd
        self.busy = 0  # requests in flight, plus new connections within their grace
        self.done = asyncio.Event()
        self.origin = OriginCheck(config.addresses)
        self.in_flight = 0  # requests in flight
        self.keys = keys  # API keys (None: off)
        self.site = RouterSite(self, self.note)  # its gate checks the keys: 401 on the head
        # Each new connection counts as busy until its first request, FIRST_REQUEST_GRACE_S
        # at most: counted in the accept callback itself, an idle exit decided in this same
        # turn of the loop sees it.
        self.listening = HttpListeners(
            listeners, self.site, self.site.style(), log, FIRST_REQUEST_GRACE_S, self._busy
        )
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_since = 0.0  # loop time when busy last came down to 0
        # Asked for once: asyncio.get_running_loop() costs a getpid() system call each time.
        self.loop = asyncio.get_running_loop()
        self._quiet: asyncio.Event | None = None  # set when no request is in flight (stop)
        self._dns: asyncio.Task[None] | None = None
        # Where the last router left off. The site counts each answered request in it
        # (`providerd_router_requests_total`): in the live file at once, saved within
        # ROUTER_FLUSH_S while accepting (`_flush_due`) and at the end.
        self.counters = counters.load_router(log)
        self._flush_timer: asyncio.TimerHandle | None = None

    def flush(self) -> None:
        """Save the counters if they changed (a failure is logged: tried again later)."""
        counters.save_router(self.counters, log)

    def _flush_due(self) -> None:
        """Every ROUTER_FLUSH_S while accepting: no timer made or moved per request. The
        next is armed first, so that a save that raises does not end the saves."""
        self._flush_timer = self.loop.call_later(counters.ROUTER_FLUSH_S, self._flush_due)
        self.flush()

    def _stop_flushing(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self.flush()

    def note(self, status: int, what: str, message: str) -> None:
        """A refusal, logged at info level, rate-limited per status."""
        refusals.log(str(status), "Refused %s: %d %s", what, status, message, level=logging.INFO)

    # -- accepting

    def start_accepting(self) -> None:
        """Accept from now on (and exit once idle, under systemd)."""
        self.listening.start()
        if self._flush_timer is None:
            self._flush_timer = self.loop.call_later(counters.ROUTER_FLUSH_S, self._flush_due)
        self._idle_since = self.loop.time()
        if self._idle_timer is None and self.busy == 0:
            self._arm_idle()
        if self._dns is None:  # the host's DNS name, for the Host check: looked up aside
            self._dns = asyncio.get_running_loop().create_task(self.origin.learn_dns_name())

    def stop_accepting(self) -> None:
        self.listening.stop()

    # -- what is in flight

    def begin(self, conn: ClientConn) -> None:
        """A request head arrived on `conn`."""
        self.in_flight += 1
        self.busy += 1  # _busy(+1): nothing to do on the way up
        if self.busy > self.in_flight:  # some connection is fresh, within its grace: `conn`?
            self.listening.first_request(conn)  # its grace, if fresh, becomes this request

    def end(self) -> None:
        """A request that `begin` counted is over."""
        self.in_flight -= 1
        if self.in_flight == 0 and self._quiet is not None:
            self._quiet.set()
        self._busy(-1)

    def _busy(self, delta: int) -> None:
        """The idle timer moves lazily: when busy comes back to 0 it notes the time, and
        a timer armed earlier re-arms itself for the rest when it fires (no timer made or
        cancelled per request)."""
        self.busy += delta
        if self.busy == 0:
            self._idle_since = self.loop.time()
            if self._idle_timer is None:
                self._arm_idle()

    def _arm_idle(self) -> None:
        if not self.exit_on_idle or not self.listening.accepting:
            return
        due = self._idle_since + self.config.idle_timeout_s
        self._idle_timer = self.loop.call_at(due, self._idle)

    def _idle(self) -> None:
        self._idle_timer = None
        if self.busy:
            return  # armed again when nothing is in flight
        if self.loop.time() < self._idle_since + self.config.idle_timeout_s:
            self._arm_idle()
            return
        self.release(f"Idle for {self.config.idle_timeout_s:g} s, exiting")

    # -- the end

    def release(self, reason: str) -> None:
        """Stop for good: stop accepting, say STOPPING, end idle connections, set `done`."""
        if self.done.is_set():
            return
        log.info("%s", reason)
        self.stop_accepting()
        if self._dns is not None:
            self._dns.cancel()
        self.notify(f"STOPPING=1\nSTATUS={reason}")
        self.listening.abort_all()
        self.site.close()
        self._stop_flushing()
        self.done.set()

    async def stop(self, grace_s: float) -> None:
        """SIGTERM: stop accepting, let requests in flight finish within `grace_s`, release."""
        self.stop_accepting()
        if self.in_flight:
            self._quiet = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace_s):
                    await self._quiet.wait()
        self.release("Stopping on request")

    async def close(self) -> None:
        """Foreground: stop accepting, end every connection, wait for them."""
        self.stop_accepting()
        if self._dns is not None:
            self._dns.cancel()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self.listening.abort_all()
        await self.listening.wait_closed(5.0)
        self.site.close()
        self._stop_flushing()
        self.done.set()


# ============================================================================ starting it


def discover_table() -> Table:
    """The table from the manifest directories; invalid manifests are logged and left out."""
    from agent.systemd.manifests import discover

    found = discover()
    for problem in found.problems:
        log.warning("Skipping a manifest: %s", problem)
    table = table_from(found.providers.values())
    for why in table.skipped:
        log.warning("Skipping a model pattern: %s; write it without nested repetition", why)
    log.info(
        "Routing %d model name(s) and %d pattern(s) to %d provider(s)",
        len(table.names),
        len(table.patterns),
        len({p.slug for p in table.names.values()} | {p.slug for _, p in table.patterns}),
    )
    return table


class RouterError(ProviderdError):
    """The router cannot start; the message says why."""

    code = "router_settings"


def foreground(
    providers: list[Provider],
    bind: Callable[[Address], socket.socket],
    keys: KeySet | None = None,
) -> Router | None:
    """`providerctl serve`: the router over `providers` when the settings enable it, bound
    and accepting; None when they do not. Raises RouterError (bad settings) or what `bind`
    raises."""
    from agent.spec.settings import ConfigError, load

    try:
        config = load()
    except ConfigError as e:
        raise RouterError("\n".join(f"Failed to load settings: {p}" for p in e.problems)) from None
    if not config.router.enabled:
        return None
    listeners: list[socket.socket] = []
    try:
        for address in config.router.addresses:
            listeners.append(bind(address))
    except BaseException:
        for sock in listeners:
            sock.close()
        raise
    router = Router(table_from(providers), config.router, listeners, exit_on_idle=False, keys=keys)
    router.start_accepting()
    where = ", ".join(str(a) for a in config.router.addresses)
    log.info("Routing requests by model on %s (%d model name(s))", where, len(router.table.names))
    return router


async def close_foreground(router: Router) -> None:
    """Stop the foreground router and remove its unix sockets."""
    await router.close()
    for address in router.config.addresses:
        if address.path is not None:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(os.lstat(address.path).st_mode):
                    os.unlink(address.path)


async def run_systemd() -> int:
    """The router as providerd-router.service runs it."""
    from agent.spec.settings import ConfigError, load
    from agent.systemd.activation import inherited_listeners
    from agent.systemd.names import ROUTER_SOCKET
    from agent.systemd.notify import notify

    try:
        config = load()
    except ConfigError as e:
        for problem in e.problems:
            log.error("Failed to load settings: %s", problem)
        return 1
    table = discover_table()
    keys = apikeys.load()  # the credential providerd-keys, while the keys file exists
    apikeys.report(keys, log)
    router = Router(
        table,
        config.router,
        inherited_listeners(ROUTER_SOCKET),
        exit_on_idle=True,
        notify=notify,
        systemd=True,
        keys=keys,
    )
    router.start_accepting()
    notify("READY=1\nSTATUS=Routing requests by model")
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    def stop() -> None:
        if not stopping:
            stopping.append(loop.create_task(router.stop(STOP_GRACE_S)))

    def reload() -> None:
        router.table = discover_table()

    with handling(loop, {signal.SIGTERM: stop, signal.SIGHUP: reload}):
        await router.done.wait()
        # Connections were ended: let them close before the loop goes.
        await asyncio.sleep(0)
    return 0


def main(argv: list[str]) -> int:
    from agent.log import setup
    from agent.net import loop

    if argv:
        print("usage: python3 -m agent.router", flush=True)
        return 2
    setup(journal=True)
    with contextlib.suppress(KeyboardInterrupt):
        return loop.run(run_systemd())
    return 0
