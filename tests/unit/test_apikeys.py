"""API keys: the keys file, scoping, the constant-time compare, and the answers."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.net import auth
from agent.net.http import parse_request_head
from agent.spec import apikeys
from agent.spec.apikeys import KeySet, parse

ALICE = "pd-alice-key"
BOB = "pd-bob-key"


def h(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


GOOD = f"""
[keys.alice]
sha256 = "{h(ALICE)}"
description = "Alice's notebook"

[keys.bob]
sha256 = "{h(BOB).upper()}"
providers = ["esm", "llama_*"]
can_start = false
""".encode()


def head(*fields: str, target: str = "/v1/embeddings") -> object:
    raw = f"GET {target} HTTP/1.1\r\nHost: x\r\n" + "".join(f + "\r\n" for f in fields) + "\r\n"
    return parse_request_head(raw.encode())


def test_a_good_file_gives_its_keys_with_their_scopes() -> None:
    keys = parse(GOOD, "/k.toml")
    assert keys.problems == ()
    alice, bob = keys.keys
    assert (alice.name, alice.providers, alice.can_start) == ("alice", ("*",), True)
    assert (bob.name, bob.providers, bob.can_start) == ("bob", ("esm", "llama_*"), False)
    assert bob.reaches("esm") and bob.reaches("llama_8b") and not bob.reaches("esm2")
    assert keys.find(ALICE) is alice and keys.find(BOB) is bob
    assert keys.find("pd-alice-ke") is None and keys.find("") is None
    assert keys.find("x" * (apikeys.MAX_TOKEN + 1)) is None


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            '[keys.a]\nsha256 = "pd-my-secret-key"\n',
            "/k.toml: keys.a.sha256: expected the SHA-256 of the key as 64 hexadecimal digits "
            "(printf %s KEY | sha256sum), got a string of 16 characters",
        ),
        ("[keys.a]\nproviders = []\n", "/k.toml: keys.a.providers: expected a non-empty list"),
        ("[keys.a]\n", "/k.toml: keys.a.sha256: is required: the SHA-256 of the key"),
        (
            f'[keys.a]\nsha256 = "{h("k")}"\ncan_strat = true\n',
            'unknown key (did you mean "can_start"?)',
        ),
        (f'[keys.A]\nsha256 = "{h("k")}"\n', '/k.toml: keys: "A" is not a key name'),
        (
            f'[keys.a]\nsha256 = "{h("k")}"\nproviders = ["ESM"]\n',
            '"ESM" is not a provider name or glob',
        ),
        (
            f'[keys.a]\nsha256 = "{h("k")}"\n[keys.b]\nsha256 = "{h("k")}"\n',
            "keys.b.sha256: is the same key as keys.a",
        ),
        ("[key.a]\n", '/k.toml: key: unknown table (did you mean "keys"?)'),
        ("keys = 3\n", "/k.toml: keys: expected [keys.NAME] tables, got a value"),
        ("[keys\n", "/k.toml: is not valid TOML"),
        ("\xff", "/k.toml: is not UTF-8 text"),
    ],
)
def test_each_problem_is_one_line_and_never_shows_a_secret(text: str, line: str) -> None:
    raw = text.encode("latin-1") if text == "\xff" else text.encode()
    keys = parse(raw, "/k.toml")
    lines = [str(p) for p in keys.problems]
    assert any(line in s for s in lines), lines
    assert all("\n" not in s and "pd-my-secret-key" not in s and h("k") not in s for s in lines)


def test_a_bad_entry_costs_only_itself() -> None:
    raw = GOOD + b'\n[keys.broken]\nsha256 = "nope"\n'
    keys = parse(raw, "/k.toml")
    assert [k.name for k in keys.keys] == ["alice", "bob"]
    assert [p.key for p in keys.problems] == ["keys.broken.sha256"]


@given(st.binary(max_size=400))
def test_any_bytes_give_a_key_set_and_never_raise(raw: bytes) -> None:
    keys = parse(raw, "/k.toml")
    assert isinstance(keys, KeySet)
    assert all(str(p).startswith("/k.toml: ") and "\n" not in str(p) for p in keys.problems)


def test_find_compares_with_every_key_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """No early exit: every stored digest is compared, with hmac.compare_digest, whichever
    key matches (or none); so the time taken does not depend on the secrets."""
    keys = parse(GOOD, "/k.toml")
    calls: list[tuple[bytes, bytes]] = []
    real = apikeys.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(apikeys.hmac, "compare_digest", spy)
    for token in (ALICE, BOB, "wrong"):
        calls.clear()
        keys.find(token)
        assert len(calls) == 2 and all(len(a) == len(b) == 32 for a, b in calls)


def test_keys_are_off_without_a_file_and_fail_closed_with_a_broken_one(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    env = {"PROVIDERD_TRUSTED_UID": str(os.getuid())}
    assert apikeys.load(env, path) is None
    path.write_bytes(b"[keys\n")
    path.chmod(0o600)
    broken = apikeys.load(env, path)
    assert broken is not None and broken.keys == () and broken.problems


def test_others_who_may_write_the_file_void_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROVIDERD_TRUSTED_UID", str(os.getuid()))
    path = tmp_path / "keys.toml"
    path.write_bytes(GOOD)
    path.chmod(0o600)
    keys = apikeys.load({}, path)
    assert keys is not None and len(keys.keys) == 2 and keys.problems == ()
    path.chmod(0o644)
    keys = apikeys.load({}, path)
    assert keys is not None and len(keys.keys) == 2
    assert "is readable by group or others (mode 0644)" in str(keys.problems[0])
    path.chmod(0o666)
    keys = apikeys.load({}, path)
    assert keys is not None and keys.keys == ()
    assert "is writable by group or others" in str(keys.problems[0])


def test_the_credential_holds_what_systemd_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under systemd the front cannot read the file (root's, 0600): the credential is its copy."""
    monkeypatch.setenv("PROVIDERD_TRUSTED_UID", str(os.getuid()))
    path = tmp_path / "keys.toml"
    path.write_bytes(b"")
    path.chmod(0o600)
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / apikeys.CREDENTIAL).write_bytes(GOOD)
    keys = apikeys.load({"CREDENTIALS_DIRECTORY": str(creds)}, path)
    assert keys is not None and [k.name for k in keys.keys] == ["alice", "bob"]
    # The file was created after the unit started: systemd gave it "absent". No key yet.
    (creds / apikeys.CREDENTIAL).write_bytes(apikeys.ABSENT)
    keys = apikeys.load({"CREDENTIALS_DIRECTORY": str(creds)}, path)
    assert keys is not None and keys.keys == ()
    assert [str(p) for p in keys.problems] == [
        f"{path}: did not exist when this unit started; it applies from its next start"
    ]


