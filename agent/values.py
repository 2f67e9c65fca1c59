"""Manifest values: a TOML value → the typed value a key needs, or `Invalid` with the
message a person reads.

One converter per key kind (`agent.keys.KINDS`, looked up in `CONVERTERS`), the host
facts they need (`Host`), and the strict-TOML helpers `agent.config` uses as well.
Pure: no file is read here.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from agent.keys import Key
from agent.model import PLACEHOLDERS, Address, Ready, fill_placeholders

UNIX_PATH_MAX = 107  # sun_path is 108 bytes with the terminating NUL


@dataclass(frozen=True)
class Host:
    """What validation needs to know about the machine it runs on."""

    cpu_count: int
    exists: Callable[[str], bool]


def this_host() -> Host:
    return Host(cpu_count=os.cpu_count() or 1, exists=os.path.exists)


class Invalid(Exception):
    """A TOML value that cannot be used; the message says what was expected (for a
    `Problem`). Raised by the converters here and by agent.config."""


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


def _number(value: object, key: Key, expected: str, unit: str) -> float:
    if not _is_number(value):
        raise Invalid(f"expected {expected}, got {quote(value)}")
    assert isinstance(value, int | float)
    _range(key, value, unit)
    return float(value)


def _conv_seconds(value: object, key: Key, host: Host) -> float:
    return _number(value, key, f"a number of seconds from {key.range_text()}", " seconds")


def _conv_gigabytes(value: object, key: Key, host: Host) -> float:
    return _number(value, key, "a number of GB such as 18.5", " GB")


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


CONVERTERS: dict[str, Callable[[object, Key, Host], Any]] = {
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
