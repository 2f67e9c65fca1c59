"""HTTP/1.1 framing: heads, body kinds, keep-alive, chunked bodies (agent.net.http)."""

from __future__ import annotations

import json

import pytest

from agent.net.chunked import ChunkedScanner
from agent.net.http import (
    MAX_HEADERS,
    HttpError,
    error_response,
    find_head_end,
    find_request_head_end,
    parse_request_head,
    parse_response_head,
    skip_empty_lines,
)


def test_find_head_end_crlf_bare_lf_and_incomplete() -> None:
    data = b"GET / HTTP/1.1\r\nHost: x\r\n\r\nBODY"
    assert find_head_end(data, 0, len(data)) == len(data) - 4
    lf = b"GET / HTTP/1.1\nHost: x\n\nBODY\r\n\r\n"
    assert find_head_end(lf, 0, len(lf)) == lf.index(b"BODY")
    assert find_head_end(data, 0, 20) == -1
    mixed = b"GET / HTTP/1.1\nHost: x\r\n\r\n"
    assert find_head_end(mixed, 0, len(mixed)) == len(mixed)


def test_skip_empty_lines_between_requests() -> None:
    data = b"\r\n\r\nGET"
    assert skip_empty_lines(data, 0, len(data)) == 4


def test_get_request() -> None:
    req = parse_request_head(b"GET /v1/models?x=1 HTTP/1.1\r\nHost: a\r\nX-Y:  z \r\n\r\n")
    assert (req.method, req.target, req.version) == ("GET", "/v1/models?x=1", 11)
    assert req.path == "/v1/models"
    assert req.headers == [("Host", "a"), ("X-Y", "z")]
    assert req.body == "none" and req.keep_alive and not req.upgrade and not req.expect_continue


@pytest.mark.parametrize(
    ("target", "path"),
    [
        ("/", "/"),
        ("/a/b?c=d?e", "/a/b"),
        ("http://host:8080/x/y?z", "/x/y"),
        ("http://host", "/"),
        ("*", "*"),
        ("example.com:443", "example.com:443"),
    ],
)
def test_path_without_query(target: str, path: str) -> None:
    assert parse_request_head(f"OPTIONS {target} HTTP/1.1\r\nHost: t\r\n\r\n".encode()).path == path


