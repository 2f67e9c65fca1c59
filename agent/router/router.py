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
import json
import logging
import os
import re
import signal
import socket
import stat
from collections.abc import Callable, Iterable, Mapping
from importlib import import_module
from typing import Any
from urllib.parse import unquote

from agent.net import counters
from agent.net.heads import HeadReader
from agent.net.http import (
    MAX_HEAD,
    ChunkedScanner,
    HttpError,
    RequestHead,
    ResponseHead,
    error_response,
    parse_request_head,
)
from agent.net.listeners import Listeners
from agent.net.origin import OriginCheck
from agent.net.proxy import IDEMPOTENT, ClientGone, ResponseRelay, UpstreamGone
from agent.net.ratelog import RateLog
from agent.net.sockio import (
    BODY_TIMEOUT_S,
    BUFFER_SIZE,
    close_lingering,
    connect,
    error_text,
    give,
    recv_within,
    still_open,
)
from agent.spec.provider import Address, Provider
from agent.spec.settings import RouterConfig

log = logging.getLogger("providerd.router")
refusals = RateLog(log)  # what the router answers by itself

MODELS_PATH = "/v1/models"
FIRST_REQUEST_GRACE_S = 5.0  # a new connection counts as busy until its first request, this long
STOP_GRACE_S = 30.0  # on SIGTERM, requests in flight get this long to finish
NAME_SHOWN_MAX = 120  # characters of a requested name shown in logs and messages
CACHE_MAX = 4096  # pattern lookups remembered
PATTERN_NAME_MAX = 256  # longer names are looked up exactly, never matched against patterns
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

assert BUFFER_SIZE >= MAX_HEAD

Notify = Callable[[str], object]


# ============================================================================ pure parts


class Refusal(Exception):
    """A request the router answers itself, with an OpenAI-style error body."""

    def __init__(
        self, status: int, message: str, code: str, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.kind = kind

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code}}


def quoted(name: str) -> str:
    """A client-chosen string as it may appear in a log line or a message: JSON-escaped
    (control characters, quotes and non-ASCII written as escapes) and cut short."""
    if len(name) > NAME_SHOWN_MAX:
        return f"{json.dumps(name[:NAME_SHOWN_MAX])}... ({len(name)} characters)"
    return json.dumps(name)


def target_address(address: Address) -> Address:
    """Where to connect for a listen address: a wildcard host means this host's loopback."""
    if address.host == "0.0.0.0":
        return Address("127.0.0.1", address.port)
    if address.host == "::":
        return Address("::1", address.port)
    return address


class Table:
    """Model name → provider. Exact names first, then patterns (full match). A name that
    patterns of two providers match is refused (409) rather than guessed: `providerctl
    check` cannot see every overlap between two regular expressions."""

    def __init__(self, providers: Iterable[Provider], created: Mapping[str, int] | None = None):
        self.providers = sorted(providers, key=lambda p: p.slug)
        self.names: dict[str, Provider] = {}
        self.patterns: list[tuple[re.Pattern[str], Provider]] = []
        self.skipped: list[str] = []  # patterns left out, with why
        for p in self.providers:
            for name in p.model_names:
                self.names.setdefault(name, p)  # collisions were refused by the manifest checks
            for pattern in p.model_patterns:
                if nested_repetition(pattern):
                    self.skipped.append(
                        f'provider "{p.slug}": pattern {quoted(pattern)} repeats a repetition '
                        "(like (a+)+), which can take exponential time on a crafted name"
                    )
                    continue
                self.patterns.append((re.compile(pattern), p))
        self.created = dict(created or {})
        self._cache: dict[str, tuple[Provider, ...]] = {}

    def matches(self, model: str) -> tuple[Provider, ...]:
        """The providers whose names or patterns take `model`: one, none, or (patterns
        only) several."""
        exact = self.names.get(model)
        if exact is not None:
            return (exact,)
        if len(model) > PATTERN_NAME_MAX:
            return ()  # bounds the cost of any one lookup: patterns see short names only
        hit = self._cache.get(model)
        if hit is None:
            found: list[Provider] = []
            for rx, p in self.patterns:
                if (not found or found[-1] is not p) and p not in found and rx.fullmatch(model):
                    found.append(p)
            hit = tuple(found)
            if len(self._cache) >= CACHE_MAX:
                self._cache.clear()
            self._cache[model] = hit
        return hit

    def lookup(self, model: str) -> Provider:
        """The provider that serves `model`. Raises Refusal (404, or 409 when ambiguous)."""
        found = self.matches(model)
        if len(found) == 1:
            return found[0]
        if not found:
            raise Refusal(
                404,
                f"The model {quoted(model)} does not exist: no provider serves it "
                f"(GET {MODELS_PATH} lists the model names)",
                "model_not_found",
            )
        who = ", ".join(f'"{p.slug}"' for p in found)
        raise Refusal(
            409,
            f"The model {quoted(model)} is matched by patterns of several providers ({who}); "
            "narrow their [models] patterns so that one provider serves it",
            "model_ambiguous",
        )

    def entry(self, name: str, provider: Provider) -> dict[str, object]:
        return {
            "id": name,
            "object": "model",
            "created": self.created.get(provider.slug, 0),
            "owned_by": provider.slug,
        }

    def listing(self) -> dict[str, object]:
        """`GET /v1/models`: every exact name, in OpenAI's list format."""
        return {"object": "list", "data": [self.entry(n, p) for n, p in self.names.items()]}


