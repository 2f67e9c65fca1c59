"""The router on real loopback sockets: what a client sends reaches the right provider
byte for byte, and what the provider answers comes back as it is produced.

The providers here are small threads that record every request's raw bytes and answer
it; the router runs on its own event loop in a thread. Nothing waits on a timer to
decide an outcome: the streaming test hands over with events.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.rawhttp import RawClient, Reader, Request, read_request

from agent.net import counters, ratelog, sockio
from agent.router import router as router_module
from agent.router.router import Router, Table
from agent.spec.apikeys import ApiKey, KeySet
from agent.spec.provider import Address, Provider
from agent.spec.settings import RouterConfig

Answer = Callable[[socket.socket, bytes], None]


def ok_answer(name: str) -> Answer:
    def answer(conn: socket.socket, request: bytes) -> None:
        body = json.dumps({"provider": name, "bytes": len(request)}).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    return answer


class FakeProvider:
    """A provider's listen address: records each request (head and body, raw) and answers."""

    def __init__(self, name: str, answer: Answer | None = None, continue_first: bool = False):
        self.name = name
        self.answer = answer or ok_answer(name)
        self.continue_first = continue_first
        self.requests: list[bytes] = []
        self.connections = 0
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = Reader(conn)

        def interim(head: Request) -> None:
            if head.expect_continue and self.continue_first:
                conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")

        with conn:
            while (request := read_request(reader, interim)) is not None:
                self.requests.append(request.raw)
                self.answer(conn, request.raw)
                if not request.keep_alive:
                    return

    def provider(self, names: tuple[str, ...] = (), patterns: tuple[str, ...] = ()) -> Provider:
        return Provider(
            slug=self.name,
            source=Path(f"/etc/providerd/providers/{self.name}.toml"),
            addresses=(Address("127.0.0.1", self.port),),
            model_names=names,
            model_patterns=patterns,
        )

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread; stops listening
        self.listener.close()


class RunningRouter:
    def __init__(
        self,
        providers: list[Provider],
        config: RouterConfig,
        exit_on_idle: bool,
        keys: KeySet | None = None,
    ):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.notified: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.router: Router | None = None
        self.thread = threading.Thread(
            target=self._run, args=(providers, config, exit_on_idle, keys), daemon=True
        )
        self.thread.start()
        assert self.ready.wait(5)

    def _run(
        self,
        providers: list[Provider],
        config: RouterConfig,
        exit_on_idle: bool,
        keys: KeySet | None,
    ) -> None:
        async def main() -> None:
            self.router = Router(
                Table(providers),
                config,
                [self.listener],
                exit_on_idle=exit_on_idle,
                notify=self.notified.append,
                keys=keys,
            )
            self.router.start_accepting()
            self.ready.set()
            await self.router.done.wait()
            await asyncio.sleep(0)

        self.loop.run_until_complete(main())

    def stop(self) -> None:
        if self.thread.is_alive():
            router = self.router
            assert router is not None
            asyncio.run_coroutine_threadsafe(router.close(), self.loop).result(5)
            self.thread.join(5)
        self.loop.close()


@pytest.fixture
def alpha() -> Iterator[FakeProvider]:
    p = FakeProvider("alpha", continue_first=True)
    yield p
    p.close()


@pytest.fixture
def beta() -> Iterator[FakeProvider]:
    p = FakeProvider("beta")
    yield p
    p.close()


@pytest.fixture
def start() -> Iterator[Callable[..., RunningRouter]]:
    running: list[RunningRouter] = []

    def make(
        *providers: Provider,
        max_body: int = 1 << 20,
        idle: float = 600,
        exit_on_idle: bool = False,
        keys: KeySet | None = None,
        log_requests: bool = False,
    ) -> RunningRouter:
        config = RouterConfig(
            enabled=True, max_body=max_body, idle_timeout_s=idle, log_requests=log_requests
        )
        r = RunningRouter(list(providers), config, exit_on_idle, keys)
        running.append(r)
        return r

    yield make
    for r in running:
        r.stop()


@pytest.fixture
def two(
    start: Callable[..., RunningRouter], alpha: FakeProvider, beta: FakeProvider
) -> RunningRouter:
    return start(alpha.provider(names=("a-1", "a-2")), beta.provider(patterns=("b-.*",)))


