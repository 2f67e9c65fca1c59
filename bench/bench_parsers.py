#!/usr/bin/env python3
"""The request parsers providerd could use, side by side: `agent.net.http` (the data path's own),
`httptools` and `h11` as Debian 12 ships them (python3-httptools, python3-h11).

    python3 bench/bench_parsers.py           # writes bench/results/parsers.txt
    python3 bench/bench_parsers.py --quick   # fewer rounds, prints only

Two questions, one table each:
- framing: what each parser makes of the requests that let a front and a worker disagree
  on where a request ends (request smuggling) and of a few plain ones. "ok" means accepted,
  with the body framing it found; anything else is the refusal.
- cost: microseconds of CPU to parse one typical request head (an OpenAI-style POST with
  nine header fields), median of several rounds.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.net.chunked import ChunkedScanner  # noqa: E402
from agent.net.http import HttpError, find_head_end, parse_request_head  # noqa: E402

CASES: list[tuple[str, bytes]] = [
    ("plain GET", b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"),
    ("CL body", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"),
    (
        "chunked body",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    ),
    (
        "TE: chunked, chunked",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    ),
    (
        "TE: gzip, chunked",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    ),
    ("CL: 5, 5", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\n\r\nhello"),
    (
        "CL twice, same",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
    ),
    (
        "CL and TE",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    ),
    ("Host twice", b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"),
    ("HTTP/1.1, no Host", b"GET / HTTP/1.1\r\n\r\n"),
    ("bare LF", b"GET / HTTP/1.1\nHost: a\n\n"),
    (
        "lone CR in chunk ext",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5;a\rb\r\nhello\r\n0\r\n\r\n",
    ),
    (
        "space before chunk size",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n 5\r\nhello\r\n0\r\n\r\n",
    ),
    (
        "space after chunk size",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5 \r\nhello\r\n0\r\n\r\n",
    ),
    (
        "Transfer_Encoding",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer_Encoding: chunked\r\nContent-Length: 5\r\n\r\nhello",
    ),
    ("space before colon", b"GET / HTTP/1.1\r\nHost: a\r\nX-A : b\r\n\r\n"),
    ("obs-fold", b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\r\n c\r\n\r\n"),
    ("NUL in a value", b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\x00c\r\n\r\n"),
    ("CL: +5", b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\nhello"),
]

TYPICAL = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8100\r\n"
    b"Accept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\nAccept: application/json\r\n"
    b"Content-Type: application/json\r\nUser-Agent: OpenAI/Python 1.3.7\r\n"
    b"Authorization: Bearer sk-none\r\nX-Stainless-Lang: python\r\nContent-Length: 97\r\n\r\n"
)


def ours(data: bytes) -> str:
    end = find_head_end(data, 0, len(data))
    if end < 0:
        return "incomplete"
    try:
        req = parse_request_head(data, 0, end)
        if req.body == "chunked":
            at = ChunkedScanner(strict=True).scan(data, end, len(data))
            return f"ok chunked, ends {at}"
        return f"ok {req.body} {req.length}"
    except HttpError as e:
        return f"{e.status}"


def with_httptools(data: bytes) -> str:
    import httptools

    class Sink:
        def __init__(self) -> None:
            self.body = 0
            self.done = False

        def on_body(self, b: bytes) -> None:
            self.body += len(b)

        def on_message_complete(self) -> None:
            self.done = True

    sink = Sink()
    p = httptools.HttpRequestParser(sink)
    try:
        p.feed_data(data)
    except httptools.HttpParserError as e:
        return f"refused ({type(e).__name__})"
    return f"ok body {sink.body}" + ("" if sink.done else ", incomplete")


def with_h11(data: bytes) -> str:
    import h11

    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    body = 0
    try:
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Data):
                body += len(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return f"ok body {body}"
            elif event is h11.NEED_DATA:
                return f"ok body {body}, incomplete"
            elif event is h11.PAUSED:
                return f"ok body {body}"
    except h11.RemoteProtocolError as e:
        return f"{e.error_status_hint}"


def cost_us(parse: Callable[[bytes], object], rounds: int, n: int) -> float:
    samples = []
    for _ in range(rounds):
        t = time.process_time()
        for _ in range(n):
            parse(TYPICAL)
        samples.append((time.process_time() - t) / n * 1e6)
    return statistics.median(samples)


def parse_ours(data: bytes) -> object:
    """What the data path does per request: find the head's end, parse the framing."""
    return parse_request_head(data, 0, find_head_end(data, 0, len(data)))


def parse_ours_fields(data: bytes) -> object:
    """The same, plus every field as a (name, value) pair, as the callbacks below build."""
    return parse_request_head(data, 0, find_head_end(data, 0, len(data))).headers


def parse_httptools(data: bytes) -> object:
    import httptools

    class Sink:
        __slots__ = ("headers",)

        def __init__(self) -> None:
            self.headers: list[tuple[bytes, bytes]] = []

        def on_header(self, name: bytes, value: bytes) -> None:
            self.headers.append((name, value))

    sink = Sink()
    httptools.HttpRequestParser(sink).feed_data(data)
    return sink.headers


class _Nothing:
    __slots__ = ()


def parse_httptools_bare(data: bytes) -> object:
    """httptools with no callbacks at all: its floor."""
    import httptools

    parser = httptools.HttpRequestParser(_Nothing())
    parser.feed_data(data)
    return parser


def parse_h11(data: bytes) -> object:
    import h11

    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    return conn.next_event()


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    import h11
    import httptools

    lines = [
        f"Request parsers: agent.net.http, httptools {httptools.__version__}, h11 {h11.__version__}",
        "",
        f"{'case':26} {'agent.net.http':28} {'httptools':30} {'h11':22}",
    ]
    for name, data in CASES:
        lines.append(f"{name:26} {ours(data):28} {with_httptools(data):30} {with_h11(data):22}")
    rounds, n = (3, 2000) if quick else (7, 10000)
    lines += ["", f"CPU per typical request head (median of {rounds} rounds of {n}):"]
    for label, fn in (
        ("agent.net.http (framing)", parse_ours),
        ("agent.net.http (framing + fields)", parse_ours_fields),
        ("httptools (framing + fields)", parse_httptools),
        ("httptools (no callbacks)", parse_httptools_bare),
        ("h11 (connection + event)", parse_h11),
    ):
        lines.append(f"  {label:30} {cost_us(fn, rounds, n):6.1f} µs")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if not quick:
        out = ROOT / "bench" / "results" / "parsers.txt"
        out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
