"""Property tests of the request framing the front and the router read (agent.net.http).

Arbitrary and mutated bytes never raise anything but HttpError out of the parser, every
refusal carries a status a client can be answered with, the chunked scanner finds the
same end however the bytes are split, and every request the parser accepts is framed
the same way by h11, an independent strict parser (so a worker cannot read another
request boundary than the front did). Cases hypothesis found are kept as @example.
"""

from __future__ import annotations

import socket

import h11
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agent.net.chunked import ChunkedScanner
from agent.net.http import (
    MAX_HEAD,
    HttpError,
    find_head_end,
    parse_request_head,
    parse_response_head,
)

REFUSALS = {400, 414, 431, 501, 505}

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TOKENS = st.sampled_from(
    [
        b"GET",
        b"POST",
        b"HTTP/1.1",
        b"HTTP/1.0",
        b" ",
        b"\r\n",
        b"\n",
        b"\r",
        b":",
        b",",
        b"/",
        b"Host",
        b"Content-Length",
        b"Transfer-Encoding",
        b"Transfer_Encoding",
        b"chunked",
        b"gzip",
        b"Connection",
        b"close",
        b"keep-alive",
        b"Upgrade",
        b"Expect",
        b"100-continue",
        b"0",
        b"5",
        b"ff",
        b"-1",
        b"+5",
        b";",
        b"=",
        b"\t",
        b"\x00",
        b"x",
        b"\xff",
    ]
)

VALID = [
    b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"POST /v1/x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
]


@st.composite
def token_soup(draw: st.DrawFn) -> bytes:
    return b"".join(draw(st.lists(TOKENS, max_size=40)))


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid request with a few bytes changed, inserted or deleted."""
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["set", "insert", "delete"]))
        byte = draw(st.sampled_from(b"\r\n :,;\t\x00aZ09-_\x7f\x80"))
        if kind == "insert" or at == len(data):
            data[at:at] = bytes([byte])
        elif kind == "set":
            data[at] = byte
        else:
            del data[at]
    return bytes(data)


def outcome(data: bytes) -> tuple[str, int, int] | int | None:
    """What the front makes of `data`: None (head incomplete), a refusal status, or
    (body kind, body length, where the request ends)."""
    end = find_head_end(data, 0, len(data))
    if end < 0:
        return None
    try:
        req = parse_request_head(data, 0, end)
    except HttpError as e:
        return e.status
    if req.body == "chunked":
        try:
            at = ChunkedScanner(strict=True).scan(data, end, len(data))
        except HttpError as e:
            return e.status
        return ("chunked", -1, at)
    if req.body == "length":
        return ("length", req.length, end + req.length)
    return ("none", 0, end)


@SETTINGS
@given(st.one_of(st.binary(max_size=300), token_soup(), mutated()))
@example(b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999\r\n\r\n")
@example(b"GET / HTTP/9.9\r\n\r\n")
@example(b"\r\n\r\n")
def test_any_bytes_are_accepted_or_refused_with_a_status(data: bytes) -> None:
    result = outcome(data)
    if isinstance(result, int):
        assert result in REFUSALS


@SETTINGS
@given(st.one_of(st.binary(max_size=300), token_soup()), st.sampled_from(["GET", "HEAD"]))
def test_any_response_head_is_parsed_or_refused_with_502(data: bytes, method: str) -> None:
    end = find_head_end(data, 0, len(data))
    if end < 0:
        return
    try:
        parse_response_head(data, method, 0, end)
    except HttpError as e:
        assert e.status == 502


def _h11_framing(data: bytes) -> tuple[int, int] | None:
    """(body bytes, bytes the request took) as h11 reads them, None if h11 refuses."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    body = 0
    try:
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Data):
                body += len(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return body, len(data) - len(conn.trailing_data[0])
            elif event is h11.NEED_DATA or event is h11.PAUSED:
                return None
    except h11.RemoteProtocolError:
        return None


@SETTINGS
@given(st.one_of(mutated(), token_soup()))
@example(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n5\r\n")
@example(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\n\r\nhello")
@example(
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5;a\rb\r\nhello\r\n0\r\n\r\n"
)
def test_what_the_front_accepts_a_strict_parser_frames_the_same(data: bytes) -> None:
    result = outcome(data)
    if not isinstance(result, tuple) or result[2] < 0:
        return  # refused or incomplete: nothing reaches a worker
    theirs = _h11_framing(data)
    if theirs is None:
        return  # h11 is stricter on something that does not move a boundary
    _, length, ends = result
    body, took = theirs
    assert took == ends, (data, result, theirs)
    if length >= 0:
        assert body == length


@SETTINGS
@given(st.data())
def test_the_chunked_scanner_finds_the_same_end_however_the_bytes_are_split(
    data: st.DataObject,
) -> None:
    sizes = data.draw(st.lists(st.integers(0, 40), max_size=6))
    body = b"".join(b"%x\r\n%s\r\n" % (n, b"x" * n) for n in sizes if n) + b"0\r\n\r\nNEXT"
    whole = ChunkedScanner(strict=True).scan(body, 0, len(body))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=8)))
    scanner = ChunkedScanner(strict=True)
    found = -1
    start = 0
    for cut in [*cuts, len(body)]:
        if cut < start:
            continue
        at = scanner.scan(body, start, cut)
        if at >= 0:
            found = at
            break
        start = cut
    assert whole == found == len(body) - 4


@SETTINGS
@given(st.binary(max_size=200), st.booleans())
def test_the_chunked_scanner_raises_only_http_errors(data: bytes, strict: bool) -> None:
    try:
        ChunkedScanner(strict=strict).scan(data, 0, len(data))
    except HttpError as e:
        assert e.status == 400


def test_a_head_at_the_limit_is_found_and_parsed() -> None:
    head = b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"y" * (MAX_HEAD - 40) + b"\r\n\r\n"
    end = find_head_end(head, 0, len(head))
    assert end == len(head)
    assert parse_request_head(head, 0, end).path == "/"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(mutated(), token_soup(), st.binary(max_size=200)))
@example(b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel")
@example(b"GET / HTTP/1.1\r\nHost: a\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\nG")
def test_the_front_answers_any_bytes_with_statuses_and_never_fails(data: bytes) -> None:
    """The whole data path (agent.net.proxy.serve_http against an echoing worker): whatever a
    client sends and then half-closes, it gets zero or more complete responses with a
    status, the connection ends, and the connection's task never raises."""
    from tests.unit.test_proxy import Setup, echo_worker, run

    async def test() -> None:
        async with Setup(echo_worker) as (_, backend, px):
            client = await px.connect()
            await client.send(data)
            client.sock.shutdown(socket.SHUT_WR)
            raw = await client.read_to_eof()
            client.close()
            await px.settle()
            assert backend.active == 0
            pos = 0
            while pos < len(raw):
                end = find_head_end(raw, pos, len(raw))
                assert end > 0, raw
                head = parse_response_head(raw, "GET", pos, end)
                assert head.status == 200 or head.status in REFUSALS, raw
                pos = end + head.length

    run(test)