# -- a raw HTTP client ---------------------------------------------------------------------


_clients: list[socket.socket] = []


@pytest.fixture(autouse=True)
def close_clients() -> Iterator[None]:
    yield
    while _clients:
        _clients.pop().close()


class Client(RawClient):
    """A raw client (tests/support/rawhttp.py: not the product's parser), closed after the test."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        _clients.append(self.sock)


def post(model: str, path: str = "/v1/chat/completions", extra: bytes = b"") -> bytes:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    return (
        b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n%s"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), extra, len(body), body)
    )


def error(body: bytes) -> dict[str, str]:
    doc = json.loads(body)
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "code"}, doc
    return dict(doc["error"])


# -- routing -------------------------------------------------------------------------------


def test_each_model_reaches_its_provider_byte_for_byte(
    two: RunningRouter, alpha: FakeProvider, beta: FakeProvider
) -> None:
    c = Client(two.port)
    sent = [post("a-1"), post("b-7", "/v1/messages"), post("a-2", "/v1/embeddings")]
    for request in sent:
        c.send(request)
        assert c.response()[0] == 200
    assert alpha.requests == [sent[0], sent[2]]
    assert beta.requests == [sent[1]]
    c.close()


def test_a_chunked_body_is_routed_and_forwarded_as_sent(
    two: RunningRouter, alpha: FakeProvider
) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = b'4;x=y\r\n{"mo\r\n8\r\ndel": "a\r\n4\r\n-1"}\r\n0\r\nX-Trailer: 1\r\n\r\n'
    c = Client(two.port)
    c.send(head + body[:10])
    time.sleep(0.05)  # the router waits for the rest; nothing is decided by this pause
    c.send(body[10:])
    assert c.response()[0] == 200
    assert alpha.requests == [head + body]


def test_expect_100_continue_is_answered_once_before_the_body(
    two: RunningRouter, alpha: FakeProvider
) -> None:
    request = post("a-1", extra=b"Expect: 100-continue\r\n")
    end = request.index(b"\r\n\r\n") + 4
    c = Client(two.port)
    c.send(request[:end])
    status, _, _ = c.response()
    assert status == 100  # from the router: it needs the body to route
    c.send(request[end:])
    status, _, body = c.response()
    assert status == 200, "the provider's own 100 Continue must not reach the client again"
    assert json.loads(body)["provider"] == "alpha"
    assert alpha.requests == [request]


def test_expect_100_continue_with_a_body_over_the_limit_is_413_without_100(
    start: Callable[..., RunningRouter], alpha: FakeProvider
) -> None:
    r = start(alpha.provider(names=("a-1",)), max_body=4096)
    c = Client(r.port)
    c.send(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
        b"Content-Length: 4097\r\n\r\n"
    )
    status, headers, body = c.response()
    assert status == 413
    assert headers["connection"] == "close"
    assert error(body)["code"] == "request_too_large"
    assert c.closed()
    assert alpha.connections == 0


def test_a_chunked_body_over_the_limit_is_413(
    start: Callable[..., RunningRouter], alpha: FakeProvider
) -> None:
    r = start(alpha.provider(names=("a-1",)), max_body=4096)
    c = Client(r.port)
    c.send(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"400\r\n" + b" " * 1024 + b"\r\n"
    c.send(piece * 8)  # 8 KiB of data, never a last chunk
    status, _, body = c.response()
    assert status == 413
    assert error(body)["code"] == "request_too_large"
    assert c.closed()
    assert alpha.connections == 0


def test_a_whole_chunked_body_over_the_limit_that_came_with_its_head_is_413(
    start: Callable[..., RunningRouter], alpha: FakeProvider
) -> None:
    # Head and whole body (last chunk included) in one segment: the body is complete as
    # the head is parsed, so no later read would check it against the limit.
    r = start(alpha.provider(names=("a-1",)), max_body=1024)
    c = Client(r.port)
    body = b'{"model": "a-1", "prompt": "' + b"x" * 2000 + b'"}'
    c.send(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    )
    status, _, answer = c.response()
    assert status == 413
    assert error(answer)["code"] == "request_too_large"
    assert alpha.connections == 0


def test_pipelined_requests_are_answered_in_order(
    two: RunningRouter, alpha: FakeProvider, beta: FakeProvider
) -> None:
    c = Client(two.port)
    requests = [post("b-1"), post("a-1"), post("nobody"), post("b-2")]
    c.send(b"".join(requests))
    answers = [c.response() for _ in requests]
    assert [a[0] for a in answers] == [200, 200, 404, 200]
    assert [json.loads(a[2]).get("provider") for a in answers] == ["beta", "alpha", None, "beta"]
    assert beta.requests == [requests[0], requests[3]]
    assert alpha.requests == [requests[1]]


def test_a_model_deep_in_a_large_body(two: RunningRouter, beta: FakeProvider) -> None:
    messages = [{"role": "user", "content": "x" * 1000} for _ in range(800)]
    body = json.dumps({"messages": messages, "model": "b-deep"}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (
            len(body),
            body,
        )
    )
    c = Client(two.port)
    for i in range(0, len(request), 100_000):
        c.send(request[i : i + 100_000])
    status, _, answer = c.response()
    assert status == 200
    assert json.loads(answer)["bytes"] == len(request)
    assert beta.requests == [request]
    c.send(post("b-small"))  # the connection goes on after a grown buffer
    assert c.response()[0] == 200
    assert beta.requests[1] == post("b-small")


def test_keep_alive_reuses_one_connection_per_provider(
    two: RunningRouter, alpha: FakeProvider
) -> None:
    c = Client(two.port)
    for _ in range(5):
        c.send(post("a-1"))
        assert c.response()[0] == 200
    assert len(alpha.requests) == 5
    assert alpha.connections == 1


# -- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"", 400, "missing_model"),
        (b"not json", 400, "invalid_json"),
        (b'{"messages": []}', 400, "missing_model"),
        (b'{"model": "gpt-4o"}', 404, "model_not_found"),
    ],
)
def test_refusals_are_openai_errors_and_the_connection_goes_on(
    two: RunningRouter,
    alpha: FakeProvider,
    beta: FakeProvider,
    body: bytes,
    status: int,
    code: str,
) -> None:
    c = Client(two.port)
    c.send(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (len(body), body)
    )
    got, headers, answer = c.response()
    assert got == status
    assert headers["content-type"] == "application/json"
    assert error(answer)["code"] == code
    c.send(post("a-1"))
    assert c.response()[0] == 200
    assert beta.connections == 0


def test_refusals_are_logged_at_info_with_the_name_escaped(
    two: RunningRouter, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh rate limit: the 404s that tests before this one caused do not count.
    monkeypatch.setattr(router_module, "refusals", router_module.RateLog(router_module.log))
    caplog.set_level(logging.DEBUG, logger="providerd.router")
    c = Client(two.port)
    c.send(post('evil"\n\x1b[31m'))
    assert c.response()[0] == 404
    c.send(post("a-1"))
    assert c.response()[0] == 200
    refused = [r for r in caplog.records if r.getMessage().startswith("Refused")]
    assert len(refused) == 1 and refused[0].levelno == logging.INFO
    assert '"evil\\"\\n\\u001b[31m"' in refused[0].getMessage()
    assert "\n" not in refused[0].getMessage() and "\x1b" not in refused[0].getMessage()
    assert not [r for r in caplog.records if r.getMessage().startswith("Routing")]


def test_routed_requests_are_logged_when_asked_for(
    start: Callable[..., RunningRouter],
    alpha: FakeProvider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`log_requests = true`: one line per routed request, at info (the router's journal
    level), with the target and the model escaped."""
    r = start(alpha.provider(names=("a-1",)), log_requests=True)
    caplog.set_level(logging.INFO, logger="providerd.router")
    c = Client(r.port)
    c.send(post("a-1"))
    assert c.response()[0] == 200
    routed = [x for x in caplog.records if x.getMessage().startswith("Routing")]
    assert len(routed) == 1 and routed[0].levelno == logging.INFO
    assert routed[0].getMessage() == 'Routing POST "/v1/chat/completions" for model "a-1" to alpha'


