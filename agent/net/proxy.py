"""The data path: one HTTP or TCP relay per accepted client connection.

The front accepts, counts and times connections; for each one it runs
`serve_http` or `serve_tcp` as a task with its `Backend`. Per HTTP request:
read the head → `backend.lease(path)` → `await backend.ready()` → connect to the
worker (or reuse the connection the previous request on this client connection
used, if the worker generation is the same and the connection still open) →
forward head and body unchanged → relay the response → release the lease. An idle
keep-alive connection holds no lease; after a `101` (or a `2xx` to CONNECT) the
connection is an opaque byte relay that keeps its lease until it closes.

Buffers are bounded: each direction reads into one pooled buffer and reads again
only once the other side has taken everything, so a slow reader holds at most
`BULK_SIZE` per direction here plus the kernel's socket buffers. Heads and small
messages use `BUFFER_SIZE` buffers; a body that fills one switches to a `BULK_SIZE`
buffer (fewer, larger system calls). A connection that waits for its next request
holds no buffer at all.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Coroutine, Generator, Mapping
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from agent.net.heads import HeadReader
from agent.net.http import (
    MAX_HEAD,
    ChunkedScanner,
    HttpError,
    RequestHead,
    ResponseHead,
    error_response,
    find_head_end,
    parse_request_head,
    parse_response_head,
)
from agent.net.ratelog import RateLog
from agent.net.sockio import (
    BODY_TIMEOUT_S,
    BUFFER_SIZE,
    BULK_SIZE,
    HEAD_SIZE,
    close_lingering,
    error_text,
    give,
    nodelay,
    recv_within,
    shutdown_write,
    still_open,
    take,
    wait_readable,
)
from agent.net.upstream import QueueFull, Upstream, connect_retrying
from agent.spec.provider import Address

log = logging.getLogger(__name__)
answers = RateLog(log)  # what the proxy answers by itself, rate-limited
T = TypeVar("T")

WORKER_GONE_RETRY_AFTER_S = 1.0
WATCH_AFTER_S = 0.05  # a response slower than this: watch the client for a hang-up meanwhile
# Methods whose request may be sent again on a new connection when a kept one turns out closed.
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})

assert BUFFER_SIZE >= MAX_HEAD


class Unavailable(Exception):
    """The provider cannot serve now. HTTP clients get `status` with a JSON body; TCP clients a close."""

    def __init__(
        self,
        status: int,
        error: str,
        retry_after_s: float | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.retry_after_s = retry_after_s
        self.extra: dict[str, object] = dict(extra or {})

    def body(self, provider: str) -> dict[str, object]:
        return {
            "error": self.error,
            "provider": provider,
            "retry_after_s": self.retry_after_s,
            **self.extra,
        }


class Lease(Protocol):
    def release(self) -> None:
        """End this unit of in-flight work. Idempotent."""


class Backend(Protocol):
    """What the front offers the data path for one provider."""

    slug: str
    # Bounds one HTTP request from the moment ready() returns to the response's end (504,
    # or a cut connection once the response began). The wait in ready() is the front's to
    # bound (start_timeout_s). Tunnels after an upgrade and TCP connections have no limit.
    # <= 0: no limit.
    request_timeout_s: float
    # The worker's side: concurrency slots (FIFO) and kept connections.
    upstream: Upstream

    def lease(self, path: str | None) -> Lease:
        """Begin one unit of in-flight work: an HTTP request (`path` without the query) or a
        TCP connection (None). A path in `idle_ignore_paths` gives a lease that does not hold
        the card. May raise Unavailable."""
        ...

    async def ready(self) -> tuple[Address, int]:
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


async def _why_gone(backend: Backend, generation: int) -> str | None:
    """What the backend knows of why worker `generation` went away (an OOM kill, say).

    Optional: a backend may offer `async worker_gone(generation) -> str | None`, which
    waits briefly for the worker's exit to be reported."""
    explain = getattr(backend, "worker_gone", None)
    if explain is None:
        return None
    try:
        reason = await explain(generation)
    except Exception:
        return None
    return reason if isinstance(reason, str) else None


# -- errors inside one connection ---------------------------------------------------------


