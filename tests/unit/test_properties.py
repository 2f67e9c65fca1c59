"""Property-based tests of the parsers that meet operators' files, and of rendering.

- Any bytes, or a mutated example, given to the manifest parser or to providerd.toml's
  parser: never an exception; a provider (or settings), or problems with a message.
- Any manifest the checks accept renders to drop-ins that systemd reads back (by its
  own rules: comments, continuation lines, quoting, specifiers) as exactly the
  directives and values meant, and nothing else.

The unit tier runs a small budget; `make fuzz` a long one (tests/conftest.py).
"""

from __future__ import annotations

import re
import string
import time
from pathlib import Path
from typing import Any

import pytest
from cases.fuzzing import seeds, tried
from cases.harness import CASE_HOST, environment, exec_argv, read_unit, unspecify
from hypothesis import example, given
from hypothesis import strategies as st

from agent.spec import manifest
from agent.spec import settings as config
from agent.spec.patterns import PatternError, compile_pattern
from agent.spec.placeholders import fill_placeholders
from agent.spec.provider import Address, Problem, Provider
from agent.systemd import router_units, units

SOURCE = Path("/etc/providerd/providers/prop.toml")
SEEDS = seeds()

# -- bytes in, never an exception out --------------------------------------------------------


@st.composite
def mutated(draw: st.DrawFn, sources: list[bytes]) -> bytes:
    data = bytearray(draw(st.sampled_from(sources)))
    for _ in range(draw(st.integers(1, 8))):
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        op = draw(st.integers(0, 4))
        if op == 0:
            del data[i : i + draw(st.integers(1, 16))]
        elif op == 1:
            data[i:i] = data[i : i + draw(st.integers(1, 64))] * draw(st.integers(1, 4))
        elif op == 2:
            data[i] = draw(st.integers(0, 255))
        elif op == 3:
            data[i:i] = draw(st.sampled_from(TOKENS))
        else:
            data[i:i] = draw(st.binary(max_size=8))
    return bytes(data)


TOKENS = [
    b"[", b"]", b"[[", b"{", b"}", b"=", b'"', b"'", b'"""', b",", b".", b"\n", b"\\",
    b"\\n", b"%", b"$", b"#", b"\x00", b"\xff", b"\xe9", b"9" * 400, b"1e400", b"nan",
    b"-inf", b"0x7f", b"[" * 60, b"::1%lo", b"\\u000a", b"G", b"E", b"9" * 5000, b"0" * 5000,
]  # fmt: skip

MANIFEST_BYTES = st.one_of(st.binary(max_size=512), mutated(SEEDS))
CONFIG_SEEDS = [
    b'[router]\nenabled = true\naddress = ["127.0.0.1:8100", "[::1]:8100", "/run/r.sock"]\n'
    b'max_body = "16M"\nidle_timeout_s = 600\n[gpu]\nheadroom_gb = 1.0\n',
    *[p for p in SEEDS if b"[router]" in p],
]
CONFIG_BYTES = st.one_of(st.binary(max_size=256), mutated(CONFIG_SEEDS))


def assert_problems(result: object, file: str) -> None:
    assert isinstance(result, list) and result, result
    for p in result:
        assert isinstance(p, Problem) and p.file == file and p.message
        line = str(p)
        assert "\n" not in line and "\r" not in line
        line.encode("utf-8")


@given(MANIFEST_BYTES)
@example(b"a = " + b"[" * 5000 + b"]" * 5000)
@example(b'[limits]\nmemory_max = "' + b"9" * 400 + b'G"\n')
@example(b"[listen]\nmax_held = " + b"9" * 5000 + b"\n")
@example(b'[listen]\naddress = "127.0.0.1:' + b"9" * 5000 + b'"\n')
@example(b'[limits]\ncpu_quota = "' + b"9" * 5000 + b'%"\nmemory_max = "' + b"0" * 5000 + b'1G"\n')
def test_manifest_bytes_never_raise(raw: bytes) -> None:
    tried("manifest bytes")
    result = manifest.parse_bytes(raw, SOURCE, "prop", CASE_HOST)
    if isinstance(result, Provider):
        assert units.render(result)
    else:
        assert_problems(result, str(SOURCE))


@given(CONFIG_BYTES)
@example(b"[router]\naddress = " + b"[" * 5000 + b"]" * 5000)
@example(b'[router]\nmax_body = "' + b"9" * 400 + b'"\n')
def test_config_bytes_never_raise(raw: bytes) -> None:
    tried("providerd.toml bytes")
    path = Path("/etc/providerd/providerd.toml")
    result = config.parse(raw, path)
    if isinstance(result, config.Config):
        assert router_units.render_router(result)
    else:
        assert_problems(result, str(path))