# -- the check of one request ------------------------------------------------------------


def test_a_request_without_a_key_is_401_with_www_authenticate() -> None:
    keys = parse(GOOD, "/k.toml")
    r = auth.authenticate(keys, head())
    assert isinstance(r, auth.Refusal)
    assert (r.status, r.code, r.cause) == (401, "missing_api_key", "unauthorized")
    assert r.headers() == (("WWW-Authenticate", 'Bearer realm="providerd"'),)


@pytest.mark.parametrize(
    "fields",
    [
        ("Authorization: Bearer wrong",),
        ("x-api-key: wrong",),
        (f"Authorization: Bearer {ALICE}", f"x-api-key: {BOB}"),
    ],
)
def test_a_wrong_or_ambiguous_key_is_401_invalid_token(fields: tuple[str, ...]) -> None:
    r = auth.authenticate(parse(GOOD, "/k.toml"), head(*fields))
    assert isinstance(r, auth.Refusal) and r.status == 401
    assert r.code == "invalid_api_key"
    assert r.headers() == (("WWW-Authenticate", 'Bearer realm="providerd", error="invalid_token"'),)
    assert ALICE not in r.message and BOB not in r.message


@pytest.mark.parametrize(
    "fields",
    [
        (f"Authorization: Bearer {ALICE}",),
        (f"authorization: bearer  {ALICE} ",),
        (f"X-Api-Key: {ALICE}",),
        (f"Authorization: Bearer {ALICE}", f"x-api-key: {ALICE}"),
        ("Authorization: Basic eA==", f"x-api-key: {ALICE}"),
    ],
)
def test_either_header_carries_the_key(fields: tuple[str, ...]) -> None:
    key = auth.authenticate(parse(GOOD, "/k.toml"), head(*fields))
    assert not isinstance(key, auth.Refusal) and key.name == "alice"


def test_scope_and_can_start_are_403() -> None:
    keys = parse(GOOD, "/k.toml")
    bob = keys.find(BOB)
    assert bob is not None
    assert auth.authorize(bob, "esm") is None
    out = auth.authorize(bob, "whisper")
    assert out is not None and (out.status, out.code, out.cause) == (
        403,
        "key_out_of_scope",
        "forbidden",
    )
    assert out.headers() == ()
    start = auth.may_start(bob, "esm")
    assert start is not None and (start.status, start.code, start.cause) == (
        403,
        "cold_start_not_allowed",
        "forbidden",
    )
    alice = keys.find(ALICE)
    assert alice is not None and auth.may_start(alice, "esm") is None


# -- providerctl check -------------------------------------------------------------------


