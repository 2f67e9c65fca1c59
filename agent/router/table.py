"""The router's pure parts: the routing table (model name → provider), the requested
`model` of a JSON body, refusals as OpenAI-style errors.

The requested name is only ever a dictionary key or a regular expression's subject:
it reaches log lines and messages through `quoted()` (JSON-escaped, cut short), never a
command line or a path.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Mapping

from agent.errors import ProviderdError
from agent.spec.patterns import Pattern, PatternError, compile_pattern, nested_repetition
from agent.spec.provider import Address, Provider

__all__ = ["nested_repetition"]

MODELS_PATH = "/v1/models"
NAME_SHOWN_MAX = 120  # characters of a requested name shown in logs and messages
CACHE_MAX = 4096  # pattern lookups remembered
PATTERN_NAME_MAX = 256  # longer names are looked up exactly, never matched against patterns


class Refusal(ProviderdError):
    """A request the router answers itself, with an OpenAI-style error body."""

    code = "refused"

    def __init__(
        self, status: int, message: str, code: str, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message, code=code)
        self.status = status
        self.kind = kind

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code}}


def quoted(name: str) -> str:
    """A client-chosen string as it may appear in a log line or a message: JSON-escaped
    (control characters, quotes and non-ASCII written as escapes) and cut short."""
    if len(name) > NAME_SHOWN_MAX:
        return f"{json.dumps(name[:NAME_SHOWN_MAX])}... ({len(name)} characters)"
    return json.dumps(name)


def target_address(address: Address) -> Address:
    """Where to connect for a listen address: a wildcard host means this host's loopback."""
    if address.host == "0.0.0.0":
        return Address("127.0.0.1", address.port)
    if address.host == "::":
        return Address("::1", address.port)
    return address


class Table:
    """Model name → provider. Exact names first, then patterns (full match). A name that
    patterns of two providers match is refused (409) rather than guessed: `providerctl
    check` cannot see every overlap between two regular expressions."""

    def __init__(self, providers: Iterable[Provider], created: Mapping[str, int] | None = None):
        self.providers = sorted(providers, key=lambda p: p.slug)
        self.names: dict[str, Provider] = {}
        self.patterns: list[tuple[Pattern, Provider]] = []
        self.skipped: list[str] = []  # patterns left out, with why
        for p in self.providers:
            for name in p.model_names:
                self.names.setdefault(name, p)  # collisions were refused by the manifest checks
            for pattern in p.model_patterns:
                try:
                    compiled = compile_pattern(pattern)  # matched in time linear in the name
                except PatternError as e:  # the manifest checks refuse these: not here
                    self.skipped.append(f'provider "{p.slug}": pattern {quoted(pattern)} {e}')
                    continue
                if nested_repetition(compiled):
                    self.skipped.append(
                        f'provider "{p.slug}": pattern {quoted(pattern)} repeats a repetition '
                        "(like (a+)+), which can take exponential time on a crafted name"
                    )
                    continue
                self.patterns.append((compiled, p))
        self.created = dict(created or {})
        self._cache: dict[str, tuple[Provider, ...]] = {}

    def matches(self, model: str) -> tuple[Provider, ...]:
        """The providers whose names or patterns take `model`: one, none, or (patterns
        only) several."""
        exact = self.names.get(model)
        if exact is not None:
            return (exact,)
        if len(model) > PATTERN_NAME_MAX:
            return ()  # bounds the cost of any one lookup: patterns see short names only
        hit = self._cache.get(model)
        if hit is None:
            found: list[Provider] = []
            for rx, p in self.patterns:
                if (not found or found[-1] is not p) and p not in found and rx.fullmatch(model):
                    found.append(p)
            hit = tuple(found)
            if len(self._cache) >= CACHE_MAX:
                self._cache.clear()
            self._cache[model] = hit
        return hit

    def lookup(self, model: str) -> Provider:
        """The provider that serves `model`. Raises Refusal (404, or 409 when ambiguous)."""
        found = self.matches(model)
        if len(found) == 1:
            return found[0]
        if not found:
            raise Refusal(
                404,
                f"The model {quoted(model)} does not exist: no provider serves it "
                f"(GET {MODELS_PATH} lists the model names)",
                "model_not_found",
            )
        who = ", ".join(f'"{p.slug}"' for p in found)
        raise Refusal(
            409,
            f"The model {quoted(model)} is matched by patterns of several providers ({who}); "
            "narrow their [models] patterns so that one provider serves it",
            "model_ambiguous",
        )

    def entry(self, name: str, provider: Provider) -> dict[str, object]:
        return {
            "id": name,
            "object": "model",
            "created": self.created.get(provider.slug, 0),
            "owned_by": provider.slug,
        }

    def listing(self, reaches: Callable[[str], bool] | None = None) -> dict[str, object]:
        """`GET /v1/models`: every exact name (of the providers `reaches` accepts, if given),
        in OpenAI's list format."""
        data = [
            self.entry(n, p) for n, p in self.names.items() if reaches is None or reaches(p.slug)
        ]
        return {"object": "list", "data": data}


