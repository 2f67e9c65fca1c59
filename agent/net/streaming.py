"""A request once it streams (agent.net.exchange.Exchange's base): its time limits, and
the tunnel it becomes after a `101` (or a 2xx to CONNECT).

`request_timeout_s` is an inactivity limit: to the first byte of the response and between
any two bytes either way (504 before the response began, a cut after), from the moment the
request reached the upstream. A body that sends nothing for sockio.BODY_TIMEOUT_S gets 408,
also while the request is held (waiting for a start, a slot or a connection), except while
the front itself stopped reading it (NOT_READING). Both ride on the connection's one deadline
(ClientConn.deadline, on the loop's queue: agent.net.deadlines), moved lazily: pushed again
about once per limit, not per request or byte. A spliced body's limit does not run out
while its pump waits for the upstream (the pipe full, or the body all taken).

A tunnel keeps its lease until both sides have closed; each side's EOF is passed on.

Long bodies and tunnels go by splice (agent.net.splice): the rest of a request body of at
least SPLICE_MIN bytes (Content-Length) from the client to the upstream, the rest of such a
response body from the upstream to the client, and a tunnel both ways. The source's
transport is paused meanwhile (the client's by PAUSE_SPLICE), the time limits see every
splice, and at the body's end the transports take over again (keep-alive goes on). Where
the kernel declines, the bytes it took go through the transport and the normal path goes on.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from agent.net import sockio, splice
from agent.net.answers import Answer, answers
from agent.net.client import PAUSE_SPLICE, PAUSE_UPSTREAM, PAUSE_WAIT, ClientConn
from agent.net.sockio import error_text
from agent.net.splice import Pump
from agent.net.upconn import UpstreamConn, UpstreamGone

if TYPE_CHECKING:
    from agent.net.contract import Site


# The front stopped reading the client on its own (a held request's read-ahead is full, the
# upstream does not take the body as fast as it comes): the body's limit does not run.
NOT_READING = PAUSE_WAIT | PAUSE_UPSTREAM


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
    body_left: int
    collects: bool  # the site reads the whole body before it picks the target
    attempt: int  # times the request went to an upstream connection (0: not yet)
    pump_in: Pump | None  # client → upstream: the request body, or a tunnel's way up
    no_splice: bool  # a pump could not be made for this exchange: no more tries
    pump_out: Pump | None  # upstream → client: the response body, or a tunnel's way down

    def drop_up(self) -> None:
        raise NotImplementedError

    def leave_slot(self) -> None:
        raise NotImplementedError

    def answer(self, a: Answer, close: bool = False) -> None:
        raise NotImplementedError

    def end(self, *, keep_client: bool, keep_up: bool = False, cut: bool = False) -> None:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError

    def upstream_gone(self, e: UpstreamGone) -> None:
        raise NotImplementedError

    # -- time limits

    def arm(self) -> None:
        self.body_last = self.last = self.conn.loop.time()
        self.conn.deadline(self.due(), "request")

    def due(self) -> float | None:
        """The next time limit: the response's (request_timeout_s) once the request reached
        the upstream (or while a site collects its body), and the body's while it still
        comes and the front reads it."""
        limit = self.site.request_timeout_s
        due = self.last + limit if limit > 0 and (self.attempt or self.collects) else None
        if not self.consumed and not self.conn.paused & NOT_READING:
            body_due = self.body_last + sockio.BODY_TIMEOUT_S
            due = body_due if due is None else min(due, body_due)
        return due

    def reading(self) -> None:
        """The front reads the client again after stopping on its own: the body's limit
        counts from now (a client blocked by the front's back-pressure is not idle)."""
        if not self.consumed and not self.over:
            self.body_last = self.conn.loop.time()
            self.conn.deadline(self.due(), "request")

    def disarm(self) -> None:
        if self.conn.due_kind == "request":
            self.conn.deadline(None, "")

    def tick(self) -> None:
        """The connection's deadline came for this request: a time limit passed, or it moves."""
        if self.over:
            return
        now = self.conn.loop.time()
        pump = self.pump_in
        if pump is not None and not pump.reading and not self.consumed:
            self.body_last = now  # a spliced body waits for the upstream to take the pipe's
        if (
            not self.consumed
            and now >= self.body_last + sockio.BODY_TIMEOUT_S
            and not self.conn.paused & NOT_READING
        ):
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
        if limit > 0 and now >= self.last + limit and (self.attempt or self.collects):
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
        if not conn.eof:
            self.pump_in = self.pump(TUNNEL_IN, conn.transport, up.transport, -1)
        self.pump_out = self.pump(TUNNEL_OUT, up.transport, conn.transport, -1)
        if self.pump_out is not None:
            up.transport.pause_reading()
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
            else:
                self.up.shut_write()

    def tunnel_lost(self) -> None:
        up, self.up = self.up, None
        if up is not None:
            up.close()
        self.end(keep_client=False)

    # -- splicing

    def pump(
        self, role: int, src: asyncio.Transport | None, dst: asyncio.Transport | None, count: int
    ) -> Pump | None:
        """A started pump, or None (no splice here: the normal path goes on)."""
        conn = self.conn
        if not splice.AVAILABLE or src is None or dst is None or conn.closed or conn.closing:
            return None
        if self.no_splice:
            return None
        try:
            pump = Pump(conn.loop, self, role, src, dst, count)
        except OSError:  # out of descriptors, or declined: not again on every chunk
            self.no_splice = True
            return None
        if role in (REQUEST, TUNNEL_IN):
            conn.pause(PAUSE_SPLICE, True)
        pump.start()
        return pump

    def splice_request(self) -> None:
        """The rest of a long request body, from the client to the upstream in the kernel."""
        up = self.up
        if self.pump_in is None and up is not None and not up.dead:
            self.pump_in = self.pump(REQUEST, self.conn.transport, up.transport, self.body_left)

    def splice_response(self, up: UpstreamConn) -> bool:
        """The rest of a long response body (up.left bytes), from the upstream to the client
        in the kernel; False: it goes on through the transports."""
        if self.pump_out is not None or up is not self.up or up.transport is None:
            return False
        self.pump_out = self.pump(RESPONSE, up.transport, self.conn.transport, up.left)
        if self.pump_out is None:
            return False
        up.transport.pause_reading()
        return True

    def stop_pumps(self) -> None:
        for pump in (self.pump_in, self.pump_out):
            if pump is not None:
                pump.stop()
        self.pump_in = self.pump_out = None

    def pump_moved(self, pump: Pump, taken: bool) -> None:
        """Bytes came from the source (taken), or went to a destination that had stopped
        the pump reading: for a request body, either is the client's progress (a client
        the upstream holds up is not idle, as on the normal path: reading())."""
        self.last = self.conn.loop.time()
        if pump.role == REQUEST:
            self.body_last = self.last

    def pump_end(self, pump: Pump) -> None:
        role, early = pump.role, pump.left > 0  # early: the source's EOF before the count
        up = self.up
        if role == REQUEST:
            self.pump_in = None
            if early:
                self.conn.eof = True  # the client left in the middle of its body
                self.cancel()
                return
            self.body_left = 0
            self.consumed = True
            self.conn.pause(PAUSE_SPLICE, False)
        elif role == RESPONSE:
            self.pump_out = None
            if up is None:
                return
            if early:
                where = "in the middle of a response"
                up.dead = True
                self.upstream_gone(UpstreamGone(f"the {up.peer} closed the connection {where}"))
                return
            up.body_spliced()
        elif role == TUNNEL_IN:
            self.pump_in = None
            self.conn.eof = True
            self.tunnel_half()
        elif up is not None:
            self.pump_out = None
            up.eof = True
            self.tunnel_eof(up)

    def pump_failed(self, pump: Pump, e: OSError, at_source: bool) -> None:
        client_side = at_source == (pump.role in (REQUEST, TUNNEL_IN))
        if client_side:
            self.conn.eof = True  # the client is gone: no lingering
        if pump.role in (TUNNEL_IN, TUNNEL_OUT):
            self.tunnel_lost()
        elif client_side:
            self.cancel()
        else:
            peer = self.site.peer
            self.upstream_gone(UpstreamGone(f"the {peer} connection failed ({error_text(e)})"))

    def pump_declined(self, pump: Pump, held: bytes) -> None:
        conn, up = self.conn, self.up
        if pump.role in (REQUEST, TUNNEL_IN):
            self.pump_in = None
            if up is not None:
                up.write(held)
            if pump.role == REQUEST:
                self.body_left = pump.left
                self.consumed = pump.left == 0
            conn.pause(PAUSE_SPLICE, False)
            return
        self.pump_out = None
        conn.write(held)
        if up is None or up.transport is None:
            return
        if pump.role == RESPONSE and pump.left == 0:
            up.body_spliced()  # the pipe held the rest: the response is over
            return
        if pump.role == RESPONSE:
            up.body_rest(pump.left)
        if not conn.write_paused:
            up.transport.resume_reading()


REQUEST, RESPONSE, TUNNEL_IN, TUNNEL_OUT = range(4)  # what a pump carries