def test_check_validates_the_keys_file_with_the_manifests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    from agent.cli import check

    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(tmp_path / "none"))
    monkeypatch.setenv("PROVIDERD_TRUSTED_UID", str(os.getuid()))
    keys = tmp_path / "keys.toml"
    monkeypatch.setenv("PROVIDERD_KEYS", str(keys))
    out, err = io.StringIO(), io.StringIO()
    assert check.main_check([], out, err) == 0  # no file: keys off, nothing to say
    assert "keys" not in out.getvalue()

    keys.write_bytes(GOOD)
    keys.chmod(0o600)
    out = io.StringIO()
    assert check.main_check([], out, io.StringIO()) == 0
    assert out.getvalue() == f"{keys}: 2 API key(s): alice, bob\n"

    keys.write_bytes(GOOD + b'[keys.c]\nsha256 = "pd-plain-secret"\n')
    out = io.StringIO()
    assert check.main_check([str(keys)], out, io.StringIO()) == 1  # the file by itself
    assert out.getvalue() == (
        f"{keys}: keys.c.sha256: expected the SHA-256 of the key as 64 hexadecimal digits "
        "(printf %s KEY | sha256sum), got a string of 15 characters\n"
    )
    keys.chmod(0o640)
    out = io.StringIO()
    assert check.main_check([], out, io.StringIO()) == 1
    assert "is readable by group or others (mode 0640)" in out.getvalue()


@pytest.mark.parametrize("kind", ["fifo", "directory", "loop", "huge", "deep", "binary"])
def test_a_hostile_keys_file_fails_closed_in_one_line(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROVIDERD_TRUSTED_UID", str(os.getuid()))
    path = tmp_path / "keys.toml"
    if kind == "fifo":
        os.mkfifo(path, 0o600)  # never opened for reading: nothing blocks
    elif kind == "directory":
        path.mkdir(mode=0o700)
    elif kind == "loop":
        path.symlink_to(path)
    elif kind == "huge":
        path.write_bytes(b"#" * (apikeys.MAX_BYTES + 1))
    elif kind == "deep":
        path.write_bytes(b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n")
    else:
        path.write_bytes(os.urandom(512))
    if kind not in ("loop", "directory", "fifo"):
        path.chmod(0o600)
    keys = apikeys.load({}, path)
    assert keys is not None and keys.keys == ()  # on, and no key is valid
    assert keys.problems and all("\n" not in str(p) for p in keys.problems)
    assert all(str(p).startswith(str(path)) for p in keys.problems)


def test_a_hostile_keys_file_never_stops_the_generator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The generator's output does not depend on the keys file at all (the units test its
    existence themselves), so a FIFO or garbage there cannot stop or change it."""
    from agent.systemd import generator
    from tests.unit.test_generator import GOOD as MANIFEST
    from tests.unit.test_generator import stderr_log, tree, write

    write(tmp_path / "providers", "aaa.toml", MANIFEST.format(port=9001))
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(tmp_path / "providers"))
    monkeypatch.setenv("PROVIDERD_KEYS", str(tmp_path / "absent.toml"))
    assert generator.main([str(tmp_path / "a")], stderr_log()[0]) == 0
    fifo = tmp_path / "keys.toml"
    os.mkfifo(fifo, 0o666)
    monkeypatch.setenv("PROVIDERD_KEYS", str(fifo))
    assert generator.main([str(tmp_path / "b")], stderr_log()[0]) == 0
    assert tree(tmp_path / "a") == tree(tmp_path / "b")
    assert "provider-worker@aaa.service.d/50-manifest.conf" in tree(tmp_path / "b")


_NAME = st.sampled_from(["Authorization", "x-api-key", "X-API-KEY", "Accept", "X-Other"])
_VALUE = st.text(alphabet="abcdefgh 0123-_=", min_size=1, max_size=20).map(str.strip).filter(bool)


@given(st.lists(st.tuples(_NAME, _VALUE), max_size=8))
def test_without_keys_drops_exactly_the_key_fields(fields: list[tuple[str, str]]) -> None:
    raw = b"POST /v1/x HTTP/1.1\r\nHost: h\r\n" + b"".join(
        f"{n}: {v}\r\n".encode() for n, v in fields
    )
    raw += b"Content-Length: 0\r\n\r\n"
    out = auth.without_keys(raw)
    assert out.endswith(b"\r\n\r\n") and out.startswith(b"POST /v1/x HTTP/1.1\r\n")
    kept = parse_request_head(out).headers
    assert [(n.lower(), v) for n, v in kept] == [("host", "h")] + [
        (n.lower(), v) for n, v in fields if n.lower() not in ("authorization", "x-api-key")
    ] + [("content-length", "0")]
