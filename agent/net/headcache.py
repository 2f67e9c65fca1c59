"""Parsed heads, remembered.

A keep-alive client sends much the same head with every request, and a worker answers
with the same head for every response of a kind (its `Date` changes once a second at
most). Parsing is a pure function of a head's bytes (and, for a response, of the
request's method), so the parse of a head seen before is looked up, not redone: one
copy of the bytes and a dictionary lookup instead of two regular expressions and a
dozen decodes. Only heads up to KEY_MAX bytes are remembered, at most ENTRIES of each
kind (all forgotten at once when full), so the memory is bounded (2 x 256 x 1 KiB) and
a client sending ever new heads costs one more lookup per head. A head that fails to
parse is never remembered: it raises every time.

The heads returned are shared between requests: nobody may change them.
"""

from __future__ import annotations

from agent.net.http import RequestHead, ResponseHead, parse_request_head, parse_response_head

KEY_MAX = 1024  # bytes of a head worth remembering
ENTRIES = 256  # heads remembered, per kind

_requests: dict[bytes, RequestHead] = {}
_responses: dict[bytes, ResponseHead] = {}


def request_head(buf: bytearray, start: int, end: int) -> RequestHead:
    """parse_request_head(buf, start, end), remembered. Raises HttpError."""
    if end - start > KEY_MAX:
        return parse_request_head(buf, start, end)
    key = bytes(buf[start:end])
    req = _requests.get(key)
    if req is None:
        req = parse_request_head(key)
        if len(_requests) >= ENTRIES:
            _requests.clear()
        _requests[key] = req
    return req


def response_head(buf: bytes | bytearray, method: str, start: int, end: int) -> ResponseHead:
    """parse_response_head(buf, method, start, end), remembered for the methods whose
    responses are framed alike (all but HEAD and CONNECT). Raises HttpError."""
    if end - start > KEY_MAX or method == "HEAD" or method == "CONNECT":
        return parse_response_head(buf, method, start, end)
    key = bytes(buf[start:end])
    resp = _responses.get(key)
    if resp is None:
        resp = parse_response_head(key, method)
        if len(_responses) >= ENTRIES:
            _responses.clear()
        _responses[key] = resp
    return resp
