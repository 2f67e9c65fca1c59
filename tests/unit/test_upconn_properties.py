"""The upstream side's reading (agent.net.upconn): a response relayed whole and unchanged,
ended once, however the worker's bytes are split across reads."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.net.http import HttpError, ResponseHead
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


chunk_lists = st.lists(st.binary(min_size=1, max_size=40), max_size=5)


@st.composite
def responses(draw: st.DrawFn) -> bytes:
    interim = b"HTTP/1.1 100 Continue\r\n\r\n" if draw(st.booleans()) else b""
    kind = draw(st.sampled_from(["length", "chunked", "none"]))
    if kind == "none":
        return interim + b"HTTP/1.1 204 No Content\r\nServer: w\r\n\r\n"
    if kind == "length":
        body = draw(st.binary(max_size=300))
        return interim + b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in draw(chunk_lists))
    trailer = b"X-T: 1\r\n" if draw(st.booleans()) else b""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    return interim + head + chunks + b"0\r\n" + trailer + b"\r\n"


@settings(max_examples=300, deadline=None)
@given(responses(), st.lists(st.integers(min_value=1, max_value=64), max_size=20), st.booleans())
def test_a_response_is_relayed_whole_and_ended_once_however_it_is_split(
    response: bytes, sizes: list[int], extra: bool
) -> None:
    up = UpstreamConn(0, "worker")
    up.connection_made(Transport())  # type: ignore[arg-type]
    ex = Recorder(up)
    up.begin(ex, "GET", b"GET / HTTP/1.1\r\n\r\n")  # type: ignore[arg-type]
    data = response + (b"HTTP/1.1 200 OK\r\n" if extra else b"")  # a byte nobody asked for
    at = 0
    for size in [*sizes, len(data)]:
        if at >= len(data) or up.dead:
            break
        up.data_received(data[at : at + size])
        at += size
    assert not ex.failed
    assert bytes(ex.relayed) == response
    assert len(ex.ends) == 1
    # Kept when nothing followed the response; a byte after it (in its read or a later
    # one) closes it.
    if extra:
        assert not up.usable()
    else:
        assert ex.ends == [True] and up.usable()
