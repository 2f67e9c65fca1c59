"""API keys: the file that turns them on, what it may say, and how it reaches the agent.

    # /etc/providerd/keys.toml   (root:root, mode 0600)
    [keys.alice]
    sha256 = "<64 hex digits>"      # the SHA-256 of the key, never the key itself
    providers = ["esm", "llama_*"]  # slugs or globs (*, ?, [...]); default ["*"]
    can_start = true                # may this key cause a cold start? default true
    description = "Alice's notebook"

The file's existence turns keys on for the router and every provider's own port; with
no file (the default) nothing asks for a key. Keys are stored as their SHA-256 only: a
copy of the file (a backup, a credential directory) gives away no key. Keys are random
tokens (docs/keys.md makes one), so an unsalted hash is enough.

Under systemd the file reaches the fronts and the router as the credential
`providerd-keys` (`LoadCredential=` in their templates, with `SetCredential=` "absent"
for when the file does not exist); they run as user `providerd` and cannot read the
file itself, only stat it. The same existence test keeps systemd from starting a
worker beside its front while keys are on (the worker template's conditions), so that
a refused request never starts a model.

Fail closed: a file that cannot be read or parsed, or that someone besides root owns
or may write, gives no key at all (every request that needs one is refused); an entry
with a problem is left out and the others still work. Every problem is one line,
`<file>: keys.NAME.FIELD: <message>`, and never shows a secret or a hash.
`to_wire`/`from_wire` carry the keys (hashes only) to running fronts on `providerctl
reload`. Pure but for `load`, `keys_on`, `check` and `report`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from agent.spec import locations, paths
from agent.spec.files import FileProblem, contained, mode_problems, read_regular
from agent.spec.provider import Problem
from agent.spec.toml_strict import Invalid, did_you_mean, expect_bool, load_toml, quote

CREDENTIAL = "providerd-keys"
ABSENT = b"absent"  # the credential's value when there is no file (SetCredential=)
MAX_BYTES = 256 << 10
MAX_KEYS = 1024
MAX_TOKEN = 4096  # longer presented tokens are wrong without being hashed
NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
HEX_RE = re.compile(r"[0-9a-fA-F]{64}")
SCOPE_RE = re.compile(r"[a-z0-9_*?\[\]!-]{1,64}")
FIELDS = ("sha256", "providers", "can_start", "description")
KEYS_DECIDE = "the keys file decides who may use the models"


@dataclass(frozen=True)
class ApiKey:
    name: str  # the table's name: what logs say, never the key
    digest: bytes = field(repr=False)  # SHA-256 of the key
    providers: tuple[str, ...] = ("*",)  # slugs or globs
    can_start: bool = True
    description: str = ""

    def reaches(self, slug: str) -> bool:
        return any(fnmatchcase(slug, p) for p in self.providers)


@dataclass(frozen=True)
class KeySet:
    """The keys in force, and why entries (or the whole file) were left out."""

    keys: tuple[ApiKey, ...] = ()
    problems: tuple[Problem, ...] = ()
    source: str = str(paths.KEYS)

    def find(self, token: str) -> ApiKey | None:
        """The key whose hash `token` has. Compares with every key in constant time
        (hmac.compare_digest of the digests, no early exit): how long it takes says
        nothing about how much of a key a guess got right."""
        if not token or len(token) > MAX_TOKEN:
            return None
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found: ApiKey | None = None
        for key in self.keys:
            if hmac.compare_digest(digest, key.digest) and found is None:
                found = key
        return found


def _sha256(value: object) -> bytes:
    if not isinstance(value, str) or not HEX_RE.fullmatch(value):
        # Never echo the value: it may be a key written where its hash belongs.
        got = f"a string of {len(value)} characters" if isinstance(value, str) else "a non-string"
        raise Invalid(
            "expected the SHA-256 of the key as 64 hexadecimal digits "
            f"(printf %s KEY | sha256sum), got {got}"
        )
    return bytes.fromhex(value)


def _providers(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise Invalid(
            f'expected a non-empty list of provider names or globs such as ["esm", "llama_*"], '
            f"got {quote(value)}"
        )
    for v in value:
        if not SCOPE_RE.fullmatch(v):
            raise Invalid(
                f"{quote(v)} is not a provider name or glob (lowercase letters, digits, '_', "
                "and * ? [ ] ! for globs; at most 64 characters)"
            )
    return tuple(dict.fromkeys(value))


def _description(value: object) -> str:
    if not isinstance(value, str) or len(value) > 200 or any(ord(c) < 32 for c in value):
        raise Invalid(f"expected one line of text (at most 200 characters), got {quote(value)}")
    return value


def _entry(file: str, name: str, body: object) -> ApiKey | list[Problem]:
    where = f"keys.{name}" if NAME_RE.fullmatch(name) else "keys"
    if not NAME_RE.fullmatch(name):
        return [
            Problem(
                file,
                where,
                f"{quote(name)} is not a key name (lowercase letters, digits, '_', '.', '-'; "
                "at most 64 characters)",
            )
        ]
    if not isinstance(body, dict):
        return [Problem(file, where, f"expected a table [keys.{name}], got {quote(body)}")]
    problems: list[Problem] = []
    values: dict[str, object] = {}
    for k, v in body.items():
        if k not in FIELDS:
            msg = f"unknown key{did_you_mean(k, FIELDS)}; known keys: {', '.join(FIELDS)}"
            problems.append(Problem(file, f"{where}.{k}", msg))
            continue
        try:
            if k == "sha256":
                values["digest"] = _sha256(v)
            elif k == "providers":
                values["providers"] = _providers(v)
            elif k == "can_start":
                values["can_start"] = expect_bool(v)
            else:
                values["description"] = _description(v)
        except Invalid as e:
            problems.append(Problem(file, f"{where}.{k}", str(e)))
    if "sha256" not in body:
        problems.append(Problem(file, f"{where}.sha256", "is required: the SHA-256 of the key"))
    if problems:
        return problems
    return ApiKey(name, **values)  # type: ignore[arg-type]


def parse(raw: bytes, source: str) -> KeySet:
    """The keys in `raw` (the text of `source`). Pure; never raises."""
    try:
        data = load_toml(raw, "the keys file")
    except Invalid as e:
        return KeySet((), (Problem(source, "", str(e)),), source)
    problems: list[Problem] = []
    keys: list[ApiKey] = []
    seen: dict[bytes, str] = {}
    for top, body in data.items():
        if top != "keys":
            what = "table" if isinstance(body, dict) else "key"
            msg = f"unknown {what}{did_you_mean(top, ['keys'])}; the file holds [keys.NAME] tables"
            problems.append(Problem(source, top, msg))
            continue
        if not isinstance(body, dict):
            problems.append(Problem(source, "keys", "expected [keys.NAME] tables, got a value"))
            continue
        if len(body) > MAX_KEYS:
            problems.append(Problem(source, "keys", f"holds {len(body)} keys; at most {MAX_KEYS}"))
            continue
        for name, entry in body.items():
            got = _entry(source, name, entry)
            if isinstance(got, list):
                problems += got
            elif got.digest in seen:
                msg = f"is the same key as keys.{seen[got.digest]}; each key is listed once"
                problems.append(Problem(source, f"keys.{name}.sha256", msg))
            else:
                seen[got.digest] = name
                keys.append(got)
    return KeySet(tuple(keys), tuple(problems), source)


def keys_on(path: Path | None = None) -> bool:
    """Whether keys are on (`agent.spec.locations.keys_on`)."""
    return locations.keys_on(None if path is None else str(path))


def _read(path: Path, credential: Path | None) -> KeySet:
    file = str(path)
    checks = [(path, False), (path.parent, True)]
    refused = mode_problems(path, checks, paths.trusted_uids(), KEYS_DECIDE)  # owner, writers
    try:
        raw = read_regular(credential or path, MAX_BYTES, "keys file")
    except FileProblem as e:
        return KeySet((), (Problem(file, "", e.message), *refused), file)
    if credential is not None and raw == ABSENT:
        late = "did not exist when this unit started; it applies from its next start"
        return KeySet((), (Problem(file, "", late),), file)
    got = parse(raw, file)
    extra: list[Problem] = []
    try:
        st = path.stat()
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            extra.append(
                Problem(
                    file,
                    "",
                    f"is readable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                    f"keys files are root's alone: chmod 600 {file}",
                )
            )
    except OSError:
        pass
    if refused:  # who may write it may add keys: trust none of them
        return KeySet((), (*refused, *extra, *got.problems), file)
    return KeySet(got.keys, (*extra, *got.problems), file)


def load(environ: Mapping[str, str] | None = None, path: Path | None = None) -> KeySet | None:
    """The keys in force, or None when keys are off (no keys file).

    Under systemd the content is the credential (`$CREDENTIALS_DIRECTORY/providerd-keys`);
    without one (`providerctl serve`, `providerctl check`) the file itself. Never raises."""
    environ = os.environ if environ is None else environ
    path = path or paths.keys_file()
    if not keys_on(path):
        return None
    credential: Path | None = None
    directory = environ.get("CREDENTIALS_DIRECTORY", "")
    if directory and os.path.lexists(os.path.join(directory, CREDENTIAL)):
        credential = Path(directory, CREDENTIAL)
    result = contained(str(path), "keys file", lambda: _read(path, credential))
    if isinstance(result, list):
        return KeySet((), tuple(result), str(path))
    return result


def report(keys: KeySet | None, log: logging.Logger) -> None:
    """Log what is in force, as a front or the router starts (names and counts, never a
    key): one line, and one per problem."""
    if keys is None:
        return
    for problem in keys.problems:
        log.warning("Ignoring part of the keys file: %s", problem)
    if keys.keys:
        log.info("API keys are on: %d key(s) from %s", len(keys.keys), keys.source)
    else:
        log.warning(
            "API keys are on but no key in %s is usable: every request that needs one is refused",
            keys.source,
        )


def check(items: list[str]) -> tuple[list[Problem], str | None]:
    """`providerctl check`: the keys file's problems, and a summary line when it is usable.
    Checked when no path is given, or when a given path is the keys file."""
    path = paths.keys_file()
    given = {os.path.abspath(i) for i in items}
    if (items and os.path.abspath(path) not in given) or not keys_on(path):
        return [], None
    keys = load({}, path)  # the file itself, as root reads it
    assert keys is not None
    if keys.problems:
        return list(keys.problems), None
    if not keys.keys:
        return [
            Problem(str(path), "keys", "holds no key: every request that needs one is refused")
        ], None
    return [], f"{path}: {len(keys.keys)} API key(s): " + ", ".join(k.name for k in keys.keys)


def to_wire(keys: KeySet | None) -> list[dict[str, object]] | None:
    """The keys as `providerctl reload` sends them to running fronts (hashes only)."""
    if keys is None:
        return None
    return [
        {"name": k.name, "sha256": k.digest.hex(), "providers": list(k.providers),
         "can_start": k.can_start}
        for k in keys.keys
    ]  # fmt: skip


def from_wire(data: object, source: str) -> KeySet | None:
    """`to_wire`'s output back, checked like the file (an entry that does not check out
    is left out: fail closed)."""
    if data is None:
        return None
    items = data if isinstance(data, list) else []
    raw = {
        str(d.get("name")): {k: v for k, v in d.items() if k != "name"}
        for d in items[:MAX_KEYS]
        if isinstance(d, dict)
    }
    keys: list[ApiKey] = []
    problems: list[Problem] = []
    for name, body in raw.items():
        got = _entry(source, name, body)
        if isinstance(got, list):
            problems += got
        else:
            keys.append(got)
    return KeySet(tuple(keys), tuple(problems), source)