class ClientGone(Exception):
    """The client closed or reset its connection."""


class ClientTimeout(ClientGone):
    """The client sent nothing of a request body for BODY_TIMEOUT_S."""


class UpstreamGone(Exception):
    """The upstream (the worker; a provider, for the router) closed, reset or refused the
    connection."""


# -- socket helpers ------------------------------------------------------------------------


async def _connect(
    loop: asyncio.AbstractEventLoop, address: Address, backend: Backend, generation: int
) -> socket.socket:
    """Connect to the worker, retrying a refused or reset connect while it runs. Raises
    UpstreamGone if it cannot be reached."""
    try:
        return await connect_retrying(loop, address, lambda: backend.alive(generation))
    except OSError as e:
        raise UpstreamGone(
            f"the worker does not accept connections at {address}: {error_text(e)}"
        ) from None


async def _copy(loop: asyncio.AbstractEventLoop, src: socket.socket, dst: socket.socket) -> None:
    """Copy src → dst until src's EOF, then shut down dst's write side. Holds a buffer only
    while bytes are on their way."""
    size = BUFFER_SIZE
    while True:
        buf = take(size)
        try:
            n = src.recv_into(buf)
        except BlockingIOError:
            give(buf)
            await wait_readable(loop, src)
            continue
        except BaseException:
            give(buf)
            raise
        if n == 0:
            give(buf)
            shutdown_write(dst)
            return
        size = BULK_SIZE if n == len(buf) else BUFFER_SIZE
        try:
            await loop.sock_sendall(dst, memoryview(buf)[:n])
        finally:
            give(buf)


class _Resume(Generic[T]):
    """Await a coroutine that has already run up to its first suspension (`first`, what it
    yielded). This is what `await` does from the start; it lets the proxy call
    `backend.ready()` synchronously first and set up the client watch only if it waits."""

    __slots__ = ("coro", "first")

    def __init__(self, coro: Coroutine[Any, Any, T], first: Any) -> None:
        self.coro = coro
        self.first = first

    def __await__(self) -> Generator[Any, Any, T]:
        coro, pending = self.coro, self.first
        while True:
            try:
                sent = yield pending
            except BaseException as exc:  # cancellation and errors go to the coroutine
                try:
                    pending = coro.throw(exc)
                except StopIteration as done:
                    result: T = done.value
                    return result
            else:
                try:
                    pending = coro.send(sent)
                except StopIteration as done:
                    result = done.value
                    return result


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _relay_both(loop: asyncio.AbstractEventLoop, a: socket.socket, b: socket.socket) -> None:
    """Relay both directions until both have ended (half-close aware) or one fails."""
    back = asyncio.create_task(_copy(loop, b, a))
    back.add_done_callback(_retrieve)
    try:
        await _copy(loop, a, b)
        await back
    finally:
        back.cancel()


# -- the response relay (the router's too) ----------------------------------------------


