"""`provider.toml` → `Provider`, or every problem in it.

`validate` is pure: a parsed TOML table in, a `Provider` or a list of `Problem`s
out, with the host facts it needs (CPU count, which paths exist) passed in.
`parse_file`, `discover`, `check_paths` and `load` read files and check owners
and modes; `main_check` is the body of `providerctl check`.

Kept light on imports: the generator parses every manifest at each boot and
`daemon-reload`.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
import shlex
import stat
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from agent import paths
from agent.keys import BY_DOTTED, KEYS, SECTIONS, Key
from agent.model import PLACEHOLDERS, Address, Problem, Provider, Ready, fill_placeholders

SLUG_RE = re.compile(r"[a-z0-9_]{1,48}")
SLUG_RULE = "lowercase letters, digits and '_' only, at most 48 characters"
DIR_MANIFEST = "provider.toml"
MAX_MANIFEST_BYTES = 1 << 20
UNIX_PATH_MAX = 107  # sun_path is 108 bytes with the terminating NUL


class ManifestError(Exception):
    """A manifest could not be used; `problems` says why, one line each."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = problems


@dataclass(frozen=True)
class Host:
    """What validation needs to know about the machine it runs on."""

    cpu_count: int
    exists: Callable[[str], bool]


def this_host() -> Host:
    return Host(cpu_count=os.cpu_count() or 1, exists=os.path.exists)


@dataclass
class Discovery:
    providers: dict[str, Provider] = field(default_factory=dict)  # valid ones, sorted by slug
    problems: list[Problem] = field(default_factory=list)


class Invalid(Exception):
    """A TOML value that cannot be used; the message says what was expected (for a
    `Problem`). Raised by the converters here and in agent.config."""


# -- strict TOML checking, shared with agent.config -----------------------------------------