def test_content_length_and_chunked_bodies() -> None:
    req = parse_request_head(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 12\r\n\r\n")
    assert (req.body, req.length) == ("length", 12)
    req = parse_request_head(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
    assert req.body == "none"
    req = parse_request_head(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: Chunked\r\n\r\n")
    assert req.body == "chunked"


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /\r\n\r\n", 400),
        (b"GET  / HTTP/1.1\r\n\r\n", 400),
        (b"G(T / HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"GET / HTTQ/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: t\r\nNo-Colon\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: t\r\nA : b\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: t\r\nA: b\r\n folded\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: t\r\nA: b\rc\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: -1\r\n\r\n", 400),
        (
            b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
            400,
        ),
        (b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
        # Ambiguous framing: a worker could read another request boundary than the front.
        (b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked, chunked\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 400),
        (
            b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
            400,
        ),
        (b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5, 5\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: a\r\nhost: a\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\nHost: a\n\n", 400),
        (b"GET / HTTP/1.1\r\nHost: a\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: t\r\nTransfer_Encoding: chunked\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nHost: t\r\nContent_Length: 5\r\n\r\n", 400),
    ],
)
def test_malformed_requests(head: bytes, status: int) -> None:
    with pytest.raises(HttpError) as info:
        parse_request_head(head)
    assert info.value.status == status


def test_a_request_head_end_is_its_first_crlf_blank_line_else_any_blank_line() -> None:
    data = b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /2 HTTP/1.1\r\n\r\n"
    assert find_request_head_end(data, 0, len(data)) == data.index(b"GET /2")
    assert find_request_head_end(data, 2, 20) == -1
    lf = b"GET / HTTP/1.1\nHost: x\n\nBODY"
    assert find_request_head_end(lf, 0, len(lf)) == find_head_end(lf, 0, len(lf))
    # An earlier bare-LF blank line: the head is taken to its CRLF one, and still refused.
    early = b"GET / HTTP/1.1\nHost: x\n\nGET /2 HTTP/1.1\r\nHost: x\r\n\r\n"
    end = find_request_head_end(early, 0, len(early))
    assert end == len(early) and find_head_end(early, 0, len(early)) < end
    for head_end in (end, find_head_end(early, 0, len(early))):
        with pytest.raises(HttpError) as info:
            parse_request_head(early, 0, head_end)
        assert info.value.status == 400


@pytest.mark.parametrize(
    "name",
    ["Content-Length", "content-length", "CONTENT-LENGTH", "cOnTeNt-LeNgTh"],
)
def test_framing_fields_are_found_in_any_case_with_their_values_trimmed(name: str) -> None:
    head = f"POST / HTTP/1.1\r\nhOsT: t\r\n{name}: \t 7 \t\r\nCONNECTION: Close\r\n\r\n"
    req = parse_request_head(head.encode())
    assert (req.body, req.length, req.keep_alive) == ("length", 7, False)
    with pytest.raises(HttpError) as info:  # a second Host in another case still counts
        parse_request_head(head.replace("hOsT: t", "Host: t\r\nHOST: u").encode())
    assert info.value.status == 400


def test_an_underscored_framing_field_is_named_as_sent() -> None:
    with pytest.raises(HttpError) as info:
        parse_request_head(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer_ENCODING: chunked\r\n\r\n")
    assert "'Transfer_ENCODING'" in info.value.reason


def test_an_invalid_content_length_is_quoted_as_sent() -> None:
    with pytest.raises(HttpError) as info:
        parse_request_head(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5X\r\n\r\n")
    assert info.value.reason == "invalid Content-Length '5X'"


def test_the_field_count_limit_holds_for_the_shortest_fields() -> None:
    """Heads too short to hold more than MAX_HEADERS fields are not counted; at the edge,
    bare-LF fields of three bytes (a response's) still are."""
    fields = b"a:\n" * MAX_HEADERS
    assert parse_response_head(b"HTTP/1.1 204 No\n" + fields + b"\n", "GET").status == 204
    with pytest.raises(HttpError) as info:
        parse_response_head(b"HTTP/1.1 204 No\n" + fields + b"a:\n\n", "GET")
    assert info.value.status == 431


def test_too_many_header_fields() -> None:
    head = b"GET / HTTP/1.1\r\nHost: t\r\n" + b"A: b\r\n" * (MAX_HEADERS + 1) + b"\r\n"
    with pytest.raises(HttpError) as info:
        parse_request_head(head)
    assert info.value.status == 431


def test_keep_alive_rules() -> None:
    assert not parse_request_head(
        b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    ).keep_alive
    assert not parse_request_head(b"GET / HTTP/1.0\r\n\r\n").keep_alive
    assert parse_request_head(b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n").keep_alive
    assert parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", "GET").keep_alive
    assert not parse_response_head(
        b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", "GET"
    ).keep_alive


def test_upgrade_connect_and_expect() -> None:
    req = parse_request_head(
        b"GET /ws HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: keep-alive, Upgrade\r\n\r\n"
    )
    assert req.upgrade
    assert not parse_request_head(
        b"GET / HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\n\r\n"
    ).upgrade
    assert parse_request_head(b"CONNECT h:443 HTTP/1.1\r\nHost: t\r\n\r\n").upgrade
    req = parse_request_head(
        b"PUT / HTTP/1.1\r\nHost: t\r\nExpect: 100-Continue\r\nContent-Length: 3\r\n\r\n"
    )
    assert req.expect_continue


@pytest.mark.parametrize(
    ("head", "method", "body", "length", "keep"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", "GET", "length", 5, True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", "HEAD", "none", 0, True),
        (b"HTTP/1.1 204 No Content\r\n\r\n", "GET", "none", 0, True),
        (b"HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n", "GET", "none", 0, True),
        (b"HTTP/1.1 100 Continue\r\n\r\n", "POST", "none", 0, True),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "GET", "tunnel", 0, True),
        (b"HTTP/1.1 200 Connection established\r\n\r\n", "CONNECT", "tunnel", 0, True),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "GET", "chunked", 0, True),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
            "GET",
            "chunked",
            0,
            True,
        ),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "GET", "close", 0, False),
        (b"HTTP/1.1 200 OK\r\n\r\n", "GET", "close", 0, False),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\n\r\n", "GET", "close", 0, False),
        (b"HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n", "GET", "length", 0, True),
    ],
)
def test_response_framing(head: bytes, method: str, body: str, length: int, keep: bool) -> None:
    resp = parse_response_head(head, method)
    assert (resp.body, resp.length, resp.keep_alive) == (body, length, keep)


@pytest.mark.parametrize(
    "head",
    [b"HTTP/1.1 2000 OK\r\n\r\n", b"HTTP/1.1 OK\r\n\r\n", b"ICY 200 OK\r\n\r\n", b"\r\n"],
)
def test_malformed_responses_are_502(head: bytes) -> None:
    with pytest.raises(HttpError) as info:
        parse_response_head(head, "GET")
    assert info.value.status == 502


CHUNKED = (
    b'5;name=value;q="x"\r\nhello\r\n'
    b"1A\r\n" + b"a" * 26 + b"\r\n"
    b"0;last\r\n"
    b"Trailer-One: 1\r\n"
    b"Trailer-Two: 2\r\n"
    b"\r\n"
)


def test_chunked_whole_body_with_extensions_and_trailers() -> None:
    data = CHUNKED + b"NEXT"
    scanner = ChunkedScanner()
    assert scanner.scan(data, 0, len(data)) == len(CHUNKED)
    assert scanner.done


@pytest.mark.parametrize("step", [1, 2, 3, 7, 64])
def test_chunked_fed_in_pieces(step: int) -> None:
    scanner = ChunkedScanner()
    data = CHUNKED + b"NEXT"
    ends = []
    for i in range(0, len(CHUNKED), step):
        piece = data[i : i + step]
        at = scanner.scan(piece, 0, len(piece))
        if at >= 0:
            ends.append(i + at)
            break
    assert ends == [len(CHUNKED)]


def test_chunked_bare_lf_and_no_trailers() -> None:
    data = b"3\nabc\n0\n\n"
    assert ChunkedScanner().scan(data, 0, len(data)) == len(data)


@pytest.mark.parametrize(
    "data",
    [b"zz\r\n", b"3\r\nabcd\r\n", b"5" * 20 + b"\r\n", b"3\r\n" + b"x" * 5000],
)
def test_chunked_malformed(data: bytes) -> None:
    with pytest.raises(HttpError):
        scanner = ChunkedScanner()
        scanner.scan(data, 0, len(data))
        scanner.scan(b"\r\n0\r\n\r\n", 0, 7)


@pytest.mark.parametrize(
    "data",
    [
        b"5;a\rb\r\nhello\r\n0\r\n\r\n",  # a lone CR in an extension
        b" 5\r\nhello\r\n0\r\n\r\n",  # spaces around the size
        b"5 \r\nhello\r\n0\r\n\r\n",
        b"5 ;a=b\r\nhello\r\n0\r\n\r\n",
        b"5\nhello\r\n0\r\n\r\n",  # bare LF
        b"5\r\nhello\n0\r\n\r\n",
        b"5\r\nhello\r\n0\r\nbad trailer\r\n\r\n",
    ],
)
def test_strict_chunked_refuses_what_a_worker_may_read_otherwise(data: bytes) -> None:
    with pytest.raises(HttpError) as info:
        ChunkedScanner(strict=True).scan(data, 0, len(data))
    assert info.value.status == 400


def test_strict_chunked_takes_extensions_and_trailers() -> None:
    data = b"5;name=value;flag\r\nhello\r\n0\r\nX-Sum: 1\r\n\r\nNEXT"
    assert ChunkedScanner(strict=True).scan(data, 0, len(data)) == len(data) - 4


def test_chunked_overlong_line() -> None:
    scanner = ChunkedScanner()
    with pytest.raises(HttpError):
        for _ in range(100):
            scanner.scan(b"1" + b";x" * 100, 0, 201)


def test_error_response() -> None:
    data = error_response(503, {"error": "loading", "provider": "p"}, close=True, retry_after_s=2.1)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 503 Service Unavailable"
    assert "Retry-After: 3" in lines and "Connection: close" in lines
    assert f"Content-Length: {len(body)}" in lines
    assert json.loads(body) == {"error": "loading", "provider": "p"}
    head_only = error_response(503, {"error": "x"}, close=False, head_only=True)
    assert head_only.endswith(b"\r\n\r\n") and b"Connection" not in head_only


def test_heads_parse_from_a_memoryview_or_a_range_of_a_buffer() -> None:
    buf = bytearray(b"xxGET /m HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc")
    end = find_head_end(buf, 2, len(buf))
    in_place = parse_request_head(buf, 2, end)
    viewed = parse_request_head(memoryview(buf)[2:end])
    assert (in_place.path, in_place.length) == (viewed.path, viewed.length) == ("/m", 3)
    assert viewed.headers == [("Host", "h"), ("Content-Length", "3")]
    resp = parse_response_head(memoryview(b"HTTP/1.1 204 No Content\r\n\r\n"), "GET")
    assert (resp.status, resp.reason, resp.body) == (204, "No Content", "none")
