"""One HTTP request through the core, from its parsed head to the end of its response.

The gate (`site.gate(req)`: go on, or an answer) → the lease → the target (for a front:
the worker once ready and a `max_concurrency` slot; for the router: the provider its body
names) → a kept upstream connection or a new one (connects retried while the upstream
runs) → the request as received, then its body as it arrives → the response as produced.
The usual request does all of that in the callbacks that bring its bytes, with no task:
one is made only when something must be waited for (a start, a slot, a connect).

Its time limits and the tunnel after a `101` are agent.net.streaming's; what a listener
adds is its `Site` (agent.net.contract).

Why this module is over 400 lines: a request's life is one object whose callbacks run
in a fixed order (head, gate, lease, target, connect, body, response, end); split, the
order would be spread across files that each need the others' state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping
from typing import Any

from agent.errors import ProviderdError
from agent.net import splice
from agent.net.answers import Answer, made_up
from agent.net.chunked import ChunkedScanner
from agent.net.client import PAUSE_UPSTREAM, PAUSE_WAIT, ClientConn
from agent.net.contract import Lease, Site, Target
from agent.net.http import HttpError, RequestHead, ResponseHead, error_response
from agent.net.sockio import BUFFER_SIZE, error_text
from agent.net.splice import Pump
from agent.net.streaming import Streaming
from agent.net.upconn import UpstreamConn, UpstreamGone

log = logging.getLogger(__name__)

# Methods whose request may be sent again on a new connection when a kept one turns out closed.
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
# The request (head and body) read ahead while its upstream connection is not there yet
# (a start, a slot, a connect); then the front stops reading until it is. One more read, of
# at most sockio.HEAD_SIZE (a held body is read in head-sized buffers), may come first.
HELD_MAX = 4 * 1024
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class ClientGone(ProviderdError):
    """The client went away."""

    code = "client_gone"


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


class Exchange(Streaming):
    __slots__ = (
        "attempt",
        "body_last",
        "body_left",
        "bulk_body",
        "collects",
        "conn",
        "consumed",
        "continued",
        "data",
        "head_len",
        "interim",
        "keep_data",
        "label",
        "last",
        "lease",
        "loop",
        "no_splice",
        "over",
        "pump_in",
        "pump_out",
        "req",
        "resp",
        "reused",
        "scanner",
        "site",
        "slot",
        "started",
        "target",
        "task",
        "up",
        "up_shut",
    )

    def __init__(self, conn: ClientConn, site: Site, req: RequestHead, head_end: int) -> None:
        self.conn = conn
        self.site = site
        self.req = req
        self.loop = conn.loop
        self.lease: Lease | None = None
        self.slot = False
        self.target: Target | None = None
        self.up: UpstreamConn | None = None
        self.reused = False
        self.attempt = 0
        self.task: asyncio.Task[None] | None = None
        self.started = False  # the final response head went to the client
        self.interim = False  # a 1xx went to the client
        self.up_shut = False  # the client's half-close went on to the upstream
        self.over = False
        self.pump_in: Pump | None = None
        self.pump_out: Pump | None = None
        self.no_splice = False
        self.resp: ResponseHead | None = None
        self.last = 0.0  # loop time of the last byte either way
        self.body_last = 0.0  # loop time of the last body byte from the client
        self.scanner: ChunkedScanner | None = None
        self.body_left = 0  # Content-Length bytes still to come
        self.bulk_body = False
        self.label = ("", "")  # what a site counts the request under
        self.continued = False  # a site sent `100 Continue` for this request
        self.collects = site.collects  # the whole body is read before the target is known
        buf = conn.buf
        assert buf is not None
        body_end = head_end
        self.consumed = True  # the whole body has been read from the client
        if req.body == "length":
            have = conn.end - head_end
            if have >= req.length:
                body_end = head_end + req.length
            else:
                body_end = conn.end
                self.body_left = req.length - have
                self.consumed = False
                # Large buffers once it goes on to the upstream (attach), or while collected.
                self.bulk_body = self.collects and self.body_left > BUFFER_SIZE
        elif req.body == "chunked":
            self.scanner = ChunkedScanner(strict=True)
            at = self.scanner.scan(buf, head_end, conn.end)  # HttpError: the caller answers
            body_end = at if at >= 0 else conn.end
            self.consumed = at >= 0
        self.data = buf[conn.start : body_end]  # a copy: the buffer is lent per read
        self.head_len = head_end - conn.start
        conn.start = body_end
        self.keep_data = self.consumed and req.method in IDEMPOTENT

    # -- the request's way in

    def begin(self) -> None:
        site, req = self.site, self.req
        refused = site.gate(req)
        if refused is not None:
            self.answer(refused)
            return
        try:
            self.lease = site.lease(self)
        except Exception as e:
            self.refuse(e)
            return
        if self.collects:
            # What came with the head may already be over the limit (a chunked body: its
            # length is known only as it arrives); the rest is checked as it comes.
            if len(self.data) - self.head_len > self.site.max_body:
                self.answer(self.site.too_large(), close=True)
                return
            if not self.consumed:
                self.arm()  # the body timeout, while the body is read
                self.site.collecting(self)
                return
        self.begin_target()

    def begin_target(self) -> None:
        try:
            target = self.site.target_now(self)
        except Exception as e:
            self.refuse(e)
            return
        if target is not None:
            self.go(target)
        elif not self.over:
            self.hold()
            self.spawn(self.wait_target())

    def refuse(self, e: Exception) -> None:
        answer = self.site.refusal(e)
        if answer is None:
            self.cancel()
            self.conn.close()
        else:
            self.answer(answer)

    def hold(self) -> None:
        """The request waits for its target or its upstream connection (a start, a slot, a
        connect), or more of its body came meanwhile: the front reads ahead at most HELD_MAX
        of it, and the body's inactivity limit runs, as it does once the request reached the
        upstream (nginx's client_body_timeout; the response's limit does not run yet). It
        runs from the head, or from the body's last byte once one came (a connect after a
        start does not restart it); not while the client waits for `100 Continue` to send
        its body (timed from its first byte)."""
        if self.consumed:
            return
        if len(self.data) >= HELD_MAX:
            self.conn.pause(PAUSE_WAIT, True)
        if self.req.expect_continue and len(self.data) == self.head_len and not self.continued:
            return
        if not self.body_last:
            self.body_last = self.loop.time()
        self.conn.deadline(self.due(), "request")

    def task_ended(self, e: BaseException) -> None:
        """The exchange's task did not get what it waited for: cancelled (the exchange
        ends), or an error (answered as a refusal; either way the lease goes back)."""
        self.task = None
        if not isinstance(e, Exception):
            if not self.over:
                self.end(keep_client=False)
        else:
            self.refuse(e)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self.task = task = self.loop.create_task(coro)
        task.add_done_callback(_retrieve)

    async def wait_target(self) -> None:
        try:
            target = await self.site.target(self)
        except (asyncio.CancelledError, Exception) as e:
            self.task_ended(e)
            return
        self.task = None
        if not self.over:
            self.go(target)

    def go(self, target: Target) -> None:
        self.target = target
        up = self.site.kept(self, target)
        if up is not None:
            self.attach(up, reused=True)
        else:
            self.hold()
            self.spawn(self.connect())

    async def connect(self) -> None:
        target = self.target
        assert target is not None
        try:
            up = await self.site.connect(self, target)
        except OSError as e:
            self.task = None
            self.answer(self.site.unreachable(self, target, error_text(e)))
            return
        except (asyncio.CancelledError, Exception) as e:
            self.task_ended(e)
            return
        self.task = None
        if self.over:
            up.close()
            return
        self.attach(up, reused=False)

    def attach(self, up: UpstreamConn, reused: bool) -> None:
        self.up, self.reused = up, reused
        self.attempt += 1
        self.bulk_body = self.body_left > BUFFER_SIZE
        up.begin(self, self.req.method, self.data)
        if not self.keep_data:
            self.data = bytearray()
        conn = self.conn
        conn.pause(PAUSE_WAIT, False)  # the held read-ahead was full: reading again, and timed
        self.body_last = self.last = self.loop.time()  # arm(), inline
        conn.deadline(self.due(), "request")
        if self.body_left >= splice.SPLICE_MIN:
            self.splice_request()
        if conn.write_paused and up.transport is not None:
            up.transport.pause_reading()
        if self.up_shut or (conn.eof and self.consumed):
            self.client_eof()

    # -- the body, as the client sends it (ClientConn.to_exchange)

    def body_wanted(self) -> bool:
        return not self.consumed

    def body_bytes(self, view: memoryview) -> int:
        """Take what of `view` belongs to the body; returns how many bytes."""
        if self.scanner is not None:
            conn = self.conn
            assert conn.buf is not None
            try:
                at = self.scanner.scan(conn.buf, conn.start, conn.end)
            except HttpError as e:  # a malformed chunk: 400, or a cut once answered
                self.drop_up()
                if self.started:
                    self.end(keep_client=False, cut=True)
                else:
                    self.answer(Answer(e.status, e.reason), close=True)
                return len(view)
            used = (at - conn.start) if at >= 0 else len(view)
            self.consumed = at >= 0
        else:
            used = min(len(view), self.body_left)
            self.body_left -= used
            self.consumed = self.body_left == 0
        self.body_last = self.last = self.loop.time()
        if self.up is not None:
            self.up.write(view[:used])
            if self.body_left >= splice.SPLICE_MIN:
                self.splice_request()
        else:
            self.data += view[:used]
            if self.collects:
                limit = self.site.max_body
                if len(self.data) - self.head_len > limit:
                    self.answer(self.site.too_large(), close=True)
                elif self.consumed:
                    self.disarm()
                    self.begin_target()
            elif len(self.data) >= HELD_MAX or self.conn.due_kind != "request":
                self.hold()  # the read-ahead is full, or a body begun without `100 Continue`
        return used

    # -- the response (UpstreamConn's callbacks)

    def on_interim(self, resp: ResponseHead, head: memoryview) -> None:
        if self.site.pass_interim(self, resp):
            self.interim = True
            self.on_data(head)

    def on_final(self, resp: ResponseHead) -> None:
        self.site.final_head(self, resp)  # may raise HttpError: answered as the site says
        self.resp = resp
        self.started = True

    def on_whole(self, resp: ResponseHead, data: bytes | memoryview, reusable: bool) -> None:
        """A final response that came whole (head and body), in one write."""
        self.on_final(resp)
        self.conn.write(data)
        self.on_end(reusable)

    def on_data(self, data: bytes | memoryview) -> None:
        self.last = self.loop.time()
        self.conn.write(data)

    def on_end(self, reusable: bool) -> None:
        resp, req = self.resp, self.req
        assert resp is not None
        self.site.answered(self, resp.status)
        # Not kept with part of a body still to come (a worker answering early, 413 say): it
        # would read the rest as the next request.
        keep_up = (
            reusable and resp.keep_alive and req.keep_alive and not self.up_shut and self.consumed
        )
        keep = (
            req.keep_alive
            and resp.keep_alive
            and resp.body != "close"
            and not self.conn.eof
            and self.consumed
        )
        self.end(keep_client=keep, keep_up=keep_up)

    # -- what goes wrong

    def upstream_failed(self, err: HttpError) -> None:
        """The upstream broke HTTP (502), or the site refused its answer."""
        self.drop_up()
        if self.started:
            log.debug("Failed to relay a response: %s", err.reason)
            self.end(keep_client=False, cut=True)
            return
        self.answer(self.site.broken(self, err), close=True)

    def upstream_gone(self, e: UpstreamGone) -> None:
        up = self.up
        self.drop_up()
        if self.started:
            log.debug("Failed to relay a response: %s", e)
            self.end(keep_client=False, cut=True)
            return
        if (
            up is not None
            and self.reused
            and self.attempt == 1
            and not self.interim
            and self.keep_data
            and self.target is not None
        ):
            self.spawn(self.connect())  # a kept connection closed just now: a new one, once
            return
        self.spawn(self.gone(e))

    async def gone(self, e: UpstreamGone) -> None:
        try:
            answer = await self.site.upstream_gone(self, str(e))
        except (asyncio.CancelledError, Exception) as error:
            self.task_ended(error)
            return
        self.task = None
        if not self.over:
            self.answer(answer)

    def client_eof(self) -> None:
        """The client half-closed: it gave up if it waits, or the upstream learns of it."""
        if self.over:
            return
        if self.conn.tunnel is not None:
            self.tunnel_half()
        elif not self.consumed:
            self.cancel()  # in the middle of its body
        elif self.up is None:
            self.cancel()  # it waited for the start or a slot, and left
        elif not self.up_shut:
            self.up_shut = True
            self.up.shut_write()  # pass the half-close on; the response still flows back

    def client_lost(self, exc: Exception | None) -> None:
        self.cancel()

    def cancel(self) -> None:
        if self.over:
            return
        if self.task is not None:
            self.task.cancel()
            self.task = None
        self.drop_up()
        self.end(keep_client=False)

    def pause_upstream(self, on: bool) -> None:
        up = self.up
        if self.pump_out is not None:
            return  # its reading is the pump's
        if up is not None and up.transport is not None and not up.dead:
            if on:
                up.transport.pause_reading()
            else:
                up.transport.resume_reading()

    def pause_client(self, on: bool) -> None:
        self.conn.pause(PAUSE_UPSTREAM, on)
        if not on:
            self.reading()

    # -- the end

    def answer(self, a: Answer, close: bool = False) -> None:
        """Answer the request ourselves; the connection goes on if its body has been read."""
        if self.over:
            return
        self.drop_up()
        req = self.req
        close = close or a.close or not (req.keep_alive and self.consumed)
        self.site.answered(self, a.status)
        what = f"{req.method} {self.site.shown(req.target)}"
        self.conn.write(self.conn_answer(a, close=close, head_only=req.method == "HEAD", what=what))
        self.end(keep_client=not close)

    def reply(self, status: int, doc: Mapping[str, object]) -> None:
        """Answer with a document of the site's own (the router's model list)."""
        req = self.req
        close = not (req.keep_alive and self.consumed)
        self.site.answered(self, status)
        self.conn.write(error_response(status, doc, close=close, head_only=req.method == "HEAD"))
        self.end(keep_client=not close)

    def send_continue(self) -> None:
        """`100 Continue` from here (a site that reads the body before it picks the target)."""
        req = self.req
        if req.expect_continue and req.version == 11 and not self.continued:
            self.continued = True
            self.conn.write(CONTINUE)

    def conn_answer(self, a: Answer, *, close: bool, head_only: bool, what: str) -> bytes:
        return made_up(self.conn.style, a, close=close, head_only=head_only, what=what)

    def leave_slot(self) -> None:
        self.site.release_slot(self, None)

    def drop_up(self) -> None:
        if self.pump_in is not None or self.pump_out is not None:
            self.stop_pumps()
        up, self.up = self.up, None
        if up is not None:
            up.close()

    def end(
        self,
        *,
        keep_client: bool,
        keep_up: bool = False,
        cut: bool = False,
    ) -> None:
        if self.over:
            return
        self.over = True
        conn = self.conn
        if conn.due_kind == "request":  # disarm(), inline: every request passes here
            conn.deadline(None, "")
        if self.pump_in is not None or self.pump_out is not None:
            self.stop_pumps()
        if self.task is not None:
            self.task.cancel()
            self.task = None
        up, self.up = self.up, None
        if up is not None and keep_up:
            up.rest()
        self.site.release_slot(self, up if keep_up else None)
        if up is not None and not keep_up:
            up.close()
        if self.lease is not None:
            lease, self.lease = self.lease, None
            try:
                lease.release()
            except Exception as e:  # the connection must still end or go on
                log.warning("Failed to release a request's lease: %s", e)
                log.debug("Failed to release a request's lease", exc_info=e)
        if conn.ex is self:
            conn.tunnel = None
            if cut:
                conn.ex = None
                conn.close()
            else:
                conn.request_done(keep_client)