def test_upgrades_are_refused(two: RunningRouter) -> None:
    c = Client(two.port)
    c.send(
        b"GET /ws HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
    )
    status, _, body = c.response()
    assert status == 501
    assert "protocol upgrades" in error(body)["message"]
    assert c.closed()


def test_a_malformed_head_is_400(two: RunningRouter) -> None:
    c = Client(two.port)
    c.send(
        b"POST /x HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 1, 2\r\n\r\n"
    )
    assert c.response()[0] == 400
    assert c.closed()


def test_a_provider_that_does_not_listen_is_503(
    start: Callable[..., RunningRouter], alpha: FakeProvider
) -> None:
    gone = FakeProvider("gone")
    gone.close()
    r = start(gone.provider(names=("g",)), alpha.provider(names=("a-1",)))
    c = Client(r.port)
    c.send(post("g"))
    status, _, body = c.response()
    assert status == 503
    e = error(body)
    assert e["type"] == "server_error" and e["code"] == "provider_unavailable"
    assert 'Failed to reach provider "gone" at 127.0.0.1:' in e["message"]
    c.send(post("a-1"))
    assert c.response()[0] == 200


def test_a_provider_that_closes_without_answering_is_502(
    start: Callable[..., RunningRouter],
) -> None:
    def hang_up(conn: socket.socket, request: bytes) -> None:
        conn.shutdown(socket.SHUT_RDWR)

    rude = FakeProvider("rude", answer=hang_up)
    r = start(rude.provider(names=("r",)))
    c = Client(r.port)
    c.send(post("r"))
    status, _, body = c.response()
    assert status == 502
    assert "closed the connection before answering" in error(body)["message"]
    rude.close()


