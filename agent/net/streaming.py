"""A request once it streams (agent.net.exchange.Exchange's base): its time limits, and
the tunnel it becomes after a `101` (or a 2xx to CONNECT).

`request_timeout_s` is an inactivity limit: to the first byte of the response and between
any two bytes either way (504 before the response began, a cut after). A body that sends
nothing for sockio.BODY_TIMEOUT_S gets 408. Both ride on the connection's one timer
(ClientConn.deadline), moved lazily: re-armed about once per limit, not per request or byte.

A tunnel keeps its lease until both sides have closed; each side's EOF is passed on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.net import sockio
from agent.net.answers import Answer, answers
from agent.net.client import ClientConn
from agent.net.upconn import UpstreamConn

if TYPE_CHECKING:
    from agent.net.contract import Site


class Streaming:
    """Time limits and tunnels; the state is the exchange's (declared here, kept there in
    its slots)."""

    conn: ClientConn
    site: Site
    up: UpstreamConn | None
    over: bool
    started: bool
    consumed: bool
    last: float
    body_last: float

    def drop_up(self) -> None:
        raise NotImplementedError

    def leave_slot(self) -> None:
        raise NotImplementedError

    def answer(self, a: Answer, close: bool = False) -> None:
        raise NotImplementedError

    def end(self, *, keep_client: bool, keep_up: bool = False, cut: bool = False) -> None:
        raise NotImplementedError

    # -- time limits

    def arm(self) -> None:
        self.body_last = self.last = self.conn.loop.time()
        self.conn.deadline(self.due(), "request")

    def due(self) -> float | None:
        limit = self.site.request_timeout_s
        due = self.last + limit if limit > 0 else None
        if not self.consumed:
            body_due = self.body_last + sockio.BODY_TIMEOUT_S
            due = body_due if due is None else min(due, body_due)
        return due

    def disarm(self) -> None:
        if self.conn.due_kind == "request":
            self.conn.deadline(None, "")

    def tick(self) -> None:
        """The connection's timer fired for this request: a time limit passed, or it moves."""
        if self.over:
            return
        now = self.conn.loop.time()
        if not self.consumed and now >= self.body_last + sockio.BODY_TIMEOUT_S:
            self.drop_up()
            if self.started:
                self.end(keep_client=False, cut=True)
            else:
                self.answer(
                    Answer(408, f"no byte of the request body for {sockio.BODY_TIMEOUT_S:g} s"),
                    close=True,
                )
            return
        limit = self.site.request_timeout_s
        if limit > 0 and now >= self.last + limit:
            self.drop_up()
            what = f"no response from the {self.site.peer} for {limit:g} s (request_timeout_s)"
            if self.started:
                answers.log("cut", "Cut a response: %s", what)
                self.end(keep_client=False, cut=True)
            else:
                self.answer(Answer(504, what))
            return
        self.conn.deadline(self.due(), "request")

    # -- the tunnel

    def on_tunnel(self, up: UpstreamConn) -> None:
        """After a 101 (or a 2xx to CONNECT): bytes both ways, the lease kept until both close."""
        self.disarm()
        conn = self.conn
        assert up.transport is not None
        ahead = conn.ahead + conn.take_pending()
        conn.ahead = b""
        if ahead:
            up.write(ahead)
        conn.tunnel = up.transport
        self.leave_slot()  # a tunnel's connection is its own: out of the slots
        conn.pause(7, False)
        if conn.eof:
            self.tunnel_half()

    def tunnel_eof(self, up: UpstreamConn) -> None:
        transport = self.conn.transport
        if transport is not None and not self.conn.closed and transport.can_write_eof():
            transport.write_eof()
        if self.conn.eof:
            self.tunnel_lost()

    def tunnel_half(self) -> None:
        if self.up is not None:
            if self.up.eof:
                self.tunnel_lost()
            elif self.up.transport is not None and self.up.transport.can_write_eof():
                self.up.transport.write_eof()

    def tunnel_lost(self) -> None:
        up, self.up = self.up, None
        if up is not None:
            up.close()
        self.end(keep_client=False)