def dechunk(buf: bytes | bytearray, start: int, end: int) -> bytes:
    """The data of the complete chunked body in buf[start:end] (framing already checked by
    ChunkedScanner): chunk extensions and trailers dropped."""
    out = bytearray()
    pos = start
    while pos < end:
        nl = buf.index(b"\n", pos, end)
        size = int(bytes(buf[pos:nl]).split(b";", 1)[0].strip(b" \t\r"), 16)
        pos = nl + 1
        if size == 0:
            break
        out += buf[pos : pos + size]
        pos = buf.index(b"\n", pos + size, end) + 1
    return bytes(out)


# What json.loads runs (the C scanner), without the Python around it.
_SCAN: Callable[[str, int], tuple[object, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
# What the short way's scanning raises on a body json.loads refuses too: UnicodeDecodeError
# (a ValueError), JSONDecodeError, RecursionError, StopIteration (a member's value missing,
# as in `{"a":}`: the scanner's own way of saying "Expecting value").
_NOT_JSON = (ValueError, RecursionError, StopIteration)


def model_of(body: bytes | bytearray) -> str:
    """The top-level `model` of a JSON request body, as `json.loads(body)["model"]` reads
    it (the last of duplicate keys, escapes decoded). Raises Refusal(400).

    The usual body the short way, with the same result: a body that begins `{` and a byte
    other than NUL is UTF-8 to json.loads as well (no UTF-16 or UTF-32 detected, no BOM),
    has no whitespace before its value and is scanned by the same C scanner, so where the
    scanner fails json.loads fails too; what may follow the value is JSON whitespace
    alone, as json.loads requires. Any other body goes to json.loads."""
    if len(body) > 1 and body[0] == 0x7B and body[1]:  # "{" and not NUL (no slices made)
        try:
            text = body.decode("utf-8", "surrogatepass")
            doc, end = _SCAN(text, 0)
            if end != len(text) and text[end:].strip(" \t\n\r"):
                raise ValueError("Extra data")
        except _NOT_JSON:
            raise _invalid_json() from None
    else:
        doc = _loads(body)
    model = doc.get("model") if type(doc) is dict else _NOT_AN_OBJECT
    if type(model) is str and model:
        return model
    if model is _NOT_AN_OBJECT:
        raise Refusal(
            400,
            'The request body is not a JSON object; the router routes by its "model" field',
            "invalid_json",
        )
    if model is None:
        raise Refusal(400, 'The request body has no "model" field', "missing_model")
    raise Refusal(400, 'The request body\'s "model" is not a non-empty string', "invalid_model")


def _loads(body: bytes | bytearray) -> object:
    """json.loads(body). Raises Refusal(400): no body, or not JSON."""
    if not body or body.isspace():
        raise Refusal(
            400,
            'The request has no body; the router routes by the "model" field of a JSON body',
            "missing_model",
        )
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise _invalid_json() from None


def _invalid_json() -> Refusal:
    return Refusal(
        400,
        'The request body is not valid JSON; the router routes by its "model" field',
        "invalid_json",
    )


_NOT_AN_OBJECT = object()


def table_from(providers: Iterable[Provider]) -> Table:
    """The routing table, with each manifest's modification time as its models' `created`."""
    providers = list(providers)
    created: dict[str, int] = {}
    for p in providers:
        with contextlib.suppress(OSError):
            created[p.slug] = int(p.source.stat().st_mtime)
    return Table(providers, created)
