"""What a listener adds to the core: the front's `Site` (leases, the worker's start, its
`max_concurrency` slots and kept connections) and the contract every site keeps.

A site answers the core's questions about one request: the gate (`gate(req)`: None to go
on, or the `Answer` to give: the place for Origin and API-key checks), its lease, where it
goes (`target_now` without waiting, else `await target`), a kept or a new connection there,
and what to answer when that fails. The router is the other site (agent.router).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from agent.errors import ProviderdError
from agent.net import exchange
from agent.net.answers import Answer
from agent.net.auth import without_keys
from agent.net.client import ClientConn
from agent.net.contract import Exchange, Lease, Target
from agent.net.http import HttpError, RequestHead, ResponseHead
from agent.net.upconn import UpstreamConn
from agent.net.upstream import QueueFull, Upstream, connect_retrying
from agent.spec.provider import Address

Gate = Callable[[RequestHead], "Answer | None"]

WORKER_GONE_RETRY_AFTER_S = 1.0
log = logging.getLogger(__name__)


class Unavailable(ProviderdError):
    """The provider cannot serve now. HTTP clients get `status` with a JSON body (`error`:
    the code, `message`: `error`, the sentence); TCP clients a close."""

    code = "unavailable"

    def __init__(
        self,
        status: int,
        error: str,
        retry_after_s: float | None = None,
        extra: Mapping[str, object] | None = None,
        code: str = "",
    ) -> None:
        self.extra: dict[str, object] = dict(extra or {})
        given = self.extra.pop("error", None)
        super().__init__(error, code=code or (str(given) if given else None))
        self.status = status
        self.error = error
        self.retry_after_s = retry_after_s

    def answer(self) -> Answer:
        return Answer(self.status, self.message, self.code, self.retry_after_s, self.extra)


def too_many_waiting(max_held: int) -> Unavailable:
    """The 503 for a request beyond `max_held`."""
    return Unavailable(
        503,
        f"too many requests waiting for the worker (max_held = {max_held})",
        retry_after_s=1,
        code="too_many_waiting",
    )


class Backend(Protocol):
    """What the front offers the data path for one provider."""

    slug: str
    # request_timeout_s: an inactivity limit (agent.core.exchange); <= 0: no limit.
    request_timeout_s: float
    upstream: Upstream  # the worker's concurrency slots (FIFO) and kept connections

    def lease(self, path: str | None) -> Lease:
        """Begin one unit of in-flight work: an HTTP request (`path` without the query) or a
        TCP connection (None). May raise Unavailable."""
        ...

    async def ready(self, *, may_start: bool = True) -> tuple[Address, int]:
        """Wait until the worker answers; return its address and a generation number that
        changes with every worker start. Raises Unavailable. Cancelled when the client goes
        away while it waits; the load must go on regardless."""
        ...

    def alive(self, generation: int) -> bool:
        """Worker `generation` still runs (a refused connect to it is worth retrying)."""
        ...

    def waiting_for_start(self) -> int:
        """Requests waiting for the worker to start (they count against max_held too)."""
        ...


def shown(text: str) -> str:
    return json.dumps(text[:80] + ("..." if len(text) > 80 else ""))


class FrontSite:
    """The front's site: one per backend. Optional backend hooks: `ready_now()` (the
    worker's target when it is ready now: no task), `request_gate(req)`, `source` (the loopback
    address to connect from), `async worker_gone(generation)` (why a worker went away)."""

    peer = "worker"
    collects = False  # the target does not depend on the body
    max_body = 0

    def __init__(
        self, backend: Backend, on_request: Callable[[ClientConn], None] | None = None
    ) -> None:
        self.backend = backend
        self.on_request = on_request  # a connection's request began (its lease is held)
        self.gate_hook: Gate | None = getattr(backend, "request_gate", None)
        self.strips_keys: Callable[[], bool] | None = getattr(backend, "strips_keys", None)
        self.ready_now: Callable[[], Target | None] | None = getattr(backend, "ready_now", None)
        # Places in the slot queue taken when a request arrived (the worker ready, no slot
        # free), by exchange: a request whose head comes later in the same turn of the loop
        # goes behind it, though its task has not run yet.
        self.queued: dict[Exchange, asyncio.Future[None]] = {}

    @property
    def request_timeout_s(self) -> float:
        return self.backend.request_timeout_s

    def exchange(self, conn: ClientConn, req: RequestHead, head_end: int) -> None:
        try:
            ex = exchange.Exchange(conn, self, req, head_end)
        except HttpError as e:
            conn.answer(Answer(e.status, e.reason), close=True)
            return
        conn.ex = ex
        conn.to_exchange()  # what follows the request's bytes waits as bytes; the buffer goes
        ex.begin()

    def gate(self, req: RequestHead) -> Answer | None:
        return self.gate_hook(req) if self.gate_hook is not None else None

    def lease(self, ex: Exchange) -> Lease:
        lease = self.backend.lease(ex.req.path)
        if self.on_request is not None:
            self.on_request(ex.conn)
        if self.strips_keys is not None and self.strips_keys():
            # API keys on: the worker gets the request without Authorization and x-api-key.
            head = without_keys(bytes(ex.data[: ex.head_len]))
            ex.data[: ex.head_len] = head
            ex.head_len = len(head)
        return lease

    def refusal(self, e: Exception) -> Answer | None:
        """What to answer for what the backend raised; None: close without an answer."""
        if isinstance(e, Unavailable):
            return e.answer()
        if isinstance(e, QueueFull):
            return too_many_waiting(self.backend.upstream.max_waiting).answer()
        log.debug("Failed to serve a request: %s", e, exc_info=e)
        return None

    def target_now(self, ex: Exchange) -> Target | None:
        if self.ready_now is None:
            return None
        target = self.ready_now()
        if target is None:
            return None
        place = self.backend.upstream.join(self.backend.waiting_for_start())  # QueueFull
        if place is not None:
            self.queued[ex] = place  # target() waits on it
            return None
        ex.slot = True
        return target

    async def target(self, ex: Exchange) -> Target:
        backend = self.backend
        may_start = getattr(ex.lease, "may_start", True)  # False: its key may not start it
        place = self.queued.pop(ex, None)
        if place is not None:
            await backend.upstream.wait(place)
        else:
            await backend.ready(may_start=may_start)
            await backend.upstream.acquire(backend.waiting_for_start())
        ex.slot = True
        # The worker may have been replaced while this request waited for its slot.
        return await backend.ready(may_start=may_start)

    def kept(self, ex: Exchange, target: Target) -> UpstreamConn | None:
        up = self.backend.upstream.take_idle(target[1])
        return up if isinstance(up, UpstreamConn) else None

    async def connect(self, ex: Exchange, target: Target) -> UpstreamConn:
        address, generation = target
        backend = self.backend
        loop = asyncio.get_running_loop()
        source = getattr(backend, "source", None)
        sock = await connect_retrying(loop, address, lambda: backend.alive(generation), source)
        _, up = await loop.connect_accepted_socket(lambda: UpstreamConn(generation, "worker"), sock)
        return up

    def unreachable(self, ex: Exchange, target: Target, why: str) -> Answer:
        return Answer(
            503,
            f"the worker does not accept connections at {target[0]}: {why}",
            "worker_unreachable",
            WORKER_GONE_RETRY_AFTER_S,
        )

    async def upstream_gone(self, ex: Exchange, why: str) -> Answer:
        reason: str | None = None
        explain = getattr(self.backend, "worker_gone", None)
        if explain is not None and ex.target is not None:
            try:
                got = await explain(ex.target[1])
            except Exception:
                got = None
            reason = got if isinstance(got, str) else None
        return Answer(503, reason or why, "worker_gone", WORKER_GONE_RETRY_AFTER_S)

    def collecting(self, ex: Exchange) -> None:
        pass

    def too_large(self) -> Answer:
        raise NotImplementedError

    def broken(self, ex: Exchange, err: HttpError) -> Answer:
        """The upstream broke HTTP (502)."""
        return Answer(err.status, err.reason)

    def pass_interim(self, ex: Exchange, resp: ResponseHead) -> bool:
        return True

    def final_head(self, ex: Exchange, resp: ResponseHead) -> None:
        pass

    def answered(self, ex: Exchange, status: int) -> None:
        pass

    def release_slot(self, ex: Exchange, up: UpstreamConn | None) -> None:
        """The request is over (or became a tunnel): keep its connection if it can serve
        another request, and pass the slot on."""
        upstream = self.backend.upstream
        if self.queued:  # (an empty dict: a request that found its slot free)
            place = self.queued.pop(ex, None)
            if place is not None:  # it ended before it waited for its place
                upstream.leave(place)
        if up is not None:
            if ex.slot and up.usable():
                upstream.keep(up, up.generation)
            else:
                up.close()
        if ex.slot:
            ex.slot = False
            upstream.release()

    def shown(self, target: str) -> str:
        return shown(target)