# -- any accepted manifest renders faithfully --------------------------------------------------

# Text as hostile as a TOML string can be: control characters, quotes, backslashes,
# specifiers, variables, non-ASCII (no surrogates: TOML cannot hold them).
HOSTILE = st.text(
    st.one_of(
        st.sampled_from(list("\n\r\t\x00\x0b\x1b\x7f\x85\u2028\\\"' %$;#=[]{}/:.-_")),
        st.characters(blacklist_categories=("Cs",)),
    ),
    max_size=24,
)
# Most of it valid, so that enough manifests are accepted to check their rendering.
TEXT = st.text(
    st.one_of(
        st.sampled_from(list("\n\t\\\"' %$;#=[]/:.-_")), st.characters(blacklist_categories=("Cs",))
    ),
    max_size=16,
).map(lambda t: t.replace("{", "").replace("}", ""))
WORD = st.one_of(TEXT, st.sampled_from(["{port}", "{python}", "{slug}", "{{x}}", "", "-"]))
PORT = st.one_of(st.integers(1, 65535), st.integers(0, 70000))
IFNAME = st.from_regex(r"[a-z0-9_.-]{1,15}", fullmatch=True)


@st.composite
def address(draw: st.DrawFn) -> str:
    kind = draw(st.integers(0, 5))
    port = draw(PORT)
    if kind == 0:
        return f"{draw(st.ip_addresses(v=4))}:{port}"
    if kind in (1, 2):
        scope = draw(
            st.one_of(
                st.just(""), st.builds("%{}".format, IFNAME), st.builds("%{}".format, HOSTILE)
            )
        )
        return f"[{draw(st.ip_addresses(v=6))}{scope}]:{port}"
    if kind == 3:
        return "/" + draw(HOSTILE)
    if kind == 4:
        return "/run/" + draw(st.text(string.ascii_letters + "._-\\%'\"", max_size=12))
    return draw(HOSTILE)


ALLOW = st.one_of(
    st.builds(str, st.ip_addresses()),
    st.builds(lambda a, n: f"{a}/{n}", st.ip_addresses(v=4), st.integers(0, 32)),
    st.builds(lambda a, s: f"{a}%{s}", st.ip_addresses(v=6), HOSTILE),
    st.sampled_from(["localhost", "link-local", "multicast"]),
    HOSTILE,
)
ENV_NAME = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)


def _opt(**kw: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=kw)


MANIFEST = st.fixed_dictionaries(
    {
        "listen": st.fixed_dictionaries(
            {"address": st.one_of(address(), st.lists(address(), min_size=1, max_size=3))},
            optional={
                "allow": st.lists(ALLOW, max_size=3),
                "protocol": st.sampled_from(["http", "tcp"]),
            },
        ),
        "runtime": st.fixed_dictionaries(
            {
                "command": st.one_of(
                    st.builds(lambda w: ["/opt/serve", *w], st.lists(WORD, max_size=6)),
                    st.lists(WORD, min_size=1, max_size=3),
                )
            },
            optional={
                "environment": st.dictionaries(ENV_NAME, TEXT, max_size=3),
                "working_directory": st.builds("/{}".format, HOSTILE),
                "ready": st.one_of(
                    st.sampled_from(["tcp", "notify"]), st.builds("http:/{}".format, HOSTILE)
                ),
                "start_timeout_s": st.one_of(st.integers(1, 3600), st.floats()),
                "idle_ignore_paths": st.lists(st.builds("/{}".format, TEXT), max_size=2),
            },
        ),
    },
    optional={
        "description": st.one_of(TEXT, HOSTILE),
        "enabled": st.booleans(),
        "limits": _opt(
            memory_max=st.one_of(st.integers(0, 1 << 64), st.sampled_from(["1G", "1.5M", "4E"])),
            tasks_max=st.integers(1, 10**7),
            cpu_quota=st.builds("{}%".format, st.integers(1, 400)),
        ),
        "weights": _opt(paths=st.lists(st.builds("/srv/present{}".format, HOSTILE), max_size=2)),
        "isolation": _opt(network=st.sampled_from(["private", "host"])),
        "gpu": _opt(devices=st.sampled_from(["auto", "none", [0], [0, 1]])),
    },
)