def quote(value: object) -> str:
    """A value quoted for a message, TOML-like and short."""
    if isinstance(value, str):
        text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, dict):
        text = "a table"
    else:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def did_you_mean(
    name: str, known: Iterable[str], cutoff: float = 0.6, show: Callable[[str], str] = str
) -> str:
    """` (did you mean "<closest known name>"?)` for a misspelt name, or "" if none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
    return f' (did you mean "{show(close[0])}"?)' if close else ""


def unknown_table(name: str, known: Iterable[str]) -> str:
    """The message for a table that is none of `known`."""
    known = list(known)
    hint = did_you_mean(name, known, show=lambda t: f"[{t}]")
    return f"unknown table{hint}; known tables: {', '.join(f'[{t}]' for t in known)}"


def expect_bool(value: object) -> bool:
    """A TOML boolean; raises Invalid for anything else."""
    if not isinstance(value, bool):
        raise Invalid(f"expected true or false, got {quote(value)}")
    return value


# -- converters, one per key kind (agent.keys.KINDS) --------------------------------------


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _text(value: object, what: str = "a string") -> str:
    if not isinstance(value, str):
        raise Invalid(f"expected {what}, got {quote(value)}")
    if "\x00" in value:
        raise Invalid("contains a NUL character, which systemd cannot carry")
    return value


def _strings(value: object, what: str = "a list of strings") -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise Invalid(f"expected {what}, got {quote(value)}")
    for v in value:
        _text(v)
    return list(value)


def _range(key: Key, value: float, unit: str = "") -> None:
    lo = -math.inf if key.low is None else key.low
    hi = math.inf if key.high is None else key.high
    if not lo <= value <= hi:  # also refuses nan
        got = int(value) if float(value).is_integer() else value
        raise Invalid(f"must be from {key.range_text()}{unit}, got {got}")


def _conv_string(value: object, key: Key, host: Host) -> str:
    return _text(value)


def _conv_bool(value: object, key: Key, host: Host) -> bool:
    return expect_bool(value)


def _conv_choice(value: object, key: Key, host: Host) -> str:
    if not isinstance(value, str) or value not in key.choices:
        verb = "supported" if key.name == "mode" else "expected"
        options = ", ".join(f'"{c}"' for c in key.choices)
        raise Invalid(f"{verb}: {options}; got {quote(value)}")
    return value


def _conv_int(value: object, key: Key, host: Host) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise Invalid(f"expected an integer from {key.range_text()}, got {quote(value)}")
    _range(key, value)
    return value


def _conv_seconds(value: object, key: Key, host: Host) -> float:
    if not _is_number(value):
        raise Invalid(f"expected a number of seconds from {key.range_text()}, got {quote(value)}")
    assert isinstance(value, int | float)
    _range(key, value, " seconds")
    return float(value)


def _conv_gigabytes(value: object, key: Key, host: Host) -> float:
    if not _is_number(value):
        raise Invalid(f"expected a number of GB such as 18.5, got {quote(value)}")
    assert isinstance(value, int | float)
    _range(key, value, " GB")
    return float(value)


def parse_address(text: str) -> Address:
    """One listen address; raises Invalid with the expected forms."""
    forms = 'expected "host:port", "[v6]:port" or an absolute unix socket path'
    if text.startswith("/"):
        if len(text.encode()) > UNIX_PATH_MAX:
            raise Invalid(f"unix socket path {quote(text)} is longer than {UNIX_PATH_MAX} bytes")
        if any(c.isspace() or ord(c) < 32 for c in text) or "%" in text:
            raise Invalid(
                f"unix socket path {quote(text)} may not contain spaces, control characters or '%'"
            )
        return Address(None, None, os.path.normpath(text))
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise Invalid(f"{forms}, got {quote(text)}")
        try:
            addr: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.IPv6Address(host)
        except ValueError:
            raise Invalid(f"{quote(host)} is not an IPv6 address ({forms})") from None
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise Invalid(f"{forms}, got {quote(text)}")
        try:
            addr = ipaddress.IPv4Address(host)
        except ValueError:
            hint = " (write IPv6 addresses as [addr]:port)" if ":" in host else ""
            raise Invalid(f"{quote(host)} is not an IPv4 address{hint}; {forms}") from None
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise Invalid(f"port must be from 1 to 65535, got {quote(port)} in {quote(text)}")
    return Address(str(addr), int(port))


def _conv_addresses(value: object, key: Key, host: Host) -> tuple[Address, ...]:
    items = [value] if isinstance(value, str) else value
    texts = _strings(items, "an address string or a list of them")
    if not texts:
        raise Invalid('expected at least one address such as "127.0.0.1:8008"')
    out: list[Address] = []
    for t in texts:
        a = parse_address(t)
        if a in out:
            raise Invalid(f"{quote(str(a))} is listed twice")
        out.append(a)
    return tuple(out)


_IP_KEYWORDS = ("localhost", "link-local", "multicast")


def _conv_cidrs(value: object, key: Key, host: Host) -> tuple[str, ...]:
    out: list[str] = []
    for t in _strings(value, "a list of addresses or CIDRs"):
        if t in _IP_KEYWORDS:
            out.append(t)
            continue
        try:
            out.append(str(ipaddress.ip_network(t, strict=False)))
        except ValueError:
            raise Invalid(
                f'{quote(t)} is not an address or CIDR (such as "10.0.0.0/8", "::1", "localhost")'
            ) from None
    return tuple(out)


def _conv_argv(value: object, key: Key, host: Host) -> tuple[str, ...]:
    argv = _strings(value, 'a list of strings such as ["/opt/m/serve", "--port", "{port}"]')
    if not argv or not argv[0]:
        raise Invalid("expected a non-empty list whose first item names the program")
    dummy = dict.fromkeys(PLACEHOLDERS, "")
    known = ", ".join("{" + n + "}" for n in sorted(PLACEHOLDERS))
    for i, arg in enumerate(argv):
        try:
            fill_placeholders(arg, dummy)
        except KeyError as e:
            raise Invalid(
                f"item {i} ({quote(arg)}): unknown placeholder {{{e.args[0]}}}; known: {known} "
                "(write {{ and }} for literal braces)"
            ) from None
        except ValueError as e:
            raise Invalid(f"item {i} ({quote(arg)}): {e}") from None
    return tuple(argv)


_ENTRY_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _conv_entrypoint(value: object, key: Key, host: Host) -> str:
    text = _text(value)
    if not _ENTRY_RE.fullmatch(text):
        raise Invalid(f'expected "package.module:function", got {quote(text)}')
    return text


def _conv_ready(value: object, key: Key, host: Host) -> Ready:
    text = _text(value)
    if text in ("tcp", "notify"):
        return Ready("tcp" if text == "tcp" else "notify")
    if text.startswith("http:"):
        path = text[5:]
        if path.startswith("/") and not any(c.isspace() or ord(c) < 32 for c in path):
            return Ready("http", path)
    raise Invalid(
        f'expected "tcp", "http:/path" (such as "http:/health") or "notify", got {quote(text)}'
    )


_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _conv_environment(value: object, key: Key, host: Host) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise Invalid(
            f'expected a table of strings such as {{ HF_HOME = "/srv/hf" }}, got {quote(value)}'
        )
    out: list[tuple[str, str]] = []
    for name, v in value.items():
        if not _ENV_NAME_RE.fullmatch(name):
            raise Invalid(
                f"{quote(name)} is not a variable name (letters, digits and '_', not first a digit)"
            )
        if name.startswith("PROVIDERD_"):
            raise Invalid(
                f"{quote(name)}: names starting with PROVIDERD_ are set by providerd itself"
            )
        if not isinstance(v, str):
            raise Invalid(f'{name}: expected a string value, got {quote(v)} (quote numbers: "1")')
        _text(v)
        out.append((name, v))
    return tuple(out)


def _abspath(text: str, what: str) -> str:
    if not text.startswith("/"):
        raise Invalid(f"expected an absolute {what}, got {quote(text)}")
    if any(c.isspace() or ord(c) < 32 or c in ":\"'\\" for c in text):
        raise Invalid(
            f"{quote(text)}: paths with spaces, quotes, ':', '\\' or control characters are not supported "
            "(a symlink without them works)"
        )
    return os.path.normpath(text)


def _conv_abspath(value: object, key: Key, host: Host) -> str:
    return _abspath(_text(value), "path")


def _conv_abspaths(value: object, key: Key, host: Host) -> tuple[str, ...]:
    out: list[str] = []
    for t in _strings(value, "a list of absolute paths"):
        p = _abspath(t, "path")
        if not host.exists(p):
            raise Invalid(
                f"{quote(p)} does not exist (weights must be in place before the worker starts)"
            )
        out.append(p)
    return tuple(out)


def _conv_urlpaths(value: object, key: Key, host: Host) -> tuple[str, ...]:
    out = _strings(value, 'a list of HTTP paths such as ["/health"]')
    for t in out:
        if not t.startswith("/") or any(c.isspace() for c in t):
            raise Invalid(f'expected HTTP paths starting with "/", got {quote(t)}')
    return tuple(out)


_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)([KMGTPE]?)")
_SIZE_UNITS = {
    "": 1,
    "K": 1 << 10,
    "M": 1 << 20,
    "G": 1 << 30,
    "T": 1 << 40,
    "P": 1 << 50,
    "E": 1 << 60,
}
MIN_MEMORY = 1 << 20


def _conv_size(value: object, key: Key, host: Host) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (m := _SIZE_RE.fullmatch(value.strip())):
        size = int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
    else:
        raise Invalid(
            f'expected a size such as "24G" or "512M" (K, M, G, T: powers of 1024), got {quote(value)}'
        )
    if size < MIN_MEMORY:
        raise Invalid(f"must be at least 1M, got {quote(value)}")
    if size >= 1 << 62:
        raise Invalid(f"must be less than 4E, got {quote(value)}")
    return size


_PERCENT_RE = re.compile(r"(\d+)%")


def _conv_percent(value: object, key: Key, host: Host) -> int:
    top = host.cpu_count * 100
    m = _PERCENT_RE.fullmatch(value.strip()) if isinstance(value, str) else None
    if m is None:
        raise Invalid(f'expected a percentage such as "400%" (100% = one CPU), got {quote(value)}')
    pct = int(m.group(1))
    if not 1 <= pct <= top:
        raise Invalid(f"must be from 1% to {top}% ({host.cpu_count} CPUs here), got {quote(value)}")
    return pct


_UUID_RE = re.compile(r"(GPU|MIG)-[0-9a-fA-F-]{8,}")


def _conv_gpu_devices(value: object, key: Key, host: Host) -> str | tuple[int | str, ...]:
    if value in ("auto", "none"):
        assert isinstance(value, str)
        return value
    expected = 'expected "auto", "none", or a list of GPU indices (0, 1) or UUIDs ("GPU-…")'
    if not isinstance(value, list) or not value:
        raise Invalid(f"{expected}, got {quote(value)}")
    out: list[int | str] = []
    for v in value:
        index = isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1023
        if not index and not (isinstance(v, str) and _UUID_RE.fullmatch(v)):
            raise Invalid(f"{expected}; {quote(v)} is neither")
        if v in out:
            raise Invalid(f"{quote(v)} is listed twice")
        out.append(v)
    return tuple(out)


def _conv_names(value: object, key: Key, host: Host) -> tuple[str, ...]:
    out = _strings(value, 'a list of model names such as ["llama-3.1-8b"]')
    for t in out:
        if not t or any(c.isspace() or ord(c) < 32 for c in t):
            raise Invalid(f"model names must be non-empty and without spaces, got {quote(t)}")
    dup = {t for t in out if out.count(t) > 1}
    if dup:
        raise Invalid(f"{quote(sorted(dup)[0])} is listed twice")
    return tuple(out)


def _conv_regexes(value: object, key: Key, host: Host) -> tuple[str, ...]:
    out = _strings(value, 'a list of regular expressions such as ["llama-3\\\\..*"]')
    for t in out:
        try:
            re.compile(t)
        except re.error as e:
            raise Invalid(f"{quote(t)} is not a valid regular expression: {e}") from None
    return tuple(out)


_CONVERTERS: dict[str, Callable[[object, Key, Host], Any]] = {
    "string": _conv_string,
    "bool": _conv_bool,
    "addresses": _conv_addresses,
    "choice": _conv_choice,
    "cidrs": _conv_cidrs,
    "int": _conv_int,
    "seconds": _conv_seconds,
    "argv": _conv_argv,
    "entrypoint": _conv_entrypoint,
    "ready": _conv_ready,
    "environment": _conv_environment,
    "abspath": _conv_abspath,
    "abspaths": _conv_abspaths,
    "urlpaths": _conv_urlpaths,
    "size": _conv_size,
    "percent": _conv_percent,
    "gpu_devices": _conv_gpu_devices,
    "gigabytes": _conv_gigabytes,
    "names": _conv_names,
    "regexes": _conv_regexes,
}

# The Provider field each key fills.
_FIELDS = {
    "listen.address": "addresses",
    "runtime.ready": "ready",
    "gpu.devices": "gpu_devices",
    "gpu.count": "gpu_count",
    "weights.paths": "weight_paths",
    "models.names": "model_names",
    "models.patterns": "model_patterns",
}


def _field(key: Key) -> str:
    return _FIELDS.get(key.dotted, key.name)


def _did_you_mean(section: str, name: str) -> str:
    here = did_you_mean(name, [k.name for k in KEYS if k.section == section])
    if here:
        return here
    elsewhere = [k.dotted for k in KEYS if k.name == name]
    if elsewhere:
        return f' (did you mean "{elsewhere[0]}"?)'
    return did_you_mean(name, [k.name for k in KEYS], 0.8, lambda n: BY_KEYNAME[n].dotted)


BY_KEYNAME = {k.name: k for k in KEYS}


# -- the pure validator ------------------------------------------------------------------


def check_slug(slug: str) -> str | None:
    """None when `slug` is usable, else the message saying why not."""
    if SLUG_RE.fullmatch(slug):
        return None
    return f'"{slug}" is not a valid provider name: {SLUG_RULE} (a "-" would nest systemd slices)'


def validate(data: dict[str, Any], slug: str, source: Path, host: Host) -> Provider | list[Problem]:
    """A parsed manifest → `Provider`, or every problem found, in file order."""
    file = str(source)
    problems: list[Problem] = []

    def problem(key: str, message: str) -> None:
        problems.append(Problem(file, key, message))

    if (msg := check_slug(slug)) is not None:
        problem("", msg)

    values: dict[str, Any] = {}
    present: set[str] = set()
    broken: set[str] = set()  # tables that are not tables

    def take(section: str, name: str, value: object) -> None:
        dotted = f"{section}.{name}" if section else name
        key = BY_DOTTED.get(dotted)
        if key is None:
            problem(dotted, "unknown key" + _did_you_mean(section, name))
            return
        try:
            values[_field(key)] = _CONVERTERS[key.kind](value, key, host)
            present.add(dotted)
        except Invalid as e:
            problem(dotted, str(e))

    tables: set[str] = set()
    for name, value in data.items():  # in file order, so problems are too
        if name in SECTIONS and name:
            if not isinstance(value, dict):
                problem(name, f"expected a table [{name}], got {quote(value)}")
                broken.add(name)
                continue
            tables.add(name)
            for sub, v in value.items():
                take(name, sub, v)
        elif isinstance(value, dict) and name not in BY_DOTTED:
            problem(name, unknown_table(name, [s for s in SECTIONS if s]))
        else:
            take("", name, value)

    for key in KEYS:
        reported = any(p.key == key.dotted for p in problems)
        if (
            key.required
            and key.dotted not in present
            and not reported
            and key.section not in broken
        ):
            problem(key.dotted, 'required key is missing (an address such as "127.0.0.1:8008")')

    # Relations between keys.
    has_command = "runtime.command" in present or any(p.key == "runtime.command" for p in problems)
    has_launch = "runtime.launch" in present or any(p.key == "runtime.launch" for p in problems)
    if has_command and has_launch:
        problem("runtime.launch", '"command" and "launch" are both set; keep one of them')
    elif not has_command and not has_launch:
        problem(
            "runtime", 'one of "command" (argv) or "launch" ("package.module:function") is required'
        )
    mh, mm = values.get("memory_high"), values.get("memory_max")
    if mh is not None and mm is not None and mh > mm:
        problem("limits.memory_high", "must not be larger than limits.memory_max")
    if "gpu" in tables:
        values.setdefault("gpu_devices", "auto")
    devices = values.get("gpu_devices", "none")
    count = values.get("gpu_count", 1)
    if isinstance(devices, tuple) and count > len(devices):
        problem("gpu.count", f"is {count} but gpu.devices lists only {len(devices)} device(s)")
    if devices == "none" and any(k in present for k in ("gpu.vram_budget_gb", "gpu.count")):
        problem(
            "gpu.devices", 'is "none" but other [gpu] keys are set; remove them or choose devices'
        )
    if problems:
        return problems
    if "working_directory" not in values and source.name == DIR_MANIFEST:
        values["working_directory"] = str(source.parent)
    return Provider(slug=slug, source=source, **values)


# -- files ---------------------------------------------------------------------------------


def slug_of(path: Path) -> str:
    """The slug a manifest path declares: `<slug>.toml` or `<slug>/provider.toml`."""
    if path.name == DIR_MANIFEST:
        return path.parent.name
    return path.name[: -len(".toml")] if path.name.endswith(".toml") else path.name


def _mode_problem(what: str, st: os.stat_result, uids: frozenset[int], is_dir: bool) -> str | None:
    if st.st_uid not in uids:
        trusted = " or ".join(str(u) for u in sorted(uids))
        return (
            f"{what} is owned by uid {st.st_uid}, not by root (uid {trusted}); manifests run "
            "commands on the host, so only root may own them"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (is_dir and st.st_mode & stat.S_ISVTX):
        return (
            f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); manifests "
            f"run commands on the host: chmod go-w {what}"
        )
    return None


def ownership_problems(path: Path) -> list[Problem]:
    """The file, its `<slug>/` directory if any, and the manifest directory holding them."""
    uids = paths.trusted_uids()
    checks = [(path, False), (path.parent, True)]
    if path.name == DIR_MANIFEST:
        checks.append((path.parent.parent, True))
    out: list[Problem] = []
    for p, is_dir in checks:
        try:
            st = p.stat()
        except OSError:
            continue  # reported by the read
        if (msg := _mode_problem(str(p), st, uids, is_dir)) is not None:
            out.append(Problem(str(path), "", msg))
    return out


def _read(path: Path) -> bytes | Problem:
    file = str(path)
    try:
        st = path.stat()
        if stat.S_ISDIR(st.st_mode):
            return Problem(file, "", "is a directory, expected a manifest file")
        if not stat.S_ISREG(st.st_mode):
            return Problem(file, "", "is not a regular file")
        if st.st_size > MAX_MANIFEST_BYTES:
            return Problem(file, "", f"is {st.st_size} bytes; a manifest may be at most 1 MiB")
        with path.open("rb") as f:
            return f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        return Problem(file, "", f"Failed to read manifest: {e.strerror or e}")


def parse_bytes(raw: bytes, path: Path, slug: str, host: Host) -> Provider | list[Problem]:
    file = str(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return [Problem(file, "", f"is not UTF-8 text (byte {e.start}); a manifest is a TOML file")]
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        return [Problem(file, "", f"is not valid TOML: {e}")]
    return validate(data, slug, path, host)


def parse_file(
    path: Path, slug: str | None = None, host: Host | None = None
) -> Provider | list[Problem]:
    """Read, check owner and mode, and validate one manifest file."""
    path = Path(os.path.abspath(path))
    raw = _read(path)
    if isinstance(raw, Problem):
        return [raw]
    problems = ownership_problems(path)
    result = parse_bytes(
        raw, path, slug if slug is not None else slug_of(path), host or this_host()
    )
    if isinstance(result, list):
        return problems + result
    return problems or result


# -- discovery and the checks across manifests --------------------------------------------


def _candidates(directory: Path) -> list[tuple[str, Path]]:
    """(slug, manifest path) for every entry that looks like a manifest, sorted."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return []
    out: list[tuple[str, Path]] = []
    for e in entries:
        if e.name.startswith("."):
            continue
        if e.name.endswith(".toml"):
            out.append((e.name[: -len(".toml")], Path(e.path)))
        elif e.is_dir() and os.path.lexists(os.path.join(e.path, DIR_MANIFEST)):
            out.append((e.name, Path(e.path) / DIR_MANIFEST))
    return out