class ResponseRelay:
    """Relays one HTTP response from an upstream connection to the client: the interim
    (1xx) responses, the final head and the body in its framing (Content-Length, chunked,
    until EOF; after a tunnel's head, only what came with it). Bytes pass through unchanged
    as they arrive; at most one buffer per response, BUFFER_SIZE, or BULK_SIZE once a
    read fills it.

    The data path and the router each keep their own request side and decide what a
    response means for the connection; a subclass sets `loop`, `client` and `started`,
    names its upstream in `peer` ("worker", "provider"), and may override
    `interim_response` and `final_head`."""

    peer: ClassVar[str]
    loop: asyncio.AbstractEventLoop
    client: socket.socket
    started: bool  # the final response head went to the client

    async def interim_response(self, resp: ResponseHead, head: memoryview) -> None:
        """An interim (1xx) response: passed on unless a subclass decides otherwise."""
        await self.send_client(head)

    def progress(self) -> None:
        """Bytes of the response moved (a subclass restarts its inactivity limit)."""

    def final_head(self, resp: ResponseHead) -> None:
        """The final head, before any of it is sent: a subclass may refuse it by raising."""

    async def relay_message(self, up: socket.socket, method: str) -> tuple[ResponseHead, bool]:
        """Relay interim responses and the final one to the client (`started` is set once
        its head is about to go). Returns the final head and whether the upstream
        connection can serve another request. Raises UpstreamGone, ClientGone, HttpError
        (502: the upstream broke HTTP)."""
        # The upstream may take minutes to answer (a long generation): wait for its first
        # bytes without a buffer, so a thousand requests in flight cost little.
        await wait_readable(self.loop, up)
        buf = take()
        view = memoryview(buf)
        s = e = 0
        try:
            while True:
                head_end = find_head_end(buf, s, e) if e > s else -1
                if head_end < 0:
                    if e - s >= MAX_HEAD:
                        raise HttpError(
                            502, f"the {self.peer} sent a head larger than {MAX_HEAD} bytes"
                        )
                    if e == len(buf):
                        buf[: e - s] = buf[s:e]
                        s, e = 0, e - s
                    n = await self.recv_up(up, view[e:])
                    if n == 0:
                        raise UpstreamGone(
                            f"the {self.peer} closed the connection before answering"
                        )
                    e += n
                    continue
                resp = parse_response_head(buf, method, s, head_end)
                if resp.status >= 200 or resp.body == "tunnel":
                    break
                await self.interim_response(resp, view[s:head_end])
                s = head_end
            self.final_head(resp)
            self.started = True
            return resp, await self.relay_body(resp, up, buf, s, head_end, e)
        finally:
            give(buf)

    async def recv_up(self, up: socket.socket, into: memoryview) -> int:
        """Read from the upstream into `into`; 0 at its EOF. Raises UpstreamGone."""
        try:
            n = await self.loop.sock_recv_into(up, into)
        except OSError as e:
            raise UpstreamGone(f"the {self.peer} connection failed ({e.strerror or e})") from None
        self.progress()
        return n

    async def send_client(self, data: bytes | memoryview) -> None:
        """Send all of `data` to the client. Raises ClientGone."""
        try:
            await self.loop.sock_sendall(self.client, data)
        except OSError as e:
            raise ClientGone(f"client connection failed: {e.strerror or e}") from None
        self.progress()

    async def relay_body(
        self, resp: ResponseHead, up: socket.socket, buf: bytearray, s: int, head_end: int, e: int
    ) -> bool:
        """Send the response head and body in buf[s:e] and what follows from the upstream.
        Returns whether the upstream connection can serve another request."""
        view = memoryview(buf)
        if resp.body in ("none", "tunnel"):
            await self.send_client(view[s : e if resp.body == "tunnel" else head_end])
            return e == head_end
        if resp.body == "length":
            remaining = resp.length
            first = min(e - head_end, remaining)
            remaining -= first
            await self.send_client(view[s : head_end + first])
            if remaining > len(buf):
                big = take(BULK_SIZE)
                try:
                    await self.relay_length(up, big, remaining)
                finally:
                    give(big)
            elif remaining:
                await self.relay_length(up, buf, remaining)
            return e == head_end + first
        chunked = ChunkedScanner() if resp.body == "chunked" else None
        try:
            at = chunked.scan(buf, head_end, e) if chunked is not None else -1
            await self.send_client(view[s : at if at >= 0 else e])
            if at >= 0:
                return at == e
            bulk: bytearray | None = None
            try:
                while True:
                    n = await self.recv_up(up, view)
                    if n == 0:
                        if chunked is None:  # close-delimited: the upstream's EOF ends it
                            return False
                        raise UpstreamGone(
                            f"the {self.peer} closed the connection in the middle of a response"
                        )
                    at = chunked.scan(bulk or buf, 0, n) if chunked is not None else -1
                    await self.send_client(view[: at if at >= 0 else n])
                    if at >= 0:
                        return at == n
                    if n == len(view) and bulk is None:  # a full buffer: switch to bulk
                        bulk = take(BULK_SIZE)
                        view = memoryview(bulk)
            finally:
                if bulk is not None:
                    give(bulk)
        except HttpError as err:
            raise HttpError(
                502, f"the {self.peer} sent a malformed chunked body: {err.reason}"
            ) from None

    async def relay_length(self, up: socket.socket, buf: bytearray, remaining: int) -> None:
        """Pass `remaining` bytes of a Content-Length body on through `buf`."""
        view = memoryview(buf)
        size = len(buf)
        while remaining:
            n = await self.recv_up(up, view[: min(size, remaining)])
            if n == 0:
                raise UpstreamGone(
                    f"the {self.peer} closed the connection in the middle of a response"
                )
            remaining -= n
            await self.send_client(view[:n])