# The regular expression parser's own tree (untyped, private, stable since 3.11).
re_parser: Any = import_module("re._parser")
re_constants: Any = import_module("re._constants")


def nested_repetition(pattern: str) -> bool:
    """A repetition inside a repetition (`(a+)+`, `(x*y?)*`): the shape whose backtracking
    grows exponentially with the subject's length."""
    try:
        tree = re_parser.parse(pattern)
    except re.error:
        return False

    def walk(items: Iterable[tuple[Any, Any]], inside: bool) -> bool:
        for op, arg in items:
            if op in (re_constants.MAX_REPEAT, re_constants.MIN_REPEAT):
                low, high, sub = arg
                varies = high is re_constants.MAXREPEAT or high != low
                if varies and inside:
                    return True
                unbounded = high is re_constants.MAXREPEAT or high > 1
                if walk(sub, inside or unbounded):
                    return True
            elif (op == re_constants.SUBPATTERN and walk(arg[-1], inside)) or (
                op == re_constants.BRANCH and any(walk(b, inside) for b in arg[1])
            ):
                return True
        return False

    return walk(tree, False)


def dechunk(buf: bytes | bytearray, start: int, end: int) -> bytes:
    """The data of the complete chunked body in buf[start:end] (framing already checked by
    ChunkedScanner): chunk extensions and trailers dropped."""
    out = bytearray()
    pos = start
    while pos < end:
        nl = buf.index(b"\n", pos, end)
        size = int(bytes(buf[pos:nl]).split(b";", 1)[0].strip(b" \t\r"), 16)
        pos = nl + 1
        if size == 0:
            break
        out += buf[pos : pos + size]
        pos = buf.index(b"\n", pos + size, end) + 1
    return bytes(out)


def model_of(body: bytes | bytearray) -> str:
    """The top-level `model` of a JSON request body. Raises Refusal(400)."""
    if not body or body.isspace():
        raise Refusal(
            400,
            'The request has no body; the router routes by the "model" field of a JSON body',
            "missing_model",
        )
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        raise Refusal(
            400,
            'The request body is not valid JSON; the router routes by its "model" field',
            "invalid_json",
        ) from None
    if not isinstance(doc, dict):
        raise Refusal(
            400,
            'The request body is not a JSON object; the router routes by its "model" field',
            "invalid_json",
        )
    model = doc.get("model")
    if model is None:
        raise Refusal(400, 'The request body has no "model" field', "missing_model")
    if not isinstance(model, str) or not model:
        raise Refusal(400, 'The request body\'s "model" is not a non-empty string', "invalid_model")
    return model


# ============================================================================ one client connection