def check_faithful(p: Provider) -> None:
    files = units.render(p)
    meant = units.intended(p)
    for path, assignments in meant.items():
        text = files[path]
        assert isinstance(text, str)
        assert read_unit(text) == assignments, path
    # ...and each value means what the manifest says.
    socket = meant[f"provider@{p.slug}.socket.d/{units.DROPIN}"]
    front = meant[f"provider@{p.slug}.service.d/{units.DROPIN}"]
    worker = meant[f"provider-worker@{p.slug}.service.d/{units.DROPIN}"]

    def values(assignments: list[units.Assignment], key: str) -> list[str]:
        return [v for _, k, v in assignments if k == key]

    for part in (socket, front, worker):
        assert [unspecify(v) for v in values(part, "SourcePath")] == [str(p.source)]
    assert [unspecify(v) for v in values(socket, "ListenStream")] == [str(a) for a in p.addresses]
    allow = values(socket, "IPAddressAllow")
    assert [w for v in allow for w in v.split()] == list(p.allow)
    assert environment(values(front, "Environment")[0]) == {"PROVIDERD_MANIFEST": str(p.source)}
    execs = values(worker, "ExecStart")
    if units.runs_model_directly(p):  # the model's own command, placeholders filled
        values_ = {
            "port": str(p.known_worker_port or 4242),
            "host": units.worker_loopback(p.slug) if p.network == "host" else "127.0.0.1",
            "slug": p.slug,
            "python": units.PYTHON,
        }
        argv = [fill_placeholders(a, values_) for a in p.command]
        assert execs[0] == "" and exec_argv(execs[1], {"PROVIDERD_WORKER_PORT": "4242"}) == argv
    else:
        assert execs[0] == "" and exec_argv(execs[1]) == units.worker_argv(p)
    env: dict[str, str] = {}
    for v in values(worker, "Environment"):
        env.update(environment(v))
    port = {"PROVIDERD_WORKER_PORT": str(p.known_worker_port)} if p.known_worker_port else {}
    if p.network == "host":
        port["PROVIDERD_WORKER_HOST"] = units.worker_loopback(p.slug)
    assert env == {**port, **dict(p.environment)}
    conditions = values(worker, "ConditionPathExists")
    with_front = ["", f"!{units.BACKOFF_FILE}", f"|!{units.KEYS_FILE}", f"|{units.WORKER_ENV_FILE}"]
    assert conditions == (with_front if p.starts_with_front else [])
    assert [unspecify(v) for v in values(worker, "WorkingDirectory")] == (
        [p.working_directory] if p.working_directory else []
    )
    resolver = [" ".join(f"-{r}" for r in units.RESOLVER_FILES)] if p.network == "host" else []
    binds = [unspecify(v) for v in values(worker, "BindReadOnlyPaths")]
    assert binds == list(p.weight_paths) + resolver
    what = " ".join(f": {p.description}".split()) if p.description else ""
    for part, role in ((socket, "listener"), (front, "front"), (worker, "worker")):
        assert [unspecify(v) for v in values(part, "Description")] == [
            f"Provider {p.slug}{what} ({role})"
        ]


@given(MANIFEST)
@example(
    {
        "listen": {"address": ["127.0.0.1:1", "[::1%lo\nExecStartPre=x\n#]:2"]},
        "runtime": {"command": ["/x"]},
    }
)
@example(
    {
        "listen": {"address": "/run/x.sock\\", "allow": ["10.0.0.0/8"]},
        "runtime": {"command": ["/x"]},
    }
)
def test_accepted_manifests_render_faithfully(data: dict[str, Any]) -> None:
    tried("manifest rendering")
    result = manifest.validate(data, "prop", SOURCE, CASE_HOST)
    if isinstance(result, list):
        assert result and all(p.message for p in result)
        return
    try:
        check_faithful(result)
        tried("manifest rendering: accepted, read back as meant")
    except units.Unrenderable as e:  # the last guard refused it: a problem, not a unit
        tried("manifest rendering: refused by the renderer's guard")
        assert str(e).startswith("cannot be written safely as ")


def test_the_reader_sees_what_an_injection_would_add() -> None:
    """The reader is systemd's, not the renderer's: it finds a smuggled directive."""
    injected = "[Socket]\nListenStream=[::1%%lo\nExecStartPre=pwned\n#]:1\n"
    assert ("Socket", "ExecStartPre", "pwned") in read_unit(injected)
    continued = "[Socket]\nListenStream=/run/x.sock\\\nIPAddressDeny=any\n"
    assert read_unit(continued) == [("Socket", "ListenStream", "/run/x.sock IPAddressDeny=any")]


def test_the_guard_refuses_what_would_change_a_unit() -> None:
    for value, reason in [
        ("a\nExecStartPre=x", "holds the control character U+000A"),
        ("a\rb", "holds the control character U+000D"),
        ("/run/x.sock\\", "ends with '\\', which would continue it onto the next line"),
        (" padded", "starts or ends with a space, which systemd drops"),
    ]:
        try:
            units.assignment("ListenStream", value)
        except units.Unrenderable as e:
            assert str(e) == f"cannot be written safely as ListenStream=: the value {reason}"
        else:
            raise AssertionError(f"{value!r} was rendered")


