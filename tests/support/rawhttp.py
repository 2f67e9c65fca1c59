"""Raw HTTP/1.1 over a socket with a reader of the tests' own: byte-exact requests,
pipelining, interim (1xx) responses as their own, chunked bodies. It shares no code with
the product's HTTP parser, so a test that reads the product's output through it checks
that output independently.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass


class Reader:
    """Buffered reads from a socket: heads, exact lengths, chunked bodies."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def head(self) -> bytes | None:
        """Up to and including the blank line; None when the peer closes first."""
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if not self.fill():
                return None
        head, self.buf = self.buf[: end + 4], self.buf[end + 4 :]
        return head

    def exact(self, n: int) -> bytes | None:
        while len(self.buf) < n:
            if not self.fill():
                return None
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def line(self) -> bytes | None:
        while (end := self.buf.find(b"\r\n")) < 0:
            if not self.fill():
                return None
        out, self.buf = self.buf[:end], self.buf[end + 2 :]
        return out

    def chunked(self) -> tuple[bytes, bytes] | None:
        """A chunked body: (the data, the bytes as they came); None if the peer closes."""
        data, raw = b"", b""
        while True:
            size_line = self.line()
            if size_line is None:
                return None
            raw += size_line + b"\r\n"
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while (trailer := self.line()) not in (b"", None):
                    raw += trailer + b"\r\n"
                if trailer is None:
                    return None
                return data, raw + b"\r\n"
            chunk = self.exact(size + 2)
            if chunk is None:
                return None
            data += chunk[:size]
            raw += chunk


def parse_head(head: bytes) -> tuple[list[str], dict[str, str]]:
    """The start line's words and the header fields (lowercase names, last one wins)."""
    lines = head.decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
    return lines[0].split(" ", 2), fields


class RawClient:
    """A client connection that sends bytes as given and reads responses one by one."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 10) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.reader = Reader(self.sock)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def response(self, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
        """One response (an interim 1xx one as its own): status, headers, body."""
        head = self.reader.head()
        assert head is not None, f"connection closed; got {self.reader.buf!r}"
        start, headers = parse_head(head)
        status = int(start[1])
        if status < 200 or status in (204, 304) or method == "HEAD":
            return status, headers, b""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = self.reader.chunked()
            assert body is not None, "connection closed inside a chunked body"
            return status, headers, body[0]
        if "content-length" in headers:
            data = self.reader.exact(int(headers["content-length"]))
            assert data is not None, "connection closed inside the body"
            return status, headers, data
        while self.reader.fill():  # delimited by the close
            pass
        data, self.reader.buf = self.reader.buf, b""
        return status, headers, data

    def closed(self) -> bool:
        """Read to the end: True once the peer has closed (after whatever it sent)."""
        try:
            while self.reader.fill():
                pass
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()


@dataclass(frozen=True)
class Request:
    raw: bytes  # head and body exactly as they came
    method: str
    target: str
    headers: dict[str, str]

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"

    @property
    def expect_continue(self) -> bool:
        return self.headers.get("expect", "").lower() == "100-continue"


def read_request(reader: Reader, on_head: object = None) -> Request | None:
    """One request from a client (for fake upstreams); None when it closes first.
    `on_head(request_without_body)`, if given, runs before the body is read (to answer
    `Expect: 100-continue`)."""
    head = reader.head()
    if head is None:
        return None
    start, headers = parse_head(head)
    request = Request(head, start[0], start[1] if len(start) > 1 else "", headers)
    if callable(on_head):
        on_head(request)
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = reader.chunked()
        if body is None:
            return None
        raw = body[1]
    else:
        length = int(headers.get("content-length", "0") or 0)
        got = reader.exact(length)
        if got is None:
            return None
        raw = got
    return Request(head + raw, request.method, request.target, headers)
