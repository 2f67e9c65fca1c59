"""The router's pure parts: the table (exact before pattern, ambiguity, escaping) and the
body (JSON `model`, chunked data)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agent.net.chunked import ChunkedScanner
from agent.router import table as routing
from agent.router.table import Refusal, Table, dechunk, model_of, quoted, target_address
from agent.spec.provider import Address, Provider


def provider(slug: str, names: tuple[str, ...] = (), patterns: tuple[str, ...] = ()) -> Provider:
    return Provider(
        slug=slug,
        source=Path(f"/etc/providerd/providers/{slug}.toml"),
        addresses=(Address("127.0.0.1", 9000),),
        model_names=names,
        model_patterns=patterns,
    )


def refusal(table: Table, model: str) -> Refusal:
    with pytest.raises(Refusal) as e:
        table.lookup(model)
    return e.value


def test_exact_names_come_before_patterns() -> None:
    a = provider("a", names=("llama-3",))
    b = provider("b", patterns=("llama-.*",))
    table = Table([b, a])
    assert table.lookup("llama-3") is a
    assert table.lookup("llama-4") is b
    assert table.lookup("llama-3") is a  # and again, from the cache


def test_patterns_match_in_full() -> None:
    table = Table([provider("q", patterns=("qwen2\\.5-7b(:.*)?",))])
    assert table.lookup("qwen2.5-7b").slug == "q"
    assert table.lookup("qwen2.5-7b:q4").slug == "q"
    for model in ("qwen2.5-7b-instruct", "xqwen2.5-7b", "qwen2x5-7b"):
        assert refusal(table, model).status == 404


def test_one_provider_with_two_matching_patterns_is_not_ambiguous() -> None:
    table = Table([provider("a", patterns=("m.*", ".*1"))])
    assert table.lookup("m1").slug == "a"


def test_patterns_of_two_providers_matching_one_name_are_refused_naming_both() -> None:
    table = Table([provider("b", patterns=(".*-7b",)), provider("a", patterns=("llama-.*",))])
    r = refusal(table, "llama-7b")
    assert r.status == 409
    assert r.body() == {
        "error": {
            "message": 'The model "llama-7b" is matched by patterns of several providers '
            '("a", "b"); narrow their [models] patterns so that one provider serves it',
            "type": "invalid_request_error",
            "code": "model_ambiguous",
        }
    }
    assert table.lookup("llama-8b").slug == "a"
    assert table.lookup("mistral-7b").slug == "b"


def test_an_unknown_model_is_404_in_openai_style() -> None:
    r = refusal(Table([provider("a", names=("x",))]), "gpt-9")
    assert r.status == 404
    assert r.body() == {
        "error": {
            "message": 'The model "gpt-9" does not exist: no provider serves it '
            "(GET /v1/models lists the model names)",
            "type": "invalid_request_error",
            "code": "model_not_found",
        }
    }


@pytest.mark.parametrize(
    "model",
    ['a"b', "line\nbreak", "nul\x00", "esc\x1b[31m", "ünïcode", "../../etc/passwd", "$(rm -rf /)"],
)
def test_a_requested_name_is_shown_escaped(model: str) -> None:
    r = refusal(Table([]), model)
    shown = quoted(model)
    assert shown == json.dumps(model)
    assert shown in r.message
    assert shown.isascii() and shown.isprintable()


def test_a_long_name_is_never_matched_against_patterns_and_is_shown_cut_short() -> None:
    table = Table([provider("a", patterns=("x+",)), provider("b", names=("y" * 1000,))])
    model = "x" * 100_000
    assert refusal(table, model).status == 404
    assert model not in table._cache
    assert table.lookup("x" * routing.PATTERN_NAME_MAX).slug == "a"
    assert table.lookup("y" * 1000).slug == "b"  # exact names of any length still route
    shown = quoted(model)
    assert len(shown) < 200 and shown.endswith("... (100000 characters)")


def test_a_crafted_name_costs_little_against_a_backtracking_pattern() -> None:
    """Regression: `llama-.*-.*-instruct` against a 40 KB name took 9.3 s, and every other
    request waited."""
    table = Table([provider("a", patterns=("llama-.*-.*-instruct",))])
    began = time.process_time()
    assert refusal(table, "llama-" + "-" * 40_000).status == 404
    assert refusal(table, "llama-" + "-" * (routing.PATTERN_NAME_MAX - 6)).status == 404
    assert time.process_time() - began < 0.1


@pytest.mark.parametrize(
    ("pattern", "nested"),
    [
        ("(a+)+b", True),
        ("(\\w+\\s?)+$", True),
        ("(?:a|b+)*", True),
        ("llama-.*-.*-instruct", False),
        ("b-.*", False),
        ("(ab)*", False),
        ("(a{2})*", False),
        ("qwen2\\.5-[0-9]+b(-instruct)?", False),
    ],
)
def test_patterns_with_nested_repetition_are_left_out(pattern: str, nested: bool) -> None:
    assert routing.nested_repetition(pattern) is nested
    table = Table([provider("a", patterns=(pattern,))])
    assert (len(table.patterns), len(table.skipped)) == ((0, 1) if nested else (1, 0))


def test_the_pattern_cache_is_bounded() -> None:
    table = Table([provider("a", patterns=("n[0-9]+",))])
    for i in range(routing.CACHE_MAX + 10):
        table.lookup(f"n{i}")
    assert len(table._cache) <= routing.CACHE_MAX


def test_listing_has_every_exact_name_and_no_pattern() -> None:
    table = Table(
        [provider("b", names=("b1",), patterns=("b-.*",)), provider("a", names=("a1", "a2"))],
        created={"a": 100, "b": 200},
    )
    assert table.listing() == {
        "object": "list",
        "data": [
            {"id": "a1", "object": "model", "created": 100, "owned_by": "a"},
            {"id": "a2", "object": "model", "created": 100, "owned_by": "a"},
            {"id": "b1", "object": "model", "created": 200, "owned_by": "b"},
        ],
    }


def test_a_wildcard_address_is_reached_on_loopback() -> None:
    assert target_address(Address("0.0.0.0", 1)) == Address("127.0.0.1", 1)
    assert target_address(Address("::", 1)) == Address("::1", 1)
    assert target_address(Address("10.0.0.1", 1)) == Address("10.0.0.1", 1)
    unix = Address(None, None, "/run/x.sock")
    assert target_address(unix) == unix


# -- the body


def test_model_of_takes_the_top_level_model() -> None:
    assert model_of(b'{"model": "m", "messages": []}') == "m"
    assert model_of(b'  {"messages": [{"model": "inner"}], "model": "outer"}\n') == "outer"
    assert model_of('{"model": "ünï"}'.encode()) == "ünï"
    assert model_of('{"model": "x"}'.encode("utf-16")) == "x"  # RFC 8259 detection


JSONISH = st.text(alphabet='{}[]":, \t\r\n\x00\\umodelx1.-eü\ud800', max_size=40)


def as_json_loads_reads_it(body: bytes) -> str | tuple[int, str, str]:
    """What model_of must answer, spelt with json.loads: the model, or the refusal's status,
    code and message."""

    def refused(code: str, message: str) -> tuple[int, str, str]:
        return (400, code, message)

    if not body or body.isspace():
        return refused(
            "missing_model",
            'The request has no body; the router routes by the "model" field of a JSON body',
        )
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return refused(
            "invalid_json",
            'The request body is not valid JSON; the router routes by its "model" field',
        )
    if not isinstance(doc, dict):
        return refused(
            "invalid_json",
            'The request body is not a JSON object; the router routes by its "model" field',
        )
    model = doc.get("model")
    if model is None:
        return refused("missing_model", 'The request body has no "model" field')
    if not isinstance(model, str) or not model:
        return refused("invalid_model", 'The request body\'s "model" is not a non-empty string')
    return model


def answer_of(body: bytes | bytearray) -> str | tuple[int, str, str]:
    try:
        return model_of(body)
    except Refusal as e:
        assert e.kind == "invalid_request_error"
        return (e.status, e.code, e.message)


JSONISH = st.text(alphabet='{}[]":, \t\r\n\x00\\umodelx1.-eü\ud800', max_size=40)
# JSON's whitespace, and what json.loads does not take as such.
BLANKS = st.text(alphabet=" \t\r\n", max_size=3) | st.sampled_from(["\x0b", "\x0c", "\xa0", "\x00"])
# How a key or a value may be spelt: plain, or with escapes json.loads decodes to the same.
KEYS = st.sampled_from([
    '"model"', '"\\u006dodel"', '"mode\\u006C"', '"\\u006d\\u006f\\u0064\\u0065\\u006c"',
    '"Model"', '"model "', '"model\\u0000"', '"messages"', '"m"', '""', '"\\ud800"',
])  # fmt: skip
VALUES = st.sampled_from([
    '"x"', '"llama-3"', '""', '"\\u0078"', '"a\\"b"', '"\\\\"', '"\\ud800"', '"ü"', '"\\/"',
    '"bad \\q escape"', '"tab\there"', "null", "true", "3", "-0", "1e400", "NaN", "Infinity",
    "[]", '["x"]', "{}", '{"model": "inner"}', '"unterminated', "01", "[1,]",
])  # fmt: skip


@st.composite
def objects(draw: st.DrawFn) -> str:
    """A JSON-ish object: its members in any number, keys and values spelt many ways,
    duplicates and blanks anywhere, now and then nested, and what may follow it."""
    members = []
    for _ in range(draw(st.integers(0, 4))):
        key, value = draw(KEYS), draw(st.one_of(VALUES, VALUES, VALUES, st.deferred(objects)))
        members.append(draw(BLANKS) + key + draw(BLANKS) + ":" + draw(BLANKS) + value)
    inside = ",".join(members) + draw(st.sampled_from(["", "", ",", " "]))
    return (
        draw(BLANKS)
        + "{"
        + inside
        + draw(BLANKS)
        + "}"
        + draw(st.sampled_from(["", "", " \r\n\t", "x", "{}", "\x00", ",", "\x0b"]))
    )


@settings(max_examples=1500)
@given(
    st.one_of(
        st.binary(max_size=40),
        st.binary(max_size=40).map(lambda b: b"{" + b),
        st.tuples(JSONISH, st.sampled_from(["utf-8", "utf-16-le", "utf-16", "utf-32-le"])).map(
            lambda t: t[0].encode(t[1], "surrogatepass")
        ),
        st.tuples(objects(), st.sampled_from(["utf-8", "utf-8", "utf-16-le", "utf-8-sig"])).map(
            lambda t: t[0].encode(t[1], "surrogatepass")
        ),
        st.tuples(  # a valid object, then what may or may not follow one
            st.dictionaries(st.sampled_from(["model", "x"]), st.text(max_size=3), max_size=2),
            st.text(alphabet=" \t\r\n\x0b\x0c\x00,}]x\xa0\u2028", max_size=3),
        ).map(
            lambda t: (json.dumps(t[0], ensure_ascii=False) + t[1]).encode("utf-8", "surrogatepass")
        ),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=5),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(
                    st.sampled_from(["model", "x", ""]) | st.text(max_size=5), inner, max_size=3
                )
            ),
            max_leaves=8,
        ).flatmap(
            lambda doc: st.sampled_from(["utf-8", "utf-16-le", "utf-16-be", "utf-32-le"]).map(
                lambda codec: json.dumps(doc, ensure_ascii=False).encode(codec, "surrogatepass")
            )
        ),
    )
)
@example('{"model": "x"}'.encode("utf-16-le"))
@example('{"model": "x"}'.encode("utf-32-le"))
@example('{"model": "x"}'.encode("utf-8-sig"))
@example(b'{"model": "x"} \r\n\t')
@example(b'{"model": "x"} x')
@example(b'{"model": "x"}\x0b')
@example(b'{"model": "x"}{}')
@example(b'{"model": "x", "model": 3}')
@example(b'{"model": 3, "\\u006dodel": "x"}')
@example(b'{"Model": "a", "model": "b"}')
@example(b'{"Model": "a"}')
@example(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
@example(b"{")
@example(b'{"model":}')
@example(b"{\x00")
@example(b"{\xff}")
@example(b'{"model": "\\ud800"}')
@example(b'{"model": "\xed\xa0\x80"}')
@example(b" \x0b\x0c")
@example(b"")
def test_the_model_is_read_as_json_loads_reads_it(body: bytes) -> None:
    """The quick way to the model (UTF-8 when the body begins `{`) gives what json.loads
    gives, or the same refusal, on any body."""
    assert answer_of(body) == as_json_loads_reads_it(body)
    assert answer_of(bytearray(body)) == as_json_loads_reads_it(body)  # as the router has it


def test_a_utf8_body_with_an_escaped_surrogate_reads_as_json_loads_reads_it() -> None:
    body = b'{"model": "\xed\xa0\x80"}'  # a lone surrogate, as json.loads takes it
    assert model_of(body) == json.loads(body)["model"]


def test_a_model_deep_in_a_large_body() -> None:
    messages = [{"role": "user", "content": "word " * 1000} for _ in range(1000)]
    body = json.dumps({"messages": messages, "stream": True, "model": "deep"}).encode()
    assert len(body) > 5_000_000
    assert model_of(body) == "deep"


def test_duplicate_model_keys_take_the_last_like_pythons_json() -> None:
    assert model_of(b'{"model": "first", "model": "last"}') == "last"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"", "missing_model"),
        (b"  \r\n", "missing_model"),
        (b"model=x", "invalid_json"),
        (b'{"model": "x"', "invalid_json"),
        (b"\xff\xfe\x00", "invalid_json"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
        (b'["model", "x"]', "invalid_json"),
        (b'"model"', "invalid_json"),
        (b'{"messages": []}', "missing_model"),
        (b'{"model": null}', "missing_model"),
        (b'{"input": {"model": "nested"}}', "missing_model"),
        (b'{"model": 3}', "invalid_model"),
        (b'{"model": ""}', "invalid_model"),
        (b'{"model": ["a"]}', "invalid_model"),
    ],
)
def test_bodies_without_a_usable_model_are_400(body: bytes, code: str) -> None:
    with pytest.raises(Refusal) as e:
        model_of(body)
    assert e.value.status == 400
    assert e.value.code == code
    assert e.value.body()["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_dechunk_drops_framing_extensions_and_trailers() -> None:
    raw = b'5;ext=1\r\n{"mod\r\n09\r\nel": "m"}\r\n3\n  x\n0\r\nTrailer: t\r\n\r\n'
    end = ChunkedScanner().scan(raw, 0, len(raw))
    assert end == len(raw)
    assert dechunk(raw, 0, end) == b'{"model": "m"}  x'
    framed = b"HEAD" + raw + b"NEXT"
    assert dechunk(framed, 4, 4 + len(raw)) == b'{"model": "m"}  x'
    assert dechunk(b"0\r\n\r\n", 0, 5) == b""


def test_the_hosts_dns_name_is_learned_aside_and_a_stalled_resolver_stalls_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: the router called socket.getfqdn() as it started: a resolver that did not
    answer stalled the start. Now the name is looked up in a thread, bounded."""
    import asyncio
    import threading
    import time

    from agent.net import origin

    release = threading.Event()

    def stalled() -> str:
        release.wait(10)
        return "slow.example"

    monkeypatch.setattr(origin.socket, "getfqdn", stalled)
    monkeypatch.setattr(origin, "DNS_WAIT_S", 0.2)
    t = time.monotonic()
    check = origin.OriginCheck([], names=None)
    assert time.monotonic() - t < 0.1
    asyncio.run(check.learn_dns_name())
    release.set()
    assert time.monotonic() - t < 2 and not check.local("slow.example")

    monkeypatch.setattr(origin.socket, "getfqdn", lambda: "Box.Lab.Example.")
    check = origin.OriginCheck([], names=None)
    assert not check.local("box.lab.example")
    asyncio.run(check.learn_dns_name())
    assert check.local("box.lab.example")


def test_a_remembered_host_verdict_is_revised_once_the_hosts_dns_name_is_known(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    from agent.net import origin
    from agent.net.http import parse_request_head

    monkeypatch.setattr(origin.socket, "getfqdn", lambda: "box.lab.example")
    check = origin.OriginCheck([], names=None)
    req = parse_request_head(b"GET /v1/models HTTP/1.1\r\nHost: box.lab.example:8100\r\n\r\n")
    for _ in range(2):
        refused = check.check(req)
        assert refused is not None and refused[2] == "forbidden_host"
    asyncio.run(check.learn_dns_name())
    assert check.check(req) is None
    posted = parse_request_head(
        b"POST /v1/x HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/plain\r\n"
        b"Content-Length: 2\r\n\r\n"
    )
    for _ in range(2):
        refused = check.check(posted)
        assert refused is not None and refused[0] == 415
