"""The upstream side's reading (agent.net.upconn): a response relayed whole and unchanged,
ended once, however the worker's bytes are split across reads."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.net.http import MAX_HEAD, HttpError, ResponseHead
from agent.net.upconn import UpstreamConn, UpstreamGone


class Transport:
    def write(self, data: bytes) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


class Recorder:
    """An exchange that keeps what the upstream hands it, and lets it go at the end as
    the real one does (kept to rest, or closed)."""

    def __init__(self, up: UpstreamConn) -> None:
        self.up = up
        self.relayed = bytearray()
        self.ends: list[bool] = []
        self.failed: list[object] = []

    def on_interim(self, resp: ResponseHead, head: memoryview) -> None:
        self.relayed += head

    def on_final(self, resp: ResponseHead) -> None:
        pass

    def on_whole(self, resp: ResponseHead, data: Any, reusable: bool) -> None:
        self.relayed += data
        self.on_end(reusable)

    def on_data(self, data: Any) -> None:
        self.relayed += data

    def on_end(self, reusable: bool) -> None:
        self.ends.append(reusable)
        if reusable:
            self.up.rest()
        else:
            self.up.close()

    def upstream_failed(self, err: HttpError) -> None:
        self.failed.append(err)

    def upstream_gone(self, e: UpstreamGone) -> None:
        self.failed.append(e)

    def splice_response(self, up: UpstreamConn) -> bool:
        return False

    def on_tunnel(self, up: UpstreamConn) -> None:
        pass

    def tunnel_eof(self, up: UpstreamConn) -> None:
        pass


chunk_lists = st.lists(st.binary(min_size=1, max_size=40), max_size=5)


@st.composite
def responses(draw: st.DrawFn) -> tuple[str, bytes, str]:
    """(the request's method, the response, how it ends: "end", "eof" or "tunnel")."""
    interim = b"HTTP/1.1 100 Continue\r\n\r\n" if draw(st.booleans()) else b""
    kind = draw(st.sampled_from(["length", "chunked", "none", "head", "close", "tunnel"]))
    body = draw(st.binary(max_size=300))
    if kind == "none":
        return "GET", interim + b"HTTP/1.1 204 No Content\r\nServer: w\r\n\r\n", "end"
    if kind == "head":  # a HEAD's response: its Content-Length, no body
        return "HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body), "end"
    if kind == "length":
        head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
        return "GET", interim + head + body, "end"
    if kind == "close":  # no framing: the body ends at the worker's EOF
        return "GET", interim + b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body, "eof"
    if kind == "tunnel":  # what follows the 101 is the tunnel's, as it comes
        head = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n"
        return "GET", head + body, "tunnel"
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in draw(chunk_lists))
    trailer = b"X-T: 1\r\n" if draw(st.booleans()) else b""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    return "GET", interim + head + chunks + b"0\r\n" + trailer + b"\r\n", "end"


@settings(max_examples=300, deadline=None)
@given(responses(), st.lists(st.integers(min_value=1, max_value=64), max_size=20), st.booleans())
def test_a_response_is_relayed_whole_and_ended_once_however_it_is_split(
    drawn: tuple[str, bytes, str], sizes: list[int], extra: bool
) -> None:
    method, response, ends = drawn
    extra = extra and ends == "end"  # after a close-delimited body or in a tunnel: theirs
    up = UpstreamConn(0, "worker")
    up.connection_made(Transport())  # type: ignore[arg-type]
    ex = Recorder(up)
    up.begin(ex, method, b"GET / HTTP/1.1\r\n\r\n")  # type: ignore[arg-type]
    data = response + (b"HTTP/1.1 200 OK\r\n" if extra else b"")  # a byte nobody asked for
    at = 0
    for size in [*sizes, len(data)]:
        if at >= len(data) or up.dead:
            break
        up.data_received(data[at : at + size])
        at += size
    if ends == "eof":
        up.eof_received()
    assert not ex.failed
    assert bytes(ex.relayed) == response
    if ends == "tunnel":
        assert ex.ends == []
    elif ends == "eof":
        assert ex.ends == [False] and not up.usable()
    elif extra:  # a byte after the response (in its read or a later one) closes it
        assert len(ex.ends) == 1 and not up.usable()
    else:
        assert ex.ends == [True] and up.usable()


@pytest.mark.parametrize("split", [None, 60_000])
def test_a_response_head_over_the_limit_is_refused_however_it_comes(split: int | None) -> None:
    """A read is up to 256 KiB: a head larger than MAX_HEAD is refused (502) also when its
    end is in the read."""
    up = UpstreamConn(0, "worker")
    up.connection_made(Transport())  # type: ignore[arg-type]
    ex = Recorder(up)
    up.begin(ex, "GET", b"GET / HTTP/1.1\r\n\r\n")  # type: ignore[arg-type]
    fields = b"".join(b"X-%d: %s\r\n" % (i, b"v" * 1500) for i in range(100))
    data = b"HTTP/1.1 200 OK\r\n" + fields + b"Content-Length: 0\r\n\r\n"
    assert len(data) > MAX_HEAD
    for part in (data,) if split is None else (data[:split], data[split:]):
        up.data_received(part)
    assert [getattr(e, "status", None) for e in ex.failed] == [502]
    assert not ex.relayed and not ex.ends