def _collide(a: Address, b: Address) -> bool:
    if a.is_unix or b.is_unix:
        return a.path == b.path
    if a.port != b.port:
        return False
    if a.host == b.host or "::" in (a.host, b.host):
        return True
    return "0.0.0.0" in (a.host, b.host) and ":" not in (a.host or "") + (b.host or "")


def _address_groups(providers: list[Provider]) -> list[list[tuple[Provider, Address]]]:
    """Addresses that may collide, grouped by port or path (linear, for many manifests)."""
    groups: dict[object, list[tuple[Provider, Address]]] = {}
    for p in providers:
        for a in p.addresses:
            groups.setdefault(a.path if a.is_unix else a.port, []).append((p, a))
    return [g for g in groups.values() if len({id(p) for p, _ in g}) > 1]


def cross_check(providers: list[Provider]) -> list[Problem]:
    """Problems between valid providers: shared addresses and model names. Pure."""
    out: list[Problem] = []

    def both(x: Provider, x_key: str, x_msg: str, y: Provider, y_key: str, y_msg: str) -> None:
        out.append(Problem(str(x.source), x_key, x_msg))
        out.append(Problem(str(y.source), y_key, y_msg))

    for group in _address_groups(providers):
        for i, (p, a) in enumerate(group):
            for q, b in group[i + 1 :]:
                if p is not q and _collide(a, b):
                    both(
                        p, "listen.address",
                        f'"{a}" is also used by provider "{q.slug}" ({q.source}); give each provider its own address',
                        q, "listen.address",
                        f'"{b}" is also used by provider "{p.slug}" ({p.source}); give each provider its own address',
                    )  # fmt: skip
    owners: dict[str, Provider] = {}
    for p in providers:
        for n in p.model_names:
            q = owners.setdefault(n, p)
            if q is not p:
                claim = "is also claimed by provider"
                both(
                    q, "models.names", f'"{n}" {claim} "{p.slug}" ({p.source}); a model name belongs to one provider',
                    p, "models.names", f'"{n}" {claim} "{q.slug}" ({q.source}); a model name belongs to one provider',
                )  # fmt: skip
    for x in providers:
        for pat in x.model_patterns:
            rx = re.compile(pat)
            for n, y in owners.items():
                if y is not x and rx.fullmatch(n):
                    both(
                        x, "models.patterns",
                        f'"{pat}" matches "{n}", a name of provider "{y.slug}" ({y.source}); narrow the pattern',
                        y, "models.names",
                        f'"{n}" is also matched by pattern "{pat}" of provider "{x.slug}" ({x.source})',
                    )  # fmt: skip
    return out


