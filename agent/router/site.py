"""The router's site on the connection core: the model lookup.

Per request: the gate (upgrades 501; what a web page could send, 403/415; a declared body
over `max_body`, 413; with API keys on, the key, 401; then any hook added), the whole
body read here (growing with what arrives, bounded by `max_body`; `Expect: 100-continue`
answered here, since the body must be read to route), its `model` looked up and the scope
of the key the gate found checked (403), and the request sent as received to the
provider's own first listen address on a kept connection or a new one. A `100 Continue`
from the provider is dropped when the router already sent one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol
from urllib.parse import unquote

from agent.net import auth, exchange
from agent.net.answers import Answer, Style
from agent.net.client import ClientConn
from agent.net.contract import Exchange, Target
from agent.net.counters import RouterCounters
from agent.net.http import HttpError, RequestHead, ResponseHead
from agent.net.origin import OriginCheck
from agent.net.site import Gate, shown
from agent.net.upconn import UpstreamConn
from agent.net.upstream import Upstream, connect_retrying
from agent.router.table import (
    MODELS_PATH,
    Refusal,
    Table,
    dechunk,
    model_of,
    quoted,
    target_address,
)
from agent.spec.apikeys import ApiKey, KeySet
from agent.spec.provider import Provider
from agent.spec.settings import RouterConfig
from agent.systemd.names import socket_unit


class Routing(Protocol):
    """What the site asks of the router (agent.router.router.Router)."""

    table: Table
    config: RouterConfig
    origin: OriginCheck
    systemd: bool
    keys: KeySet | None  # API keys; None: off
    counters: RouterCounters  # what the router answered, by provider, model and status

    def begin(self, conn: ClientConn) -> None: ...
    def end(self) -> None: ...


log = logging.getLogger("providerd.router")
KEPT_PER_PROVIDER = 256  # idle connections kept to one provider's front
ROUTES_MAX = 4096  # model names whose route is remembered


class _Lease:
    """A request in flight, with the API key the gate let it through with (None: keys off),
    so that its scope is checked against the key found once, by the gate."""

    __slots__ = ("key", "router")

    def __init__(self, router: Routing, key: ApiKey | None) -> None:
        self.router: Routing | None = router
        self.key = key

    def release(self) -> None:
        router = self.router
        if router is not None:
            self.router = None
            router.end()


class _Route:
    """Where the requests for one model name go, and what they are counted under."""

    __slots__ = ("label", "slug", "target")

    def __init__(self, provider: Provider, exact: str, generation: int) -> None:
        self.slug = provider.slug
        self.label = (provider.slug, exact)  # exact: the name if the table spells it, or ""
        # The table's generation: connections are kept and reused within it only.
        self.target: Target = (target_address(provider.addresses[0]), generation)


class RouterSite:
    peer = "provider"
    collects = True
    request_timeout_s = 0.0  # the providers' fronts time their own workers

    def __init__(self, router: Routing, note: Callable[[int, str, str], None]) -> None:
        self.router = router
        self.note_refusal = note
        self.check_origin = router.origin.check  # 403, 415
        # The router's settings, fixed for its life.
        self.max_body = router.config.max_body  # 413 beyond it
        self.log_requests = router.config.log_requests
        self.request_gate: Gate | None = None  # a further check, after the API key's
        self.pools: dict[str, Upstream] = {}  # kept connections, per provider
        self.routes: dict[str, _Route] = {}  # model name -> where it goes, for `routes_of`
        self.routes_of: Table | None = None
        # Bumped with each table: a connection is kept and reused only within the table its
        # route was taken under (one in flight across a reload may lead to an old address).
        self.table_generation = 0
        # The key the gate just let through: taken by the lease made at once after the
        # gate, in the same callback (agent.net.exchange.Exchange.begin).
        self.passed: ApiKey | None = None

    def style(self) -> Style:
        return Style(openai=True, log=self.note)

    def note(self, a: Answer, what: str) -> None:
        self.note_refusal(a.status, what or "a request", a.message)

    def exchange(self, conn: ClientConn, req: RequestHead, head_end: int) -> None:
        try:
            ex = exchange.Exchange(conn, self, req, head_end)
        except HttpError as e:
            conn.answer(Answer(e.status, e.reason, "invalid_request"), close=True)
            return
        conn.ex = ex
        conn.to_exchange()
        ex.begin()

    def gate(self, req: RequestHead) -> Answer | None:
        self.passed = None  # whatever this gate answers, no earlier request's key rides on
        if req.upgrade:
            return Answer(
                501,
                "The router does not forward CONNECT or protocol upgrades; "
                "use the provider's own address",
                "not_implemented",
                close=True,
            )
        refused = self.check_origin(req)
        if refused is not None:
            status, message, code = refused
            return Answer(status, message, code, close=True)
        if req.body == "length" and req.length > self.max_body:
            return self.too_large()
        keys = self.router.keys
        if keys is not None:  # 401 on the head alone
            key = auth.authenticate(keys, req)
            if isinstance(key, auth.Refusal):
                return key.answer()
            self.passed = key
        if self.request_gate is not None:
            return self.request_gate(req)
        return None

    def too_large(self) -> Answer:
        limit = self.max_body
        return Answer(
            413,
            f"The request body is larger than the router's limit of {limit} bytes "
            "([router] max_body in providerd.toml)",
            "request_too_large",
            close=True,
        )

    def lease(self, ex: Exchange) -> _Lease:
        key, self.passed = self.passed, None
        self.router.begin(ex.conn)
        return _Lease(self.router, key)

    def collecting(self, ex: Exchange) -> None:
        ex.send_continue()

    def refusal(self, e: Exception) -> Answer | None:
        if isinstance(e, Refusal):
            return Answer(e.status, e.message, e.code, kind=e.kind)
        log.debug("Failed to route a request: %s", e, exc_info=e)
        return None

    def target_now(self, ex: Exchange) -> Target | None:
        """The provider the body names (raises Refusal), or None: answered here."""
        req = ex.req
        if req.method in ("GET", "HEAD"):
            path = req.path
            if path == MODELS_PATH or path.startswith(MODELS_PATH + "/"):
                self.local(ex, path)
                return None
        data, start = ex.data, ex.head_len
        body = dechunk(data, start, len(data)) if req.body == "chunked" else data[start:]
        model = model_of(body)
        route = self.route(model)
        ex.label = route.label
        if self.router.keys is not None:
            key = self.key(ex)  # Refusal(401) if the gate found none
            if key is not None:
                self.in_scope(key, route.slug)
        if self.log_requests:
            log.info(
                "Routing %s %s for model %s to %s",
                req.method,
                quoted(req.target),
                quoted(model),
                route.slug,
            )
        return route.target

    def route(self, model: str) -> _Route:
        """Where `model` goes (raises Refusal: 404, 409), remembered per name while the
        table stays the same."""
        table = self.router.table
        if self.routes_of is not table:
            self.routes_of, self.routes = table, {}
            self.table_generation += 1
            self.close()  # a kept connection may lead where a provider no longer listens
        route = self.routes.get(model)
        if route is None:
            provider = table.lookup(model)
            route = _Route(provider, model if model in table.names else "", self.table_generation)
            self.pool(provider.slug)  # from here on, `kept` and `release_slot` find it
            if len(self.routes) >= ROUTES_MAX:
                self.routes.clear()
            self.routes[model] = route
        return route

    def local(self, ex: Exchange, path: str) -> None:
        """`GET /v1/models` and `GET /v1/models/<name>`."""
        table = self.router.table
        if path in (MODELS_PATH, MODELS_PATH + "/"):
            key = self.key(ex)
            ex.reply(200, table.listing(None if key is None else key.reaches))
            return
        name = unquote(path[len(MODELS_PATH) + 1 :])
        provider = table.lookup(name)  # Refusal: 404, 409
        key = self.key(ex)
        if key is not None:
            self.in_scope(key, provider.slug)
        ex.reply(200, table.entry(name, provider))

    def key(self, ex: Exchange) -> ApiKey | None:
        """The API key the gate let the request through with, or None with keys off."""
        if self.router.keys is None:
            return None
        lease = ex.lease
        key = lease.key if isinstance(lease, _Lease) else None
        if key is None:  # never: the gate let it through with its key; fail closed all the same
            raise Refusal(401, auth.MISSING.message, auth.MISSING.code)
        return key

    def in_scope(self, key: ApiKey, slug: str) -> None:
        """Raises Refusal(403) when `key` does not reach provider `slug`."""
        refused = auth.authorize(key, slug)
        if refused is not None:
            raise Refusal(refused.status, refused.message, refused.code)

    async def target(self, ex: Exchange) -> Target:
        raise AssertionError("the router's target is known at once")

    def pool(self, slug: str) -> Upstream:
        pool = self.pools.get(slug)
        if pool is None:
            pool = self.pools[slug] = Upstream(KEPT_PER_PROVIDER, 1 << 30)
        return pool

    def close(self) -> None:
        """Close the kept connections (the router stops)."""
        for pool in self.pools.values():
            pool.clear()

    def kept(self, ex: Exchange, target: Target) -> UpstreamConn | None:
        up = self.pools[ex.label[0]].take_idle(target[1])
        return up if isinstance(up, UpstreamConn) else None

    async def connect(self, ex: Exchange, target: Target) -> UpstreamConn:
        loop = asyncio.get_running_loop()
        sock = await connect_retrying(loop, target[0], lambda: False)  # refused: 503 at once
        generation = target[1]
        _, up = await loop.connect_accepted_socket(
            lambda: UpstreamConn(generation, "provider"), sock
        )
        return up

    def unreachable(self, ex: Exchange, target: Target, why: str) -> Answer:
        slug = ex.label[0]
        hint = f"; is {socket_unit(slug)} started?" if self.router.systemd else ""
        return Answer(
            503,
            f'Failed to reach provider "{slug}" at {target[0]}: {why}{hint}',
            "provider_unavailable",
            kind="server_error",
        )

    async def upstream_gone(self, ex: Exchange, why: str) -> Answer:
        return self.bad_gateway(ex, why)

    def broken(self, ex: Exchange, err: HttpError) -> Answer:
        return self.bad_gateway(ex, err.reason)

    def bad_gateway(self, ex: Exchange, reason: str) -> Answer:
        return Answer(
            502,
            f'Failed to get an answer from provider "{ex.label[0]}": {reason}',
            "bad_gateway",
            kind="server_error",
            close=True,
        )

    def pass_interim(self, ex: Exchange, resp: ResponseHead) -> bool:
        return not (resp.status == 100 and ex.continued)

    def final_head(self, ex: Exchange, resp: ResponseHead) -> None:
        if resp.body == "tunnel":
            raise HttpError(502, "the provider switched protocols, which is not routed")

    def answered(self, ex: Exchange, status: int) -> None:
        slug, exact = ex.label
        self.router.counters.count(slug, exact, status)

    def release_slot(self, ex: Exchange, up: UpstreamConn | None) -> None:
        if up is not None:
            if up.usable() and up.generation == self.table_generation:
                self.pools[ex.label[0]].keep(up, up.generation)
            else:
                up.close()

    def shown(self, target: str) -> str:
        return shown(target)