# -- the router's own answers ----------------------------------------------------------------


def test_models_are_listed_without_touching_a_provider(
    two: RunningRouter, alpha: FakeProvider, beta: FakeProvider
) -> None:
    c = Client(two.port)
    c.send(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
    status, _, body = c.response()
    assert status == 200
    doc = json.loads(body)
    assert doc["object"] == "list"
    assert [(m["id"], m["owned_by"], m["object"]) for m in doc["data"]] == [
        ("a-1", "alpha", "model"),
        ("a-2", "alpha", "model"),
    ]
    c.send(b"GET /v1/models/b-anything HTTP/1.1\r\nHost: localhost\r\n\r\n")
    status, _, body = c.response()
    assert (status, json.loads(body)["owned_by"]) == (200, "beta")
    c.send(b"GET /v1/models/nope%0A HTTP/1.1\r\nHost: localhost\r\n\r\n")
    status, _, body = c.response()
    assert status == 404 and '"nope\\n"' in error(body)["message"]
    c.send(
        b"HEAD /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n"
    )
    head = c.reader.head()  # a HEAD answer has no body: the next bytes are the next response
    assert head is not None and head.startswith(b"HTTP/1.1 200 OK\r\n")
    status, _, body = c.response()
    assert status == 200 and json.loads(body)["object"] == "list"
    assert alpha.connections == 0 and beta.connections == 0


# -- streaming -----------------------------------------------------------------------------


def test_a_streamed_response_passes_through_as_it_is_produced(
    start: Callable[..., RunningRouter],
) -> None:
    first_seen = threading.Event()

    def stream(conn: socket.socket, request: bytes) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        event = b'data: {"token": "one"}\n\n'
        conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
        assert first_seen.wait(10), "the first event never reached the client"
        event = b"data: [DONE]\n\n"
        conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))

    sse = FakeProvider("sse", answer=stream)
    r = start(sse.provider(names=("s",)))
    c = Client(r.port)
    c.send(post("s"))
    while b'data: {"token": "one"}' not in c.reader.buf:
        assert c.reader.fill()
    first_seen.set()
    status, headers, body = c.response()
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert body == b'data: {"token": "one"}\n\ndata: [DONE]\n\n'
    sse.close()


# -- idling out ------------------------------------------------------------------------------


def test_it_exits_when_idle_but_not_while_a_request_is_in_flight(
    start: Callable[..., RunningRouter],
) -> None:
    release = threading.Event()

    def slow(conn: socket.socket, request: bytes) -> None:
        assert release.wait(10)
        ok_answer("slow")(conn, request)

    p = FakeProvider("slow", answer=slow)
    r = start(p.provider(names=("s",)), idle=0.2, exit_on_idle=True)
    c = Client(r.port)
    c.send(post("s"))
    time.sleep(0.6)  # three idle timeouts while the request is in flight
    assert r.thread.is_alive()
    release.set()
    assert c.response()[0] == 200
    r.thread.join(5)
    assert not r.thread.is_alive(), "the router did not exit once idle"
    assert any(n.startswith("STOPPING=1") for n in r.notified)
    with pytest.raises(OSError):
        r.listener.getsockname()  # its copy of the listener is closed
    p.close()