# -- model patterns: a linear-time matcher that agrees with `re` ----------------------------

ATOM = st.sampled_from(
    ["a", "b", "-", r"\.", ".", "[ab]", "[^a]", "[a-c0-2]", r"\d", r"\w", r"\s", "é"]
)


def _quantified(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.builds(
        lambda r, q: f"(?:{r}){q}",
        inner,
        st.sampled_from(["*", "+", "?", "*?", "+?", "??", "{2}", "{1,3}", "{0,2}?", "{2,}"]),
    )


REGEX = st.recursive(
    ATOM,
    lambda inner: st.one_of(
        st.builds(lambda a, b: a + b, inner, inner),
        st.builds(lambda a, b: f"(?:{a}|{b})", inner, inner),
        st.builds("({})".format, inner),
        _quantified(inner),
    ),
    max_leaves=8,
).flatmap(lambda r: st.sampled_from([r, "^" + r, r + "$", "ab" + r]))
SUBJECT = st.text(st.sampled_from(list("ab-.0c é\t_")), max_size=10)


@given(REGEX, st.lists(SUBJECT, min_size=1, max_size=8))
@example("(a+)+b", ["a" * 10, "aab"])
@example("llama-.*-.*-instruct", ["llama-" + "-" * 10, "llama-3-8b-instruct"])
def test_patterns_match_as_re_does(pattern: str, names: list[str]) -> None:
    tried("model patterns against re")
    compiled = compile_pattern(pattern)
    for name in names:
        assert compiled.fullmatch(name) == bool(re.fullmatch(pattern, name)), (pattern, name)
        if compiled.fullmatch(name):
            assert name.startswith(compiled.literal_prefix) and compiled.literal in name


def test_a_pattern_that_backtracks_for_ever_in_re_is_checked_at_once() -> None:
    compiled = compile_pattern("(a+)+b")
    t0 = time.perf_counter()
    assert not compiled.fullmatch("a" * 256)
    assert not compile_pattern("llama-.*-.*-instruct").fullmatch("llama-" + "-" * 250)
    assert time.perf_counter() - t0 < 1.0  # re.fullmatch takes years for the first


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        (r"(a)\1", "uses a back-reference, which model patterns do not support"),
        ("(?=a)a", "uses a look-around, which model patterns do not support"),
        ("(?i)llama", "uses inline flags such as (?i), which model patterns do not support"),
        ("a{5000}", "is too complex to check (more than 4096 steps)"),
        (r"\bx", r"uses \b, \B, \A or \Z, which model patterns do not support"),
        ("(?>a)", "uses an atomic group, which model patterns do not support"),
        ("a++", "uses a possessive repeat, which model patterns do not support"),
        (
            "(",
            "is not a valid regular expression: missing ), unterminated subpattern at position 0",
        ),
    ],
)
def test_patterns_outside_the_regular_part_are_refused(pattern: str, message: str) -> None:
    with pytest.raises(PatternError) as e:
        compile_pattern(pattern)
    assert str(e.value) == message


PROVIDER_NAMES = st.lists(st.text("ab-.1", min_size=1, max_size=6), max_size=4, unique=True)
PROVIDER_PATTERNS = st.lists(REGEX, max_size=2)


@given(st.lists(st.tuples(PROVIDER_NAMES, PROVIDER_PATTERNS), min_size=1, max_size=5))
def test_the_check_across_providers_finds_every_match(
    models: list[tuple[list[str], list[str]]],
) -> None:
    """The prefix index loses nothing: the same problems as trying every pair with re."""
    tried("model names and patterns across providers")
    providers = [
        Provider(
            slug=f"p{i}",
            source=Path(f"/p{i}.toml"),
            addresses=(Address("127.0.0.1", 1000 + i),),
            model_names=tuple(names),
            model_patterns=tuple(patterns),
        )
        for i, (names, patterns) in enumerate(models)
    ]
    got = {(p.file, p.key, p.message) for p in manifest.cross_check(providers)}
    owners: dict[str, Provider] = {}
    for p in providers:
        for n in p.model_names:
            owners.setdefault(n, p)
    want = set()
    for x in providers:
        for pat in x.model_patterns:
            for n, y in owners.items():
                if y is not x and re.fullmatch(pat, n):
                    want.add(
                        (
                            str(x.source),
                            "models.patterns",
                            f'"{pat}" matches "{n}", a name of provider "{y.slug}" ({y.source}); narrow the pattern',
                        )
                    )
    assert {g for g in got if g[1] == "models.patterns"} == want
