"""The API key check of one request, as the router and every front make it.

A client sends its key as `Authorization: Bearer KEY` or `x-api-key: KEY`. With keys
on (`agent.spec.apikeys`), a request without one, or with one that is not in the keys file,
is answered 401 with `WWW-Authenticate: Bearer` and a JSON body
`{"error": "<code>", "message": "..."}`; a valid key that does not reach the provider,
or that may not cause a cold start while the model is not running, is answered 403.
Both happen on the request's head alone, before anything is leased, queued or started.

Pure: `authenticate(keys, head)` → the key or a `Refusal`; `authorize(key, slug)` and
`may_start(key, slug)` → a `Refusal` or None. Messages never hold a key or its hash.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.net.answers import Answer
from agent.net.http import RequestHead
from agent.spec.apikeys import ApiKey, KeySet

REALM = 'Bearer realm="providerd"'
HOW = "send it as Authorization: Bearer KEY or as x-api-key: KEY"


@dataclass(frozen=True)
class Refusal:
    status: int  # 401 or 403
    code: str
    message: str
    invalid_token: bool = False  # RFC 6750: the key was sent and is not valid

    @property
    def cause(self) -> str:
        """The refusal's cause in the counters: `unauthorized` (401) or `forbidden` (403)."""
        return "unauthorized" if self.status == 401 else "forbidden"

    def headers(self) -> tuple[tuple[str, str], ...]:
        if self.status != 401:
            return ()
        value = REALM + (', error="invalid_token"' if self.invalid_token else "")
        return (("WWW-Authenticate", value),)

    def answer(self) -> Answer:
        """The answer, in the listener's style (flat on a provider's port, OpenAI's on the
        router), with its WWW-Authenticate."""
        return Answer(self.status, self.message, self.code, headers=self.headers())


MISSING = Refusal(401, "missing_api_key", f"This endpoint needs an API key: {HOW}")
INVALID = Refusal(
    401, "invalid_api_key", "The API key is not valid (it is in no keys file)", invalid_token=True
)
TWO = Refusal(
    401,
    "invalid_api_key",
    "The request carries more than one API key; send exactly one",
    invalid_token=True,
)


KEY_FIELDS = (b"authorization", b"x-api-key")


def without_keys(head: bytes) -> bytes:
    """A request head (request line through the empty line, CRLF only, as the parser
    accepts it) without its Authorization and x-api-key fields: what a front sends its
    worker while keys are on, so that model code never sees a client's key."""
    lines = head.split(b"\r\n")
    kept = [lines[0]]
    kept += [ln for ln in lines[1:] if ln.split(b":", 1)[0].strip().lower() not in KEY_FIELDS]
    return b"\r\n".join(kept)


def presented(req: RequestHead) -> list[str]:
    """The keys the request carries: the token of each `Authorization: Bearer` field and
    the value of each `x-api-key` field (empty ones left out). Other schemes are ignored."""
    out: list[str] = []
    for name, value in req.headers:
        key = name.lower()
        if key == "authorization":
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                out.append(token.strip())
        elif key == "x-api-key" and value.strip():
            out.append(value.strip())
    return out


def authenticate(keys: KeySet, req: RequestHead) -> ApiKey | Refusal:
    """The key `req` carries, or why it is refused (401)."""
    tokens = presented(req)
    if not tokens:
        return MISSING
    if len(set(tokens)) > 1:
        return TWO
    key = keys.find(tokens[0])
    return INVALID if key is None else key


def authorize(key: ApiKey, slug: str) -> Refusal | None:
    """403 when `key` does not reach provider `slug`."""
    if key.reaches(slug):
        return None
    return Refusal(403, "key_out_of_scope", f'This API key does not reach provider "{slug}"')


def may_start(key: ApiKey, slug: str) -> Refusal | None:
    """403 when `key` may not cause a cold start (`can_start = false`); the caller asks
    only while the model is not running."""
    if key.can_start:
        return None
    return Refusal(403, COLD_START_NOT_ALLOWED, cold_start_message(slug))


COLD_START_NOT_ALLOWED = "cold_start_not_allowed"


def cold_start_message(slug: str) -> str:
    return (
        f'The model of provider "{slug}" is not running and this API key may not start it '
        "(can_start = false); it is served once the model runs"
    )
