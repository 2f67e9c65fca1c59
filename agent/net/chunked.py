"""A chunked body (RFC 9112 §7.1), followed as its bytes pass: where it ends, and whether it
is well-formed. The data path relays the bytes unchanged; this only reads them.
"""

from __future__ import annotations

import re

from agent.net.http import MAX_CHUNK_LINE, MAX_HEADERS, TOKEN_CHARS, HttpError

_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_STRICT_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}(?:;[\x21-\x7e]+)*")
_STRICT_TRAILER = re.compile(rb"[" + TOKEN_CHARS + rb"]+:[^\r\n\x00]*")


class ChunkedScanner:
    """Follows a chunked body (RFC 9112 §7.1) as its bytes pass, to find where it ends.

    Chunk extensions and trailer fields are accepted and passed on untouched. `strict`
    (a request's body): lines end in CRLF, a size line is hex digits and extensions with
    no spaces or control characters, trailers are well-formed fields.
    """

    __slots__ = ("_line", "_remaining", "_state", "_strict", "_trailers")

    _SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)

    def __init__(self, strict: bool = False) -> None:
        self._strict = strict
        self._state = self._SIZE
        self._remaining = 0
        self._line = bytearray()
        self._trailers = 0

    @property
    def done(self) -> bool:
        return self._state == self._DONE

    def scan(self, buf: bytes | bytearray, start: int, end: int) -> int:
        """Follow buf[start:end]. Returns the index just past the body's last byte if the
        body ends there, else -1 (every byte belongs to the body). Raises HttpError(400)."""
        pos = start
        while pos < end:
            state = self._state
            if state == self._DATA:
                take = min(self._remaining, end - pos)
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._state = self._DATA_END
                continue
            if state == self._DONE:
                return pos
            nl = buf.find(b"\n", pos, end)
            if nl < 0:
                self._line += buf[pos:end]
                if len(self._line) > MAX_CHUNK_LINE:
                    raise HttpError(400, "chunk line too long")
                return -1
            if self._line:
                self._line += buf[pos:nl]
                line = bytes(self._line)
                self._line.clear()
            else:
                line = bytes(buf[pos:nl])
            pos = nl + 1
            if len(line) > MAX_CHUNK_LINE:
                raise HttpError(400, "chunk line too long")
            if line.endswith(b"\r"):
                line = line[:-1]
            elif self._strict:
                raise HttpError(400, "a chunk line ends in a bare LF, not CRLF")
            if self._strict:
                self._check(state, line)
            if state == self._SIZE:
                size = line.split(b";", 1)[0].strip(b" \t")
                if not _HEX.fullmatch(size):
                    raise HttpError(400, f"malformed chunk size {line[:20]!r}")
                self._remaining = int(size, 16)
                self._state = self._DATA if self._remaining else self._TRAILER
            elif state == self._DATA_END:
                if line:
                    raise HttpError(400, "chunk data longer than its size")
                self._state = self._SIZE
            else:  # trailer section
                if not line:
                    self._state = self._DONE
                    return pos
                self._trailers += 1
                if self._trailers > MAX_HEADERS:
                    raise HttpError(400, "too many trailer fields")
        return pos if self._state == self._DONE else -1

    def _check(self, state: int, line: bytes) -> None:
        if state == self._SIZE:
            if not _STRICT_CHUNK_SIZE.fullmatch(line):
                raise HttpError(400, f"malformed chunk size line {line[:20]!r}")
        elif state == self._TRAILER and line and not _STRICT_TRAILER.fullmatch(line):
            raise HttpError(400, f"malformed trailer field {line[:20]!r}")
