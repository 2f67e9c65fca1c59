"""Remembered head parses (agent.net.headcache): the same answers as parsing, bounded."""

from __future__ import annotations

import pytest

from agent.net import headcache
from agent.net.http import HttpError, parse_request_head, parse_response_head

REQ = b"POST /v1/x HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\n"
RESP = b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n"


def test_a_head_seen_before_gives_the_same_parse_from_anywhere_in_a_buffer() -> None:
    buf = bytearray(b"xx" + REQ + b"hello")
    first = headcache.request_head(buf, 2, 2 + len(REQ))
    assert first == parse_request_head(REQ)
    again = headcache.request_head(bytearray(REQ), 0, len(REQ))
    assert again is first
    resp = headcache.response_head(bytearray(b"." + RESP), "GET", 1, 1 + len(RESP))
    assert resp == parse_response_head(RESP, "GET")
    assert headcache.response_head(bytearray(RESP), "POST", 0, len(RESP)) is resp


def test_a_response_to_head_is_framed_as_one_whatever_was_remembered() -> None:
    buf = bytearray(RESP)
    assert headcache.response_head(buf, "GET", 0, len(buf)).body == "length"
    assert headcache.response_head(buf, "HEAD", 0, len(buf)).body == "none"
    ok = bytearray(b"HTTP/1.1 200 OK\r\n\r\n")
    assert headcache.response_head(ok, "GET", 0, len(ok)).body == "close"
    assert headcache.response_head(ok, "CONNECT", 0, len(ok)).body == "tunnel"


def test_a_bad_head_is_refused_every_time() -> None:
    bad = bytearray(b"GET / HTTP/1.1\r\nHost: h\r\nContent-Length: 5, 5\r\n\r\n")
    for _ in range(2):
        with pytest.raises(HttpError) as e:
            headcache.request_head(bad, 0, len(bad))
        assert e.value.status == 400
    assert bytes(bad) not in headcache._requests


def test_memory_stays_bounded_under_ever_new_heads() -> None:
    for i in range(3 * headcache.ENTRIES):
        head = bytearray(b"GET /%d HTTP/1.1\r\nHost: h\r\n\r\n" % i)
        assert headcache.request_head(head, 0, len(head)).target == f"/{i}"
    assert len(headcache._requests) <= headcache.ENTRIES
    big = bytearray(b"GET / HTTP/1.1\r\nHost: h\r\nX: " + b"a" * headcache.KEY_MAX + b"\r\n\r\n")
    assert headcache.request_head(big, 0, len(big)).target == "/"
    assert bytes(big) not in headcache._requests
