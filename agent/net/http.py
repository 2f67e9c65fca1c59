"""HTTP/1.1 message framing (RFC 9112) for the data path. No I/O here.

The proxy forwards every message byte for byte; this module only tells it where
a message head ends, what the head says about the body that follows (none,
Content-Length, chunked, close-delimited, or a tunnel after an upgrade), whether
the connection stays open; where a chunked body ends is agent.net.chunked's. It never
rewrites a head: what a client sent is what the worker receives.

Since the worker reads the same bytes with a parser of its own, a request is accepted
only when there is one reading of it: CRLF line endings only, one Content-Length
(no lists), Transfer-Encoding exactly `chunked`, never both, exactly one Host in
HTTP/1.1, no framing field spelt with an underscore, strict chunk-size lines (no
spaces, no bare CR or LF). Anything else is refused with 400, so no worker can see a
request boundary the front did not (request smuggling past the leases and
`idle_ignore_paths`). Responses from the worker are read more leniently.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from agent.errors import ProviderdError

MAX_HEAD = 64 * 1024  # request or response head, start line to blank line
MAX_HEADERS = 128  # header fields in one head
MAX_CHUNK_LINE = 4096  # one chunk-size line (with extensions) or one trailer field

Body = Literal["none", "length", "chunked", "close", "tunnel"]

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(r"[\x21-\x7e\x80-\xff]+")  # visible characters, no spaces or controls
_REASONS = {
    100: "Continue",
    101: "Switching Protocols",
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    408: "Request Timeout",
    413: "Content Too Large",
    414: "URI Too Long",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    505: "HTTP Version Not Supported",
}


class HttpError(ProviderdError):
    """A message cannot be framed. `status` is what a client is answered (400, 431, 501, 505)."""

    code = "bad_request"

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(slots=True)
class RequestHead:
    method: str
    target: str
    version: int  # 10 or 11
    block: bytes  # the header fields as sent, through the final empty line
    body: Body  # "none", "length" or "chunked"
    length: int  # for body == "length"
    keep_alive: bool  # the client lets the connection stay open after the response
    upgrade: bool  # Upgrade requested (Connection: upgrade), or CONNECT
    expect_continue: bool
    # The target's path without the query: `/v1/x?y=1` → `/v1/x`; absolute form reduced too.
    # Made once with the head (a remembered head serves many requests: agent.net.headcache).
    path: str = field(init=False)

    def __post_init__(self) -> None:
        self.path = target_path(self.target)

    @property
    def headers(self) -> list[tuple[str, str]]:
        return fields(self.block)


def target_path(target: str) -> str:
    """A request target's path without the query (absolute form reduced to its path)."""
    if target[:1] != "/":
        scheme, sep, rest = target.partition("://")
        if not sep or not scheme.isalpha():
            return target  # authority form (CONNECT) or "*"
        slash = rest.find("/")
        target = rest[slash:] if slash >= 0 else "/"
    query = target.find("?")
    return target if query < 0 else target[:query]


@dataclass(slots=True)
class ResponseHead:
    version: int
    status: int
    reason: str
    block: bytes  # the header fields as sent, through the final empty line
    body: Body
    length: int
    keep_alive: bool  # the worker keeps the connection open after this response

    @property
    def headers(self) -> list[tuple[str, str]]:
        return fields(self.block)


def find_head_end(buf: bytes | bytearray, start: int, end: int) -> int:
    """Index just past the blank line that ends a head in buf[start:end], or -1."""
    best = -1
    i = buf.find(b"\r\n\r\n", start, end)
    if i >= 0:
        best, end = i + 4, i + 3  # below: only an earlier end made of bare LFs (RFC 9112 §2.2)
    i = buf.find(b"\n\n", start, end)
    if i >= 0:
        best, end = i + 2, i + 1
    i = buf.find(b"\n\r\n", start, end)
    if i >= 0:
        best = i + 3
    return best


def find_request_head_end(buf: bytes | bytearray, start: int, end: int) -> int:
    """find_head_end for a request head, in one search where its blank line is CRLF CRLF:
    an earlier blank line of bare LFs would end it sooner, but the strict parser refuses
    a head with any bare LF in it (400) whichever end is taken."""
    i = buf.find(b"\r\n\r\n", start, end)
    return i + 4 if i >= 0 else find_head_end(buf, start, end)


def skip_empty_lines(buf: bytes | bytearray, start: int, end: int) -> int:
    """Skip the CRLFs a client may send between requests (RFC 9112 §2.2)."""
    while start < end and buf[start] in (13, 10):
        start += 1
    return start


Buffer = bytes | bytearray

