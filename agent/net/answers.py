"""What the data path answers by itself: one JSON shape, one function, logged, rate-limited.

Every response the front or the router makes up (400, 408, 413, 414, 415, 431, 502, 503,
504 ...) is `{"error": <stable code>, "message": <sentence>}` plus the fields a caller adds
(the front: `provider`, `retry_after_s`; GPU refusals: `holders`). The router keeps the
OpenAI shape its clients parse (`{"error": {"message", "type", "code"}}`): `Style` says which.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from agent.net.http import error_response
from agent.net.ratelog import RateLog

log = logging.getLogger(__name__)
answers = RateLog(log)

# The stable code of each status the core answers by itself, when the cause has none.
CODES = {
    400: "bad_request",
    408: "request_timeout",
    413: "request_too_large",
    414: "head_too_large",
    415: "unsupported_media_type",
    431: "head_too_large",
    501: "not_implemented",
    502: "bad_gateway",
    503: "unavailable",
    504: "upstream_timeout",
    505: "http_version_not_supported",
}


@dataclass(slots=True)
class Answer:
    """A response made up here: status, stable code, the sentence, and what else goes in."""

    status: int
    message: str
    code: str = ""
    retry_after_s: float | None = None
    extra: Mapping[str, object] = field(default_factory=dict)
    kind: str = ""  # OpenAI style: "invalid_request_error" or "server_error"
    close: bool = False  # the connection closes after it, whatever the request said
    headers: tuple[tuple[str, str], ...] = ()  # such as WWW-Authenticate on a 401
    doc: Mapping[str, object] | None = None  # a 2xx of the listener's own: this is the body

    def __post_init__(self) -> None:
        if not self.code:
            self.code = CODES.get(self.status, "error")


def note(a: Answer, what: str) -> None:
    """The front's log line for an answer: a warning, rate-limited per status."""
    answers.log(
        str(a.status), "Answered a client %d: %s", a.status, a.message, level=logging.WARNING
    )


class Style:
    """How one listener's answers look and are logged. The front's: flat, with its
    provider's name; the router's: OpenAI's, logged by the router."""

    def __init__(
        self,
        provider: str | None = None,
        openai: bool = False,
        log: Callable[[Answer, str], None] = note,
    ) -> None:
        self.provider = provider
        self.openai = openai
        self.log = log

    def body(self, a: Answer) -> dict[str, object]:
        if a.doc is not None:
            return dict(a.doc)
        if self.openai:
            kind = a.kind or ("server_error" if a.status >= 500 else "invalid_request_error")
            return {"error": {"message": a.message, "type": kind, "code": a.code}, **a.extra}
        body: dict[str, object] = {"error": a.code, "message": a.message}
        if self.provider is not None:
            body["provider"] = self.provider
            body["retry_after_s"] = a.retry_after_s
        body.update(a.extra)
        return body


def made_up(
    style: Style, a: Answer, *, close: bool, head_only: bool = False, what: str = ""
) -> bytes:
    """The bytes of answer `a`, logged (rate-limited per status) with its cause when it
    refuses."""
    if a.status >= 400:
        style.log(a, what)
    return error_response(
        a.status,
        style.body(a),
        close=close,
        retry_after_s=a.retry_after_s,
        head_only=head_only,
        headers=a.headers,
    )