def test_the_idle_time_counts_from_the_last_request(
    start: Callable[..., RunningRouter], alpha: FakeProvider
) -> None:
    """The idle timer is armed once and moved lazily: a request in its last part puts the
    exit off by a whole `idle_timeout_s` from that request's end."""
    r = start(alpha.provider(names=("a-1",)), idle=1.0, exit_on_idle=True)
    c = Client(r.port)
    c.send(post("a-1"))
    assert c.response()[0] == 200
    time.sleep(0.6)
    c.send(post("a-1"))
    assert c.response()[0] == 200
    time.sleep(0.6)  # 1.2 s after the first request, 0.6 s after the second
    assert r.thread.is_alive(), "the router exited idle_timeout_s after an earlier request"
    r.thread.join(5)
    assert not r.thread.is_alive(), "the router did not exit once idle"


@pytest.mark.parametrize("others", [0, 2])
def test_a_new_connections_first_request_takes_over_its_grace(
    start: Callable[..., RunningRouter], alpha: FakeProvider, others: int
) -> None:
    """A fresh connection counts as busy for FIRST_REQUEST_GRACE_S (5 s) or until its first
    request: once that request is answered, the router is idle at once, the connection
    kept open or not. With `others` connections that sent their requests before it (no
    longer fresh, nothing in flight), it is the new one's grace that ends."""
    r = start(alpha.provider(names=("a-1",)), idle=0.2, exit_on_idle=True)
    earlier = [Client(r.port) for _ in range(others)]
    for c in earlier:
        c.send(post("a-1"))
        assert c.response()[0] == 200
    c = Client(r.port)
    c.send(post("a-1"))
    assert c.response()[0] == 200
    r.thread.join(2.5)  # well within the 5 s the grace would have held it
    assert not r.thread.is_alive(), "the first request did not end the connection's grace"


# -- what a web page could send ------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "status", "code"),
    [
        (b"Host: evil.example\r\nContent-Type: application/json\r\n", 403, "forbidden_host"),
        (
            b"Host: localhost\r\nOrigin: http://evil.example\r\nContent-Type: application/json\r\n",
            403,
            "forbidden_origin",
        ),
        (
            b"Host: localhost\r\nOrigin: null\r\nContent-Type: application/json\r\n",
            403,
            "forbidden_origin",
        ),
        (b"Host: localhost\r\nContent-Type: text/plain\r\n", 415, "unsupported_media_type"),
        (
            b"Host: localhost\r\nContent-Type: application/x-www-form-urlencoded\r\n",
            415,
            "unsupported_media_type",
        ),
        (b"Host: localhost\r\n", 415, "unsupported_media_type"),
    ],
)
def test_what_a_web_page_could_send_is_refused(
    two: RunningRouter, beta: FakeProvider, extra: bytes, status: int, code: str
) -> None:
    body = b'{"model": "b-x"}'
    c = Client(two.port)
    c.send(b"POST /v1/x HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s" % (extra, len(body), body))
    got, _, answer = c.response()
    assert (got, error(answer)["code"]) == (status, code)
    assert beta.requests == []


@pytest.mark.parametrize(
    "extra",
    [
        b"Host: 127.0.0.1:8100\r\nContent-Type: application/json; charset=utf-8\r\n",
        b"Host: [::1]:8100\r\nOrigin: http://localhost:3000\r\nContent-Type: application/json\r\n",
        b"Host: app.localhost\r\nContent-Type: application/vnd.api+json\r\n",
    ],
)
def test_local_hosts_and_json_bodies_are_routed(
    two: RunningRouter, beta: FakeProvider, extra: bytes
) -> None:
    body = b'{"model": "b-x"}'
    c = Client(two.port)
    c.send(b"POST /v1/x HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s" % (extra, len(body), body))
    assert c.response()[0] == 200


# -- what a client may take ----------------------------------------------------------------


