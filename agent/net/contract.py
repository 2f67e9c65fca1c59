"""What a listener adds to the connection core: the `Site` contract, and a request's
`Lease` and `Target`. `agent.net.site.FrontSite` (a front: activation and the worker) and
`agent.router.site.RouterSite` (the router: the model lookup) keep it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from agent.net.answers import Answer
from agent.net.client import ClientConn
from agent.net.http import HttpError, RequestHead, ResponseHead
from agent.net.upconn import UpstreamConn
from agent.spec.provider import Address

Target = tuple[Address, int]  # where, and the upstream's generation (kept connections match it)


class Lease(Protocol):
    def release(self) -> None:
        """End this unit of in-flight work. Idempotent."""


class Exchange(Protocol):
    """What a site sees of a request (agent.net.exchange.Exchange)."""

    conn: ClientConn
    req: RequestHead
    data: bytearray  # the request as received so far (all of it once the body is read)
    head_len: int  # where its body begins in `data`
    slot: bool  # it holds one of the upstream's concurrency slots
    label: tuple[str, str]  # what the site counts it under
    continued: bool  # the site sent `100 Continue`
    lease: Lease | None  # what the site's `lease()` gave it, until it ends

    @property
    def target(self) -> Target | None:
        """Where it goes, once known."""

    def reply(self, status: int, doc: Mapping[str, object]) -> None:
        """Answer with a document of the site's own."""

    def send_continue(self) -> None:
        """`100 Continue` from here, if the client asked for it."""


class Site(Protocol):
    """What a listener adds to the core (agent.net.site.FrontSite, the router's RouterSite).

    Each method answers one question about request `ex`; those that refuse raise (and
    `refusal` turns what they raised into an answer) or return an `Answer`."""

    @property
    def peer(self) -> str:
        """ "worker", "provider": the upstream, in messages."""

    @property
    def collects(self) -> bool:
        """The whole body is read before the target is asked for."""

    @property
    def max_body(self) -> int:
        """With `collects`: 413 beyond it."""

    @property
    def request_timeout_s(self) -> float:
        """An inactivity limit; <= 0: none."""

    def gate(self, req: RequestHead) -> Answer | None: ...
    def lease(self, ex: Exchange) -> Lease: ...
    def refusal(self, e: Exception) -> Answer | None: ...
    def collecting(self, ex: Exchange) -> None: ...
    def too_large(self) -> Answer: ...
    def target_now(self, ex: Exchange) -> Target | None: ...
    async def target(self, ex: Exchange) -> Target: ...
    def kept(self, ex: Exchange, target: Target) -> UpstreamConn | None: ...
    async def connect(self, ex: Exchange, target: Target) -> UpstreamConn: ...
    def unreachable(self, ex: Exchange, target: Target, why: str) -> Answer: ...
    async def upstream_gone(self, ex: Exchange, why: str) -> Answer: ...
    def broken(self, ex: Exchange, err: HttpError) -> Answer: ...
    def pass_interim(self, ex: Exchange, resp: ResponseHead) -> bool: ...
    def final_head(self, ex: Exchange, resp: ResponseHead) -> None: ...
    def answered(self, ex: Exchange, status: int) -> None: ...
    def release_slot(self, ex: Exchange, up: UpstreamConn | None) -> None: ...
    def shown(self, target: str) -> str: ...