def _finish(found: list[Provider], problems: list[Problem]) -> Discovery:
    cross = cross_check(found)
    bad = {p.file for p in cross}
    providers = {p.slug: p for p in sorted(found, key=lambda p: p.slug) if str(p.source) not in bad}
    return Discovery(providers, problems + cross)


def _scan(dirs: Iterable[Path], host: Host) -> tuple[list[Provider], list[Problem]]:
    found: list[Provider] = []
    problems: list[Problem] = []
    seen: set[str] = set()
    for directory in dirs:
        by_slug: dict[str, list[Path]] = {}
        for slug, path in _candidates(directory):
            by_slug.setdefault(slug, []).append(path)
        for slug, manifests in by_slug.items():
            if slug in seen:
                continue  # a higher-priority directory declares it
            seen.add(slug)
            if len(manifests) > 1:
                manifests.sort(key=str)
                for m in manifests:
                    others = ", ".join(str(o) for o in manifests if o != m)
                    problems.append(
                        Problem(
                            str(m), "", f'provider "{slug}" is also declared by {others}; keep one'
                        )
                    )
                continue
            result = parse_file(manifests[0], slug, host)
            if isinstance(result, list):
                problems.extend(result)
            else:
                found.append(result)
    return found, problems


def discover(dirs: list[Path] | None = None, host: Host | None = None) -> Discovery:
    """Every manifest in the manifest directories (highest priority first)."""
    found, problems = _scan(paths.manifest_dirs() if dirs is None else dirs, host or this_host())
    return _finish(found, problems)