TOKEN_CHARS = rb"!#$%&'*+\-.^_`|~0-9A-Za-z"
_REQUEST_LINE = re.compile(
    rb"([" + TOKEN_CHARS + rb"]+) ([\x21-\x7e\x80-\xff]+) HTTP/([0-9])\.([0-9])\r\n"
)
_STATUS_LINE = re.compile(rb"HTTP/([0-9])\.([0-9]) ([0-9]{3})(?: ([^\r\n]*))?\r?\n")
# Possessive (nothing in a field line is ever given back): 10 % less time on a typical head.
_BLOCK = re.compile(rb"(?:[" + TOKEN_CHARS + rb"]++:[^\r\n\x00]*+\r?\n)*+\r?\n")
_STRICT_BLOCK = re.compile(rb"(?:[" + TOKEN_CHARS + rb"]++:[^\r\n\x00]*+\r\n)*+\r\n")
# A framing field's name at the start of a line, searched in a lowercased copy of the
# block from the line feed before it: a pattern that begins with a literal is searched
# for that literal first (an IGNORECASE ^-anchored one is tried at every byte: 2.2 against
# 0.8 µs for a typical head with its copy).
_FRAMING = re.compile(
    rb"\n(content[-_]length|transfer[-_]encoding|connection|upgrade|expect|host):"
)
# A field line is at least "x:" and its line end: fewer bytes than this hold at most
# MAX_HEADERS fields, uncounted.
_FEW_FIELDS_BYTES = 3 * (MAX_HEADERS + 1)


def _field_error(block: str, error_status: int) -> HttpError:
    """Why a field block failed _BLOCK (the slow path, for the message)."""
    for line in block.split("\n"):
        line = line.removesuffix("\r")
        if not line:
            break
        name, sep, value = line.partition(":")
        if line[:1] in (" ", "\t"):
            return HttpError(error_status, "obsolete line folding in a header field")
        if not sep or not _TOKEN.fullmatch(name):
            return HttpError(error_status, f"malformed header field {line[:40]!r}")
        if "\r" in value or "\x00" in value:
            return HttpError(error_status, f"forbidden character in header field {name!r}")
    return HttpError(error_status, "malformed header section")


def fields(block: bytes) -> list[tuple[str, str]]:
    """The (name, value) pairs of a validated field block, in order, names as sent."""
    out = []
    for line in block.decode("latin-1").split("\n"):
        line = line.removesuffix("\r")
        if not line:
            break
        name, _, value = line.partition(":")
        out.append((name, value.strip(" \t")))
    return out


class _Fields:
    """What the framing-relevant fields of a head say."""

    __slots__ = (
        "connection",
        "content_length",
        "content_lengths",
        "expect",
        "hosts",
        "transfer_encoding",
        "upgrade",
    )

    def __init__(self) -> None:
        self.content_length: int | None = None
        self.content_lengths = 0  # Content-Length values (fields, or items of a list)
        self.hosts = 0
        self.transfer_encoding: list[str] = []
        self.connection: frozenset[str] | set[str] = frozenset()
        self.upgrade = False
        self.expect = ""


def _fields(buf: Buffer, start: int, end: int, error_status: int, strict: bool = False) -> _Fields:
    if not (_STRICT_BLOCK if strict else _BLOCK).fullmatch(buf, start, end):
        if strict and _BLOCK.fullmatch(buf, start, end):
            raise HttpError(error_status, "a header line ends in a bare LF, not CRLF")
        raise _field_error(bytes(buf[start:end]).decode("latin-1"), error_status)
    f = _Fields()
    base = start - 1  # the line feed that ends the start line (both start lines end in one)
    low = buf[base:end].lower()
    for m in _FRAMING.finditer(low):
        key = m[1]
        at = m.end()
        value = bytes(buf[base + at : base + low.find(b"\n", at)]).strip(b" \t\r").decode("latin-1")
        if b"_" in key:
            if strict:
                name = bytes(buf[base + m.start(1) : base + m.end(1)]).decode("latin-1")
                raise HttpError(
                    error_status,
                    f"header field {name!r} refused: a server may read it as "
                    f"{name.replace('_', '-')!r}",
                )
            continue
        if key == b"host":
            f.hosts += 1
        elif key == b"content-length":
            for part in value.split(","):
                f.content_lengths += 1
                part = part.strip(" \t")
                if not part.isdigit() or not part.isascii() or len(part) > 18:
                    raise HttpError(error_status, f"invalid Content-Length {value!r}")
                n = int(part)
                if f.content_length is not None and f.content_length != n:
                    raise HttpError(error_status, "conflicting Content-Length fields")
                f.content_length = n
        elif key == b"transfer-encoding":
            f.transfer_encoding += [t.strip(" \t").lower() for t in value.split(",") if t.strip()]
        elif key == b"connection":
            f.connection = f.connection | {t.strip(" \t") for t in value.lower().split(",")}
        elif key == b"upgrade":
            f.upgrade = True
        else:
            f.expect = value.lower()
    if end - start > _FEW_FIELDS_BYTES and buf.count(b"\n", start, end) - 1 > MAX_HEADERS:
        raise HttpError(431, f"more than {MAX_HEADERS} header fields")
    return f


def _version(major: bytes, minor: bytes, error_status: int) -> int:
    version = int(major) * 10 + int(minor)
    if version not in (10, 11):
        raise HttpError(
            505 if error_status == 400 else error_status,
            f"unsupported HTTP/{major.decode()}.{minor.decode()}",
        )
    return version