# -- one client connection -----------------------------------------------------------------


class _Connection:
    """State shared by the HTTP and TCP relays: the client, the worker connection, and the
    watch that notices a client going away while nothing reads from it."""

    def __init__(self, client: socket.socket, backend: Backend) -> None:
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.client = client
        self.backend = backend
        self.up: socket.socket | None = None  # the worker connection of the request in flight
        self.up_generation = -1
        self.up_shut = False  # the client's half-close went on to it: not to be kept
        self.up_clean = False  # its last response ended cleanly: another request may use it
        self.slot = False  # this connection holds one of the worker's concurrency slots
        self.client_eof = False
        self.linger = False  # we close first: let the client read our last answer
        self._aborted: BaseException | None = None
        self._watching = False
        self._waiting = False  # in ready(): the client's EOF means it gave up
        self._watch_timer: asyncio.TimerHandle | None = None

    # The watch: while the proxy does not read from the client, a readable client socket
    # means EOF, an error, or more data (pipelining, tunnel data). Only the first two matter.

    def watch(self, waiting: bool) -> None:
        self._waiting = waiting
        if not self._watching:
            self.loop.add_reader(self.client.fileno(), self._client_readable)
            self._watching = True

    def unwatch(self) -> None:
        if self._watch_timer is not None:
            self._watch_timer.cancel()
            self._watch_timer = None
        if self._watching:
            self.loop.remove_reader(self.client.fileno())
            self._watching = False

    def _client_readable(self) -> None:
        try:
            data = self.client.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError as e:
            self.unwatch()
            self.abort(ClientGone(f"client connection failed: {e.strerror or e}"))
            return
        self.unwatch()
        if data:
            return
        self.client_eof = True
        if self._waiting:
            self.abort(ClientGone("client closed the connection while waiting for the worker"))
        elif self.up is not None:
            shutdown_write(self.up)  # pass the half-close on; the response still flows back
            self.up_shut = True

    def abort(self, exc: BaseException) -> None:
        """Stop what the connection's task awaits; `aborted()` turns the cancellation into exc."""
        if self._aborted is None:
            self._aborted = exc
            self.task.cancel()

    def aborted(self) -> BaseException | None:
        """Called on CancelledError: the exception to raise instead, or None if the
        cancellation came from outside (then re-raise it)."""
        exc, self._aborted = self._aborted, None
        if exc is not None and self.task.uncancel() == 0:
            return exc
        return None

    async def ready(self) -> tuple[Address, int]:
        """backend.ready(); while it waits, a client that goes away raises ClientGone."""
        return await self.watched(self.backend.ready())

    async def take_slot(self) -> None:
        """One of the worker's concurrency slots, in arrival order; while it waits, a client
        that goes away raises ClientGone. Raises Unavailable when too many wait."""
        upstream = self.backend.upstream
        try:
            await self.watched(upstream.acquire(self.backend.waiting_for_start()))
        except QueueFull:
            max_held = upstream.max_waiting
            raise Unavailable(
                503,
                f"too many requests waiting for the worker (max_held = {max_held})",
                retry_after_s=1,
            ) from None
        self.slot = True

    def give_slot(self) -> None:
        """The request is over (or became a tunnel): keep its worker connection if it can
        serve another request, and pass the slot on."""
        if not self.slot:
            return
        self.slot = False
        up, self.up = self.up, None
        clean, self.up_clean = self.up_clean, False
        if up is not None:
            # Only a connection known to be between responses is kept: one left by an error
            # or a cancellation may still carry this request's answer to the next client.
            if clean and not self.up_shut:
                self.backend.upstream.keep(up, self.up_generation)
            else:
                up.close()
        self.backend.upstream.release()

    async def watched(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro`; if it has to wait, watch the client meanwhile (ClientGone) and park."""
        try:
            first = coro.send(None)
        except StopIteration as done:  # at once: the usual case, no watch needed
            result: T = done.value
            return result
        except BaseException:
            coro.close()
            raise
        self.watch(waiting=True)
        self.park()
        try:
            return await _Resume(coro, first)
        except asyncio.CancelledError:
            exc = self.aborted()
            if exc is None:
                raise
            raise exc from None
        finally:
            self.unwatch()
            self.unpark()

    def park(self) -> None:
        """About to wait for the worker, maybe for minutes: give back what can be."""

    def unpark(self) -> None:
        """The wait is over: take back what park() gave."""

    def watch_later(self) -> None:
        """Watch the client only once a response is slow to come (saves two epoll_ctl calls
        on every quick request)."""
        self._watch_timer = self.loop.call_later(WATCH_AFTER_S, self.watch, False)

    async def upstream(
        self, address: Address, generation: int, kept: bool = True
    ) -> tuple[socket.socket, bool]:
        """A connection to the worker: a kept one if still good (`kept`), else a new one."""
        up = self.up
        if up is not None:
            if generation == self.up_generation and still_open(up):
                return up, True
            self.drop_upstream()
        self.up_shut = False
        self.up_clean = False
        self.up_generation = generation
        up = self.backend.upstream.take_idle(generation) if kept else None
        if up is not None:
            self.up = up
            return up, True
        up = await _connect(self.loop, address, self.backend, generation)
        self.up = up
        return up, False

    def drop_upstream(self) -> None:
        if self.up is not None:
            self.up.close()
            self.up = None

    async def close(self) -> None:
        self.unwatch()
        self.drop_upstream()
        if self.slot:
            self.give_slot()
        await close_lingering(self.loop, self.client, self.linger and not self.client_eof)


class _Http(_Connection, HeadReader, ResponseRelay):
    peer = "worker"

    def __init__(self, client: socket.socket, backend: Backend) -> None:
        super().__init__(client, backend)
        self.begin_reading()
        self.started = False  # the final response head went to the client
        self.interim = False  # a 1xx response went to the client
        # request_timeout_s as an inactivity limit: the timer checks the last activity when
        # it fires (cheaper than moving a timer on every read and write).
        self.last_activity = 0.0
        self.inactivity: asyncio.TimerHandle | None = None
        self._parked: bytes | None = None  # buf[start:end] while waiting for the worker
        self.consumed = False  # the request body has been read from the client entirely

    def park(self) -> None:
        # A held connection keeps only its request's bytes, not a whole buffer: a cold
        # start may hold a thousand of them.
        if self.buf is not None:
            self._parked = bytes(self.buf[self.start : self.end])
            give(self.buf)
            self.buf = None

    def unpark(self) -> None:
        if self.buf is None and self._parked is not None:
            self.buf = take(HEAD_SIZE if self.end <= HEAD_SIZE else BUFFER_SIZE)
            self.buf[self.start : self.end] = self._parked  # same offsets as before
            self._parked = None

    async def run(self) -> None:
        while True:
            head_end = await self.read_head()
            if head_end < 0:
                return
            assert self.buf is not None
            try:
                request = parse_request_head(self.buf, self.start, head_end)
            except HttpError as e:
                await self.answer(e.status, {"error": e.reason}, close=True)
                return
            if not await self.request(request, head_end):
                return

    # -- the client side

    async def refuse_head(self, status: int, error: str) -> int:
        """Answer a head that cannot be read (408, 414, 431) and end the connection."""
        await self.answer(status, {"error": error}, close=True)
        return -1

    async def answer(
        self,
        status: int,
        body: Mapping[str, object],
        *,
        close: bool,
        retry_after_s: float | None = None,
        head_only: bool = False,
    ) -> bool:
        """Answer the client ourselves (logged, rate-limited). Returns whether the
        connection can go on."""
        full = {"error": body["error"], "provider": self.backend.slug, "retry_after_s": None}
        full.update(body)
        answers.log(
            str(status), "Answered a client %d: %s", status, body["error"], level=logging.WARNING
        )
        data = error_response(
            status, full, close=close, retry_after_s=retry_after_s, head_only=head_only
        )
        self.started = True
        if close:
            self.linger = True
        try:
            await self.loop.sock_sendall(self.client, data)
        except OSError:
            return False
        return not close

    # -- one request

    async def request(self, req: RequestHead, head_end: int) -> bool:
        """Serve one request whose head is buf[start:head_end]. Returns whether the client
        connection goes on."""
        assert self.buf is not None
        self.started = self.consumed = self.interim = False
        scanner: ChunkedScanner | None = None
        body_end = -1  # where the body ends in buf, if all of it is there
        if req.body == "none":
            body_end = head_end
        elif req.body == "length":
            if self.end - head_end >= req.length:
                body_end = head_end + req.length
        else:
            scanner = ChunkedScanner(strict=True)
            try:
                body_end = scanner.scan(self.buf, head_end, self.end)
            except HttpError as e:
                await self.answer(e.status, {"error": e.reason}, close=True)
                return False
        self.consumed = body_end >= 0
        try:
            lease = self.backend.lease(req.path)
        except Unavailable as e:
            return await self.unavailable(req, e, body_end)
        try:
            return await self.exchange(req, head_end, body_end, scanner)
        finally:
            lease.release()

    async def answer_request(
        self,
        req: RequestHead,
        body_end: int,
        status: int,
        body: Mapping[str, object],
        retry_after_s: float | None = None,
    ) -> bool:
        """Answer a request ourselves; the connection goes on if its body has been read."""
        close = not (req.keep_alive and self.consumed)
        if not close and body_end >= 0 and self.buf is not None and self.start < body_end:
            self.start = body_end  # skip the request's body (a pumped body already moved on)
        return await self.answer(
            status, body, close=close, retry_after_s=retry_after_s, head_only=req.method == "HEAD"
        )

    async def unavailable(self, req: RequestHead, e: Unavailable, body_end: int) -> bool:
        return await self.answer_request(
            req, body_end, e.status, e.body(self.backend.slug), e.retry_after_s
        )

    async def exchange(
        self, req: RequestHead, head_end: int, body_end: int, scanner: ChunkedScanner | None
    ) -> bool:
        try:
            await self.ready()
            await self.take_slot()
            # The worker may have been replaced while this request waited for its slot.
            address, generation = await self.ready()
        except Unavailable as e:
            self.give_slot()
            return await self.unavailable(req, e, body_end)
        except ClientGone:
            self.give_slot()
            return False
        try:
            return await self.exchange_in_slot(
                req, head_end, body_end, scanner, address, generation
            )
        finally:
            self.disarm()
            self.give_slot()

    def progress(self) -> None:
        self.last_activity = self.loop.time()

    def arm(self) -> None:
        if self.backend.request_timeout_s > 0:
            self.last_activity = now = self.loop.time()
            self.inactivity = self.loop.call_at(now + self.backend.request_timeout_s, self._check)

    def disarm(self) -> None:
        if self.inactivity is not None:
            self.inactivity.cancel()
            self.inactivity = None

    def _check(self) -> None:
        due = self.last_activity + self.backend.request_timeout_s
        if self.loop.time() < due:
            self.inactivity = self.loop.call_at(due, self._check)
            return
        self.inactivity = None
        self.abort(TimeoutError())

    async def exchange_in_slot(
        self,
        req: RequestHead,
        head_end: int,
        body_end: int,
        scanner: ChunkedScanner | None,
        address: Address,
        generation: int,
    ) -> bool:
        timeout_s = self.backend.request_timeout_s
        try:
            # An inactivity limit: progress() notes every byte either way.
            self.arm()
            try:
                return await self.forward(req, head_end, body_end, scanner, address, generation)
            except asyncio.CancelledError:
                exc = self.aborted()
                if exc is None:
                    raise
                raise exc from None
            finally:
                self.disarm()
        except TimeoutError:
            self.drop_upstream()
            what = f"no response from the worker for {timeout_s:g} s (request_timeout_s)"
            if self.started:
                answers.log("cut", "Cut a response: %s", what)
                return False
            return await self.answer_request(req, body_end, 504, {"error": what})
        except ClientTimeout as e:
            self.drop_upstream()
            if self.started:
                return False
            return await self.answer(408, {"error": str(e)}, close=True)
        except UpstreamGone as e:
            self.drop_upstream()
            if self.started:
                log.debug("Failed to relay a response: %s", e)
                return False
            why = await _why_gone(self.backend, generation)
            return await self.answer_request(
                req, body_end, 503, {"error": why or str(e)}, WORKER_GONE_RETRY_AFTER_S
            )
        except HttpError as e:
            self.drop_upstream()
            if self.started:
                log.debug("Failed to relay a response: %s", e.reason)
                return False
            return await self.answer(
                e.status, {"error": e.reason}, close=True, head_only=req.method == "HEAD"
            )
        except ClientGone:
            self.drop_upstream()
            return False

    async def forward(
        self,
        req: RequestHead,
        head_end: int,
        body_end: int,
        scanner: ChunkedScanner | None,
        address: Address,
        generation: int,
    ) -> bool:
        assert self.buf is not None
        view = memoryview(self.buf)
        if body_end >= 0:
            # The whole request is here: send it at once, watch the client meanwhile. While
            # the worker works on it (maybe for minutes) the connection holds no buffer.
            data = bytes(view[self.start : body_end])
            self.start = body_end
            self.release_buffer()
            for attempt in (1, 2):
                up, reused = await self.upstream(address, generation)
                self.watch_later()
                try:
                    try:
                        await self.loop.sock_sendall(up, data)
                    except OSError as e:
                        raise UpstreamGone(f"the worker closed the connection ({e})") from None
                    return await self.relay_response(req, up, None)
                except UpstreamGone:
                    # A reused connection the worker closed just now: try a new one, once.
                    if not (
                        reused
                        and attempt == 1
                        and not self.started
                        and not self.interim
                        and req.method in IDEMPOTENT
                    ):
                        raise
                    self.drop_upstream()
                finally:
                    self.unwatch()
            raise AssertionError("unreachable")
        # The body is still coming: a second task carries it while the response flows back
        # (Expect: 100-continue, or a worker answering before the body ends).
        up, _ = await self.upstream(address, generation)
        try:
            await self.loop.sock_sendall(up, view[self.start : self.end])
        except OSError as e:
            raise UpstreamGone(f"the worker closed the connection ({e})") from None
        pump = asyncio.create_task(self.pump_body(req, up, head_end, scanner))
        pump.add_done_callback(_retrieve)
        response = asyncio.create_task(self.relay_response(req, up, pump))
        response.add_done_callback(_retrieve)
        try:
            done, _ = await asyncio.wait((pump, response), return_when=asyncio.FIRST_COMPLETED)
            if pump in done and response not in done:
                exc = pump.exception()
                # A worker that stops reading the body may still answer (413, 401 ...).
                if exc is not None and not isinstance(exc, UpstreamGone):
                    raise exc
            return await response
        finally:
            response.cancel()
            if not pump.done():
                pump.cancel()
                self.consumed = False
                self.drop_upstream()  # part of a body went to it: never to be kept

    async def pump_body(
        self, req: RequestHead, up: socket.socket, head_end: int, scanner: ChunkedScanner | None
    ) -> None:
        """Carry the rest of the request body (buf[start:end] already went to the worker)."""
        assert self.buf is not None
        remaining = req.length - (self.end - head_end)
        self.start = self.end = 0
        if len(self.buf) < BUFFER_SIZE:  # a head's small buffer: a body wants a larger one
            give(self.buf)
            self.buf = take(BUFFER_SIZE)
        # A long Content-Length body takes a bulk buffer: nothing of the next request can
        # follow it there, since the pump never reads past the body's end.
        bulk = take(BULK_SIZE) if scanner is None and remaining > len(self.buf) else None
        try:
            await self._pump(up, bulk or self.buf, remaining, scanner)
        finally:
            if bulk is not None:
                give(bulk)

    async def _pump(
        self, up: socket.socket, buf: bytearray, remaining: int, scanner: ChunkedScanner | None
    ) -> None:
        loop = self.loop
        view = memoryview(buf)
        while True:
            limit = len(buf) if scanner is not None else min(len(buf), remaining)
            try:
                n = await recv_within(loop, self.client, view[:limit], BODY_TIMEOUT_S)
            except TimeoutError:
                raise ClientTimeout(
                    f"no byte of the request body for {BODY_TIMEOUT_S:g} s"
                ) from None
            except OSError as e:
                raise ClientGone(f"client connection failed: {e.strerror or e}") from None
            if n == 0:
                self.client_eof = True
                raise ClientGone("client closed the connection in the middle of a request body")
            last = n
            if scanner is not None:
                at = scanner.scan(buf, 0, n)
                if at >= 0:
                    last = at
            else:
                remaining -= n
            try:
                await loop.sock_sendall(up, view[:last])
            except OSError as e:
                raise UpstreamGone(f"the worker closed the connection ({e})") from None
            self.progress()
            if scanner is None and remaining == 0:
                self.consumed = True
                return
            if scanner is not None and scanner.done:
                self.start, self.end = last, n  # whatever follows is the next request
                self.consumed = True
                return

    # -- the response

    async def interim_response(self, resp: ResponseHead, head: memoryview) -> None:
        await self.send_client(head)
        self.interim = True

    async def relay_response(
        self, req: RequestHead, up: socket.socket, pump: asyncio.Task[None] | None
    ) -> bool:
        """Relay interim responses and the final one. Returns whether the client connection
        goes on."""
        loop = self.loop
        resp, reusable = await self.relay_message(up, req.method)
        if resp.body == "tunnel":
            self.disarm()  # a tunnel lives as long as its peers want
            if pump is not None:
                await pump
            if self.end > self.start:  # bytes the client sent after its head
                assert self.buf is not None
                await loop.sock_sendall(up, memoryview(self.buf)[self.start : self.end])
                self.start = self.end
            self.release_buffer()
            self.unwatch()
            self.up = None  # a tunnel's connection is its own: out of the slots, never kept
            self.give_slot()
            try:
                await _relay_both(loop, self.client, up)
            finally:
                up.close()
            self.client_eof = True
            return False
        if pump is not None and pump.done() and not pump.cancelled():
            pump.result()
        if not reusable or not resp.keep_alive or not req.keep_alive:  # it closes after
            self.drop_upstream()
        self.up_clean = self.up is not None
        keep = (
            req.keep_alive
            and resp.keep_alive
            and resp.body != "close"
            and not self.client_eof
            and (pump is None or pump.done())
            and self.consumed
        )
        if not keep:
            self.linger = True
        return keep


async def serve_http(client: socket.socket, backend: Backend) -> None:
    """Serve one accepted HTTP client connection until it ends. Never raises (except
    CancelledError when the task is cancelled); always closes `client` and releases leases."""
    client.setblocking(False)
    nodelay(client)
    conn = _Http(client, backend)
    try:
        await conn.run()
    except asyncio.CancelledError:
        if conn.aborted() is None:
            conn.linger = False
            raise
    except Exception as e:
        log.debug("Failed to relay an HTTP connection: %s", e, exc_info=True)
    finally:
        if conn.buf is not None:
            give(conn.buf)
            conn.buf = None
        await conn.close()


async def serve_tcp(client: socket.socket, backend: Backend) -> None:
    """Relay one accepted TCP client connection to the worker; the connection is one lease.
    Never raises (except CancelledError when the task is cancelled); always closes `client`."""
    client.setblocking(False)
    nodelay(client)
    conn = _Connection(client, backend)
    lease: Lease | None = None
    try:
        lease = backend.lease(None)
        address, generation = await conn.ready()
        up, _ = await conn.upstream(address, generation, kept=False)
        await _relay_both(conn.loop, client, up)
    except asyncio.CancelledError:
        if conn.aborted() is None:
            raise
    except Unavailable as e:
        log.debug("Closing a TCP connection: %s", e.error)
    except Exception as e:
        log.debug("Failed to relay a TCP connection: %s", e, exc_info=True)
    finally:
        if lease is not None:
            lease.release()
        await conn.close()