def check_paths(items: list[Path], host: Host | None = None) -> Discovery:
    """`providerctl check PATH...`: files, `<slug>/` directories or manifest directories."""
    host = host or this_host()
    problems: list[Problem] = []
    manifests: list[Path] = []
    for item in items:
        item = Path(os.path.abspath(item))
        if item.is_dir() and not item.name.endswith(".toml"):
            if os.path.lexists(item / DIR_MANIFEST):
                manifests.append(item / DIR_MANIFEST)
            else:
                manifests += [path for _, path in _candidates(item)]
        elif os.path.lexists(item):
            manifests.append(item)
        else:
            problems.append(Problem(str(item), "", "No such file or directory"))
    by_slug: dict[str, list[Path]] = {}
    for path in dict.fromkeys(manifests):  # each file once, in the order given
        by_slug.setdefault(slug_of(path), []).append(path)
    found: list[Provider] = []
    for slug, paths_ in by_slug.items():
        if len(paths_) > 1:
            for m in paths_:
                others = ", ".join(str(o) for o in paths_ if o != m)
                problems.append(
                    Problem(str(m), "", f'provider "{slug}" is also declared by {others}; keep one')
                )
            continue
        result = parse_file(paths_[0], slug, host)
        if isinstance(result, list):
            problems.extend(result)
        else:
            found.append(result)
    return _finish(found, problems)