def _keep_alive(version: int, connection: frozenset[str] | set[str]) -> bool:
    if "close" in connection:
        return False
    return version == 11 or "keep-alive" in connection


def _request_line_error(buf: Buffer, start: int, end: int) -> HttpError:
    nl = buf.find(b"\n", start, end)
    line = bytes(buf[start : nl if nl >= 0 else end]).decode("latin-1").split("\n")[0]
    line = line.removesuffix("\r")
    parts = line.split(" ")
    if not line:
        return HttpError(400, "empty request")
    if len(parts) != 3:
        return HttpError(400, f"malformed request line {line[:60]!r}")
    method, target, version = parts
    if not _TOKEN.fullmatch(method):
        return HttpError(400, f"malformed method {method[:20]!r}")
    if not _TARGET.fullmatch(target):
        return HttpError(400, "malformed request target")
    return HttpError(400, f"malformed protocol version {version[:20]!r}")


def parse_request_head(
    buf: Buffer | memoryview, start: int = 0, end: int | None = None
) -> RequestHead:
    """Parse the request head in buf[start:end] (request line through the blank line).
    Raises HttpError."""
    if isinstance(buf, memoryview):
        buf = bytes(buf)
    if end is None:
        end = len(buf)
    m = _REQUEST_LINE.match(buf, start, end)
    if m is None:
        raise _request_line_error(buf, start, end)
    method = m[1].decode()
    version = _version(m[3], m[4], 400)
    f = _fields(buf, m.end(), end, 400, strict=True)
    body: Body = "none"
    length = 0
    if f.content_lengths > 1:
        raise HttpError(400, "more than one Content-Length value")
    if f.hosts > 1:
        raise HttpError(400, "more than one Host field")
    if version == 11 and not f.hosts:
        raise HttpError(400, "an HTTP/1.1 request without a Host field")
    if f.transfer_encoding:
        if f.content_length is not None:
            raise HttpError(400, "both Transfer-Encoding and Content-Length")
        if version == 10:
            raise HttpError(400, "Transfer-Encoding in an HTTP/1.0 request")
        if "chunked" not in f.transfer_encoding:
            raise HttpError(
                501, f"unsupported Transfer-Encoding {', '.join(f.transfer_encoding)!r}"
            )
        if f.transfer_encoding != ["chunked"]:
            raise HttpError(
                400,
                f"Transfer-Encoding {', '.join(f.transfer_encoding)!r}: only a single "
                "'chunked' is accepted",
            )
        body = "chunked"
    elif f.content_length:
        body, length = "length", f.content_length
    return RequestHead(
        method=method,
        target=m[2].decode("latin-1"),
        version=version,
        block=bytes(buf[m.end() : end]),
        body=body,
        length=length,
        keep_alive=_keep_alive(version, f.connection),
        upgrade=method == "CONNECT" or (f.upgrade and "upgrade" in f.connection),
        expect_continue=f.expect == "100-continue",
    )


def parse_response_head(
    buf: Buffer | memoryview, method: str, start: int = 0, end: int | None = None
) -> ResponseHead:
    """Parse the response head in buf[start:end] to a request with `method`.
    Raises HttpError(502)."""
    if isinstance(buf, memoryview):
        buf = bytes(buf)
    if end is None:
        end = len(buf)
    m = _STATUS_LINE.match(buf, start, end)
    if m is None:
        line = bytes(buf[start:end]).decode("latin-1").split("\n")[0].removesuffix("\r")
        raise HttpError(502, f"malformed status line {line[:60]!r}")
    version = _version(m[1], m[2], 502)
    status = int(m[3])
    f = _fields(buf, m.end(), end, 502)
    keep_alive = _keep_alive(version, f.connection)
    body: Body
    length = 0
    if status == 101 or (method == "CONNECT" and 200 <= status < 300):
        body = "tunnel"
    elif method == "HEAD" or status < 200 or status in (204, 304):
        body = "none"
    elif f.transfer_encoding:
        if version == 11 and f.transfer_encoding[-1] == "chunked":
            body = "chunked"
        else:
            body, keep_alive = "close", False
    elif f.content_length is not None:
        body, length = "length", f.content_length
    else:
        body, keep_alive = "close", False
    reason = (m[4] or b"").decode("latin-1")
    return ResponseHead(
        version, status, reason, bytes(buf[m.end() : end]), body, length, keep_alive
    )


def error_response(
    status: int,
    body: Mapping[str, object],
    *,
    close: bool,
    retry_after_s: float | None = None,
    head_only: bool = False,
    headers: Sequence[tuple[str, str]] = (),
) -> bytes:
    """A complete HTTP/1.1 response with a JSON body, as the proxy answers by itself."""
    payload = json.dumps(body, separators=(", ", ": ")).encode() + b"\n"
    lines = [
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
    ]
    if retry_after_s is not None:
        lines.append(f"Retry-After: {max(0, math.ceil(retry_after_s))}")
    lines += [f"{name}: {value}" for name, value in headers]
    if close:
        lines.append("Connection: close")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + payload