def test_a_claimed_content_length_costs_only_what_arrives(
    start: Callable[..., RunningRouter], beta: FakeProvider
) -> None:
    """Regression: the router allocated the claimed Content-Length at once: 12 requests of
    75 bytes claiming 16 MB each took it from 26 to 218 MiB."""
    r = start(beta.provider(patterns=("b-.*",)), max_body=16 << 20)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        clients = []
        for _ in range(12):
            c = Client(r.port)
            c.send(
                b"POST /v1/x HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"Content-Length: 16777000\r\n\r\n{"
            )
            clients.append(c)
        time.sleep(0.5)
        grew = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grew < 2 << 20, f"{grew} bytes for 12 claimed bodies"


def test_a_body_that_stops_coming_is_408_and_the_router_can_idle(
    start: Callable[..., RunningRouter], beta: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sockio, "BODY_TIMEOUT_S", 0.3)
    r = start(beta.provider(patterns=("b-.*",)), idle=0.5, exit_on_idle=True)
    c = Client(r.port)
    c.send(
        b"POST /v1/x HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{"
    )
    status, _, body = c.response()
    assert (status, error(body)["code"]) == (408, "request_timeout")
    assert c.closed()
    r.thread.join(5)
    assert not r.thread.is_alive()  # idled out: the stalled body did not keep it busy


def test_a_head_that_stops_coming_is_408(
    two: RunningRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sockio, "HEADER_TIMEOUT_S", 0.3)
    c = Client(two.port)
    c.send(b"POST /v1/x HTTP/1.1\r\nHost: loc")
    assert c.response()[0] == 408


def test_refusals_are_logged_rate_limited(
    two: RunningRouter, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(router_module, "refusals", router_module.RateLog(router_module.log))
    caplog.set_level(logging.INFO, logger="providerd.router")
    c = Client(two.port)
    for _ in range(20):
        c.send(post("nobody-serves-this"))
        assert c.response()[0] == 404
    refused = [r for r in caplog.records if r.getMessage().startswith("Refused")]
    assert len(refused) == ratelog.BURST


def test_the_request_gate_runs_before_the_body_is_routed(
    two: RunningRouter, alpha: FakeProvider
) -> None:
    """The router's gate (the place for API-key checks) refuses in OpenAI's shape before any
    provider sees the request; without a refusal the request goes on as usual."""
    from agent.net.answers import Answer
    from agent.net.http import RequestHead

    def gate(req: RequestHead) -> Answer | None:
        keys = dict((k.lower(), v) for k, v in req.headers)
        if keys.get("x-api-key") != "k":
            return Answer(401, "a valid API key is required", "invalid_api_key")
        return None

    assert two.router is not None
    two.router.site.request_gate = gate
    c = Client(two.port)
    c.send(post("a-1"))
    status, _, body = c.response()
    assert (status, error(body)["code"]) == (401, "invalid_api_key")
    assert error(body)["message"] == "a valid API key is required"
    c.send(post("a-1", extra=b"x-api-key: k\r\n"))
    assert c.response()[0] == 200
    assert len(alpha.requests) == 1


# -- API keys ------------------------------------------------------------------------------

FULL_KEY, ALPHA_KEY = "pd-full-0123456789", "pd-alpha-0123456789"


def key_set() -> KeySet:
    def digest(token: str) -> bytes:
        return hashlib.sha256(token.encode()).digest()

    return KeySet(
        (
            ApiKey("full", digest(FULL_KEY)),
            ApiKey("alpha_only", digest(ALPHA_KEY), providers=("alpha",)),
        )
    )


def test_with_keys_on_the_router_finds_each_requests_key_once(
    start: Callable[..., RunningRouter],
    alpha: FakeProvider,
    beta: FakeProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """401 without a key, 403 for a provider the key does not reach (on a routed POST and on
    a model's own entry), the list narrowed to what the key reaches: all from one look-up
    of the key per request, the gate's, whose result the scope check takes over."""
    looked_up: list[str] = []
    find = KeySet.find

    def spy(self: KeySet, token: str) -> ApiKey | None:
        looked_up.append(token)
        return find(self, token)

    monkeypatch.setattr(KeySet, "find", spy)
    r = start(alpha.provider(names=("a-1",)), beta.provider(names=("b-1",)), keys=key_set())
    c = Client(r.port)

    def ask(request: bytes, key: str | None) -> tuple[int, dict[str, str], bytes]:
        if key is not None:
            end = request.index(b"\r\n") + 2
            request = request[:end] + b"Authorization: Bearer %s\r\n" % key.encode() + request[end:]
        c.send(request)
        return c.response()

    status, headers, body = ask(post("a-1"), None)
    assert (status, error(body)["code"]) == (401, "missing_api_key")
    assert headers["www-authenticate"].startswith("Bearer")
    assert looked_up == []  # no key, nothing to look up
    status, _, body = ask(post("a-1"), "pd-wrong")
    assert (status, error(body)["code"]) == (401, "invalid_api_key")
    assert looked_up == ["pd-wrong"]
    status, _, body = ask(post("b-1"), ALPHA_KEY)
    assert (status, error(body)["code"]) == (403, "key_out_of_scope")
    assert beta.requests == []
    status, _, body = ask(post("a-1"), ALPHA_KEY)
    assert (status, json.loads(body)["provider"]) == (200, "alpha")
    status, _, body = ask(b"GET /v1/models/b-1 HTTP/1.1\r\nHost: localhost\r\n\r\n", ALPHA_KEY)
    assert (status, error(body)["code"]) == (403, "key_out_of_scope")
    status, _, body = ask(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n", ALPHA_KEY)
    assert [m["id"] for m in json.loads(body)["data"]] == ["a-1"]
    status, _, body = ask(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n", FULL_KEY)
    assert [m["id"] for m in json.loads(body)["data"]] == ["a-1", "b-1"]
    status, _, body = ask(post("b-1"), FULL_KEY)
    assert (status, json.loads(body)["provider"]) == (200, "beta")
    assert looked_up == ["pd-wrong"] + [ALPHA_KEY] * 4 + [FULL_KEY] * 2  # once per request
    assert len(alpha.requests) == 1 and len(beta.requests) == 1


def test_a_new_table_routes_the_next_request_by_its_own_names(
    two: RunningRouter, alpha: FakeProvider, beta: FakeProvider
) -> None:
    """What SIGHUP does (`router.table = discover_table()`): a name routed before goes
    where the new table says, and a name the new table drops is 404."""
    c = Client(two.port)
    for model in ("a-1", "b-1"):
        c.send(post(model))
        assert c.response()[0] == 200
    router = two.router
    assert router is not None

    async def reload() -> None:
        router.table = Table([alpha.provider(names=("b-1",)), beta.provider(names=("b-2",))])

    asyncio.run_coroutine_threadsafe(reload(), two.loop).result(5)
    c.send(post("b-1"))
    status, _, body = c.response()
    assert (status, json.loads(body)["provider"]) == (200, "alpha")
    c.send(post("a-1"))
    status, _, body = c.response()
    assert (status, error(body)["code"]) == (404, "model_not_found")
    assert [len(alpha.requests), len(beta.requests)] == [2, 1]


def test_a_new_table_does_not_reuse_a_connection_to_an_old_address(
    two: RunningRouter, alpha: FakeProvider, beta: FakeProvider
) -> None:
    """A provider whose address changed across a reload: its next request goes to the new
    address, not down a connection kept to the old one."""
    import dataclasses

    c = Client(two.port)
    c.send(post("a-1"))
    assert c.response()[0] == 200  # alpha's connection is kept
    router = two.router
    assert router is not None
    moved = dataclasses.replace(beta.provider(names=("a-1",)), slug=alpha.provider().slug)

    async def reload() -> None:
        router.table = Table([moved])

    asyncio.run_coroutine_threadsafe(reload(), two.loop).result(5)
    c.send(post("a-1"))
    status, _, body = c.response()
    assert (status, json.loads(body)["provider"]) == (200, "beta")
    assert [len(alpha.requests), len(beta.requests)] == [1, 1]


def test_a_connection_in_flight_across_a_reload_is_not_kept_for_the_new_address(
    start: Callable[..., RunningRouter], beta: FakeProvider
) -> None:
    """A request to a provider's old address that was still in flight when the table
    changed: its connection ends with it, never kept for the provider's new address."""
    import dataclasses

    gate = threading.Event()

    def slow(conn: socket.socket, request: bytes) -> None:
        gate.wait(10)
        ok_answer("old")(conn, request)

    old = FakeProvider("alpha", slow)
    try:
        r = start(old.provider(names=("a-1",)))
        router = r.router
        assert router is not None
        held = Client(r.port)
        held.send(post("a-1"))  # waits at the old address
        deadline = time.monotonic() + 5
        while not old.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        moved = dataclasses.replace(beta.provider(names=("a-1",)), slug="alpha")

        async def reload() -> None:
            router.table = Table([moved])

        asyncio.run_coroutine_threadsafe(reload(), r.loop).result(5)
        c = Client(r.port)
        c.send(post("a-1"))
        assert json.loads(c.response()[2])["provider"] == "beta"
        gate.set()
        assert json.loads(held.response()[2])["provider"] == "old"
        for _ in range(2):  # the connection kept last is taken first
            c.send(post("a-1"))
            assert json.loads(c.response()[2])["provider"] == "beta"
        assert len(old.requests) == 1
    finally:
        gate.set()
        old.close()


def test_each_answer_is_counted_at_once_and_saved_within_the_flush_interval(
    start: Callable[..., RunningRouter],
    alpha: FakeProvider,
    beta: FakeProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By provider, declared name ("" for a pattern's or an unknown name) and status: in
    the live file as each answer goes out (what a router killed outright leaves), in the
    saved JSON within ROUTER_FLUSH_S while it runs."""
    monkeypatch.setattr(counters, "ROUTER_FLUSH_S", 0.2)
    r = start(alpha.provider(names=("a-1",)), beta.provider(patterns=("b-.*",)))
    c = Client(r.port)
    for request in (post("a-1"), post("a-1"), post("b-7"), post("nobody"), post("a-1")):
        c.send(request)
        c.response()
    c.send(post("a-1").replace(b"application/json", b"text/plain"))
    assert c.response()[0] == 415
    want = {("alpha", "a-1", 200): 3, ("beta", "", 200): 1, ("", "", 404): 1, ("", "", 415): 1}
    assert counters.load_router().requests == want  # the live file, before any save
    deadline = time.monotonic() + 5
    while True:
        try:
            saved = counters.RouterCounters.from_json(
                json.loads(counters.router_file().read_text())
            )
        except FileNotFoundError:
            saved = counters.RouterCounters()
        if saved.requests == want or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert saved.requests == want


def test_a_new_tables_routes_count_into_the_same_names(
    two: RunningRouter, alpha: FakeProvider, beta: FakeProvider
) -> None:
    """A reload makes new routes: their answers add to the counts of the same provider,
    declared name and status, in the live file as each answer goes out."""
    c = Client(two.port)
    for model in ("a-1", "b-7"):
        c.send(post(model))
        assert c.response()[0] == 200
    router = two.router
    assert router is not None

    async def reload() -> None:
        router.table = Table([alpha.provider(names=("a-1",)), beta.provider(patterns=("b-.*",))])

    asyncio.run_coroutine_threadsafe(reload(), two.loop).result(5)
    for model in ("a-1", "b-7", "a-2"):
        c.send(post(model))
        c.response()
    want = {("alpha", "a-1", 200): 2, ("beta", "", 200): 2, ("", "", 404): 1}
    assert counters.load_router().requests == want


def test_a_save_that_raises_does_not_end_the_saves(
    start: Callable[..., RunningRouter], alpha: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only OSError is a failure to save that is logged and tried again: anything else
    raised by a save escapes it, and the next save still comes ROUTER_FLUSH_S later."""
    monkeypatch.setattr(counters, "ROUTER_FLUSH_S", 0.1)
    real = counters.write_atomic
    tries: list[Path] = []

    def failing_once(path: Path, text: str) -> None:
        tries.append(path)
        if len(tries) == 1:
            raise ValueError("not a failure to write")
        real(path, text)

    monkeypatch.setattr(counters, "write_atomic", failing_once)
    r = start(alpha.provider(names=("a-1",)))
    c = Client(r.port)
    c.send(post("a-1"))
    assert c.response()[0] == 200
    deadline = time.monotonic() + 5
    while not counters.router_file().exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(tries) >= 2
    saved = json.loads(counters.router_file().read_text())
    assert counters.RouterCounters.from_json(saved).requests == {("alpha", "a-1", 200): 1}