def load(slug: str) -> Provider:
    """The manifest of one provider, for the front at start. Raises ManifestError."""
    env = os.environ.get("PROVIDERD_MANIFEST")
    if env:
        result = parse_file(Path(env), slug)
        if isinstance(result, list):
            raise ManifestError(result)
        return result
    found = discover()
    if slug in found.providers:
        return found.providers[slug]
    mine = [p for p in found.problems if slug_of(Path(p.file)) == slug]
    if mine:
        raise ManifestError(mine)
    where = ", ".join(str(d) for d in paths.manifest_dirs())
    raise ManifestError([Problem(slug, "", f'no manifest for provider "{slug}" in {where}')])


# -- providerctl check -----------------------------------------------------------------------


def _shell_word(arg: str) -> str:
    return arg if re.fullmatch(r"[\w@%+=:,./{}-]+", arg) else shlex.quote(arg)


def summary(p: Provider) -> str:
    """One line for a valid provider: slug, address(es), command."""
    addresses = ", ".join(str(a) for a in p.addresses)
    run = f"launch {p.launch}" if p.launch else " ".join(_shell_word(a) for a in p.command)
    state = "" if p.enabled else " (disabled)"
    return f"{p.slug}: {addresses} ({p.protocol}){state} -> {run}"


def main_check(items: list[str], out: TextIO, err: TextIO) -> int:
    """`providerctl check [PATH...]`: every problem one line on `out`, exit 1 if any."""
    found = check_paths([Path(i) for i in items]) if items else discover()
    for problem in found.problems:
        out.write(f"{problem}\n")
    if found.problems:
        return 1
    for p in found.providers.values():
        out.write(summary(p) + "\n")
    if not found.providers:
        where = ", ".join(items) if items else ", ".join(str(d) for d in paths.manifest_dirs())
        err.write(f"providerctl: no manifests found in {where}\n")
    return 0


def with_source(provider: Provider, source: Path) -> Provider:
    """The same provider as if read from `source` (golden tests use fixed paths)."""
    return replace(provider, source=source)