class _Client(HeadReader, ResponseRelay):
    peer = "provider"

    def __init__(self, router: Router, client: socket.socket) -> None:
        self.router = router
        self.client = client
        self.loop = asyncio.get_running_loop()
        self.task: asyncio.Task[None]  # set by the router as it starts serving the connection
        self.linger = False
        self.up: socket.socket | None = None
        self.up_slug = ""
        self.continued = False  # the router sent `100 Continue` for this request
        self.started = False  # the final response head went to the client
        self.gone = False  # the watch saw the client go away
        self._watching = False
        self.label = ("", "")  # (provider, model) of the request being served, for counting
        self.begin_reading()

    # -- the loop

    async def run(self) -> None:
        while True:
            head_end = await self.read_head()
            if head_end < 0:
                return
            self.router.begin(self)
            try:
                keep = await self.request(head_end)
            finally:
                self.router.end(self)
            if not keep:
                return

    async def refuse_head(self, status: int, error: str) -> int:
        codes = {408: "request_timeout", 414: "head_too_large", 431: "head_too_large"}
        await self.refuse(None, Refusal(status, error, codes.get(status, "invalid_request")), True)
        return -1

    async def recv_client(self) -> None:
        """Read more of the request into buf[end:], which has room. Raises ClientGone."""
        assert self.buf is not None
        try:
            n = await recv_within(
                self.loop, self.client, memoryview(self.buf)[self.end :], BODY_TIMEOUT_S
            )
        except TimeoutError:
            raise Refusal(
                408, f"No byte of the request body for {BODY_TIMEOUT_S:g} s", "request_timeout"
            ) from None
        except OSError as e:
            raise ClientGone(f"client connection failed: {e.strerror or e}") from None
        if n == 0:
            self.client_eof = True
            raise ClientGone("client closed the connection in the middle of a request body")
        self.end += n

    def room(self, need: int) -> None:
        """Make buf hold at least `need` bytes from `start` (moving or growing it)."""
        assert self.buf is not None
        buf = self.buf
        if len(buf) - self.start >= need:
            return
        pending = self.end - self.start
        if len(buf) >= need:
            buf[:pending] = buf[self.start : self.end]
        else:
            bigger = bytearray(max(need, 2 * len(buf)))
            bigger[:pending] = buf[self.start : self.end]
            give(buf)
            self.buf = bigger
        self.start, self.end = 0, pending

    async def read_body(self, req: RequestHead, head_end: int) -> int:
        """Read the whole body; returns where it ends in buf (head_end may move: it is kept
        relative to `start`). Raises Refusal(413), HttpError, ClientGone."""
        assert self.buf is not None
        max_body = self.router.config.max_body
        head_len = head_end - self.start
        if req.body == "none":
            return head_end
        if req.body == "length":
            need = head_len + req.length
            if self.end - self.start < need:
                await self.send_continue(req)
                while self.end - self.start < need:
                    # Grow with what arrives, never by what the head claims.
                    if self.end == len(self.buf):
                        self.room(min(need, 2 * (self.end - self.start)))
                    await self.recv_client()
            return self.start + need
        scanner = ChunkedScanner(strict=True)
        at = scanner.scan(self.buf, head_end, self.end)
        while at < 0:
            if self.end - self.start - head_len > max_body:
                raise self.too_large()
            if self.end == len(self.buf):
                self.room(min(2 * len(self.buf), head_len + max_body + BUFFER_SIZE))
            await self.send_continue(req)
            before = self.end
            await self.recv_client()
            at = scanner.scan(self.buf, before, self.end)
        if at - self.start - head_len > max_body:
            raise self.too_large()
        return at

    def too_large(self) -> Refusal:
        limit = self.router.config.max_body
        return Refusal(
            413,
            f"The request body is larger than the router's limit of {limit} bytes "
            "([router] max_body in providerd.toml)",
            "request_too_large",
        )

    async def send_continue(self, req: RequestHead) -> None:
        if req.expect_continue and req.version == 11 and not self.continued:
            self.continued = True
            await self.send_client(CONTINUE)

    # -- one request

    async def request(self, head_end: int) -> bool:
        """Serve the request whose head is buf[start:head_end]. Returns whether the
        connection goes on."""
        assert self.buf is not None
        self.continued = self.started = False
        self.label = ("", "")
        try:
            req = parse_request_head(memoryview(self.buf)[self.start : head_end])
        except HttpError as e:
            return await self.refuse(None, Refusal(e.status, e.reason, "invalid_request"), True)
        if req.upgrade:
            refusal = Refusal(
                501,
                "The router does not forward CONNECT or protocol upgrades; "
                "use the provider's own address",
                "not_implemented",
            )
            return await self.refuse(req, refusal, close=True)
        refused = self.router.origin.check(req)
        if refused is not None:
            return await self.refuse(req, Refusal(*refused), close=True)
        if req.body == "length" and req.length > self.router.config.max_body:
            return await self.refuse(req, self.too_large(), close=True)
        head_len = head_end - self.start
        try:
            body_end = await self.read_body(req, head_end)
        except Refusal as r:
            return await self.refuse(req, r, close=True)
        except HttpError as e:
            return await self.refuse(req, Refusal(e.status, e.reason, "invalid_request"), True)
        except ClientGone:
            return False
        head_end = self.start + head_len
        try:
            provider = self.route(req, head_end, body_end)
        except Refusal as r:
            self.start = body_end
            return await self.refuse(req, r, close=not req.keep_alive)
        if provider is None:  # answered here (GET /v1/models)
            return await self.local(req, body_end)
        return await self.forward(req, provider, body_end)

    def route(self, req: RequestHead, head_end: int, body_end: int) -> Provider | None:
        """The provider for this request, or None for the router's own endpoints."""
        path = req.path
        if req.method in ("GET", "HEAD") and (
            path == MODELS_PATH or path.startswith(MODELS_PATH + "/")
        ):
            return None
        assert self.buf is not None
        if req.body == "chunked":
            body = dechunk(self.buf, head_end, body_end)
        else:
            body = bytes(memoryview(self.buf)[head_end:body_end])
        model = model_of(body)
        provider = self.router.table.lookup(model)
        self.label = (provider.slug, model if model in self.router.table.names else "")
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "Routing %s %s for model %s to %s",
                req.method,
                quoted(req.target),
                quoted(model),
                provider.slug,
            )
        return provider

    async def local(self, req: RequestHead, body_end: int) -> bool:
        """`GET /v1/models` and `GET /v1/models/<name>`."""
        self.start = body_end
        table = self.router.table
        path = req.path
        if path in (MODELS_PATH, MODELS_PATH + "/"):
            doc: Mapping[str, object] = table.listing()
        else:
            name = unquote(path[len(MODELS_PATH) + 1 :])
            try:
                provider = table.lookup(name)
            except Refusal as r:
                return await self.refuse(req, r, close=not req.keep_alive)
            doc = table.entry(name, provider)
        data = error_response(200, doc, close=not req.keep_alive, head_only=req.method == "HEAD")
        self.router.count("", "", 200)
        await self.send_client(data)
        if not req.keep_alive:
            self.linger = True
        return req.keep_alive

    async def refuse(self, req: RequestHead | None, refusal: Refusal, close: bool) -> bool:
        """Answer a refusal; log it at info level, rate-limited per status. Returns whether
        the connection goes on."""
        what = f"{req.method} {quoted(req.target)}" if req is not None else "a request"
        refusals.log(
            str(refusal.status),
            "Refused %s: %d %s",
            what,
            refusal.status,
            refusal.message,
            level=logging.INFO,
        )
        self.router.count(*self.label, refusal.status)
        head_only = req is not None and req.method == "HEAD"
        data = error_response(refusal.status, refusal.body(), close=close, head_only=head_only)
        if close:
            self.linger = True
        try:
            await self.loop.sock_sendall(self.client, data)
        except OSError:
            return False
        return not close

    # -- forwarding

    async def upstream(self, provider: Provider) -> tuple[socket.socket, bool]:
        """A connection to the provider: the previous one if still good, else a new one."""
        if self.up is not None:
            if self.up_slug == provider.slug and still_open(self.up):
                return self.up, True
            self.drop_upstream()
        address = target_address(provider.addresses[0])
        try:
            sock = await connect(self.loop, address)
        except OSError as e:
            raise Refusal(
                503,
                f'Failed to reach provider "{provider.slug}" at {address}: {error_text(e)}'
                + self.router.unreachable_hint(provider),
                "provider_unavailable",
                "server_error",
            ) from None
        self.up, self.up_slug = sock, provider.slug
        return sock, False

    def drop_upstream(self) -> None:
        if self.up is not None:
            self.up.close()
            self.up = None

    async def forward(self, req: RequestHead, provider: Provider, body_end: int) -> bool:
        assert self.buf is not None
        request_start = self.start
        data = memoryview(self.buf)[request_start:body_end]
        try:
            for attempt in (1, 2):
                up, reused = await self.upstream(provider)
                self.watch()
                try:
                    try:
                        await self.loop.sock_sendall(up, data)
                    except OSError as e:
                        raise UpstreamGone(f"the provider closed the connection ({e})") from None
                    self.start = body_end
                    return await self.relay(req, up)
                except UpstreamGone:
                    # A kept connection the provider closed just now: try a new one, once.
                    if not (reused and attempt == 1 and not self.started):
                        raise
                    if req.method not in IDEMPOTENT and self.start == body_end:
                        raise  # the provider may have received the request: do not repeat it
                    self.start = request_start
                    self.drop_upstream()
                finally:
                    self.unwatch()
            raise AssertionError("unreachable")
        except asyncio.CancelledError:
            if not self.gone:
                raise
            self.task.uncancel()
            self.drop_upstream()
            return False
        except Refusal as r:
            self.start = body_end
            return await self.refuse(req, r, close=not req.keep_alive)
        except (UpstreamGone, HttpError) as e:
            self.drop_upstream()
            reason = e.reason if isinstance(e, HttpError) else str(e)
            if self.started:
                log.debug("Failed to relay a response from %s: %s", provider.slug, reason)
                return False
            self.start = body_end
            refusal = Refusal(
                502,
                f'Failed to get an answer from provider "{provider.slug}": {reason}',
                "bad_gateway",
                "server_error",
            )
            return await self.refuse(req, refusal, close=True)
        except ClientGone:
            self.drop_upstream()
            return False

    # The watch: while the router waits on the provider, a readable client socket means
    # EOF, an error, or the next pipelined request. Only the first two matter.

    def watch(self) -> None:
        if not self._watching and not self.client_eof:
            self.loop.add_reader(self.client.fileno(), self._client_readable)
            self._watching = True

    def unwatch(self) -> None:
        if self._watching:
            self.loop.remove_reader(self.client.fileno())
            self._watching = False

    def _client_readable(self) -> None:
        try:
            data = self.client.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        self.unwatch()
        if data:
            return
        self.client_eof = True
        if not self.gone:
            self.gone = True
            self.task.cancel()

    async def interim_response(self, resp: ResponseHead, head: memoryview) -> None:
        if not (resp.status == 100 and self.continued):
            await self.send_client(head)

    def final_head(self, resp: ResponseHead) -> None:
        if resp.body == "tunnel":
            raise HttpError(502, "the provider switched protocols, which is not routed")

    async def relay(self, req: RequestHead, up: socket.socket) -> bool:
        """Relay the provider's interim responses and its final one. Returns whether the
        client connection goes on."""
        resp, reusable = await self.relay_message(up, req.method)
        self.router.count(*self.label, resp.status)
        if not reusable or not resp.keep_alive or not req.keep_alive:
            self.drop_upstream()
        keep = req.keep_alive and resp.keep_alive and resp.body != "close" and not self.client_eof
        if not keep:
            self.linger = True
        return keep

    async def close(self) -> None:
        self.unwatch()
        self.drop_upstream()
        if self.buf is not None:
            give(self.buf)
            self.buf = None
        await close_lingering(self.loop, self.client, self.linger and not self.client_eof)


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
    ) -> None:
        self.table = table
        self.config = config
        self.listeners = listeners
        self.exit_on_idle = exit_on_idle
        self.notify = notify
        self.systemd = systemd
        self.busy = 0  # requests in flight, plus new connections within their grace
        self.routed = 0
        self.done = asyncio.Event()
        self.listening = Listeners(listeners, self._connection, log)
        self.origin = OriginCheck(config.addresses)
        self._idle_timer: asyncio.TimerHandle | None = None
        self._fresh: dict[_Client, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.counters = counters.load_router()  # where the last router left off
        self._flush_timer: asyncio.TimerHandle | None = None

    def count(self, provider: str, model: str, status: int) -> None:
        """One answered request (`providerd_router_requests_total`), saved within 5 s."""
        self.counters.count(provider, model, status)
        if self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(
                counters.ROUTER_FLUSH_S, self.flush
            )

    def flush(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        counters.save_router(self.counters, log)

    def unreachable_hint(self, provider: Provider) -> str:
        if self.systemd:
            return f"; is provider@{provider.slug}.socket started?"
        return ""

    # -- accepting

    def start_accepting(self) -> None:
        self.listening.start()
        self._arm_idle()

    def stop_accepting(self) -> None:
        self.listening.stop()

    def _connection(self, conn: socket.socket) -> None:
        # Counted in the accept callback itself: an idle exit decided in this same turn
        # of the loop must see the connection, or it would cut it before its request.
        client = _Client(self, conn)
        self._busy(+1)
        self._fresh[client] = asyncio.get_running_loop().call_later(
            FIRST_REQUEST_GRACE_S, self._grace_over, client
        )
        task = client.task = asyncio.get_running_loop().create_task(self._serve(client))
        self._tasks.add(task)
        task.add_done_callback(self._connection_done)

    def _connection_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self.listening.closed()

    async def _serve(self, client: _Client) -> None:
        try:
            await client.run()
        except asyncio.CancelledError:
            if not client.gone:
                client.linger = False
                raise
            client.task.uncancel()
        except Exception as e:
            log.debug("Failed to serve a connection: %s", e, exc_info=True)
        finally:
            self._grace_over(client)
            await client.close()

    # -- what is in flight

    def _grace_over(self, client: _Client) -> None:
        timer = self._fresh.pop(client, None)
        if timer is not None:
            timer.cancel()
            self._busy(-1)

    def begin(self, client: _Client) -> None:
        """A request head arrived on `client`."""
        timer = self._fresh.pop(client, None)
        if timer is not None:
            timer.cancel()  # the connection's grace becomes its first request
        else:
            self._busy(+1)

    def end(self, client: _Client) -> None:
        self.routed += 1
        self._busy(-1)

    def _busy(self, delta: int) -> None:
        self.busy += delta
        if self.busy == 0:
            self._arm_idle()
        elif self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _arm_idle(self) -> None:
        if not self.exit_on_idle or not self.listening.accepting:
            return
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = asyncio.get_running_loop().call_later(
            self.config.idle_timeout_s, self._idle
        )

    def _idle(self) -> None:
        self._idle_timer = None
        if self.busy == 0:
            self.release(f"Idle for {self.config.idle_timeout_s:g} s, exiting")

    # -- the end

    def release(self, reason: str) -> None:
        """Stop for good: stop accepting, say STOPPING, end idle connections, set `done`."""
        if self.done.is_set():
            return
        log.info("%s", reason)
        self.stop_accepting()
        self.notify(f"STOPPING=1\nSTATUS={reason}")
        for task in list(self._tasks):
            task.cancel()
        self.flush()
        self.done.set()

    async def stop(self, grace_s: float) -> None:
        """SIGTERM: stop accepting, let requests in flight finish within `grace_s`, release."""
        self.stop_accepting()
        deadline = asyncio.get_running_loop().time() + grace_s
        while self.busy - len(self._fresh) > 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        self.release("Stopping on request")

    async def close(self) -> None:
        """Foreground: stop accepting, end every connection, wait for them."""
        self.stop_accepting()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.flush()
        self.done.set()


# ============================================================================ starting it


def table_from(providers: Iterable[Provider]) -> Table:
    """The routing table, with each manifest's modification time as its models' `created`."""
    providers = list(providers)
    created: dict[str, int] = {}
    for p in providers:
        with contextlib.suppress(OSError):
            created[p.slug] = int(p.source.stat().st_mtime)
    return Table(providers, created)


def discover_table() -> Table:
    """The table from the manifest directories; invalid manifests are logged and left out."""
    from agent.spec.manifest import discover

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


class RouterError(Exception):
    """The router cannot start; the message says why."""


def foreground(
    providers: list[Provider], bind: Callable[[Address], socket.socket]
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
    router = Router(table_from(providers), config.router, listeners, exit_on_idle=False)
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
    from agent.spec.settings import ROUTER_SOCKET, ConfigError, load
    from agent.systemd.activation import inherited_listeners
    from agent.systemd.notify import notify

    try:
        config = load()
    except ConfigError as e:
        for problem in e.problems:
            log.error("Failed to load settings: %s", problem)
        return 1
    table = discover_table()
    router = Router(
        table,
        config.router,
        inherited_listeners(ROUTER_SOCKET),
        exit_on_idle=True,
        notify=notify,
        systemd=True,
    )
    router.start_accepting()
    notify("READY=1\nSTATUS=Routing requests by model")
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    def stop() -> None:
        if not stopping:
            stopping.append(loop.create_task(router.stop(STOP_GRACE_S)))

    loop.add_signal_handler(signal.SIGTERM, stop)

    def reload() -> None:
        router.table = discover_table()

    loop.add_signal_handler(signal.SIGHUP, reload)
    await router.done.wait()
    # Connections were cancelled: let them close before the loop goes.
    await asyncio.sleep(0)
    return 0


def main(argv: list[str]) -> int:
    from agent.log import setup

    if argv:
        print("usage: python3 -m agent.router", flush=True)
        return 2
    setup(journal=True, verbose=True)  # routed requests are logged at debug level
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(run_systemd())
    return 0
