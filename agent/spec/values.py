"""Manifest values: a TOML value → the typed value a key needs, or `Invalid` with the
message a person reads.

One converter per key kind (`agent.spec.keys.KINDS`, looked up in `CONVERTERS`) and the
host facts they need (`Host`); manifests and providerd.toml share them (settings' keys are
`Key`s too). The wording of messages lives in `agent.spec.toml_strict`. Pure: no file is
read here.

Over 400 lines for a reason: one converter for each of the 23 kinds, each with the exact
message for every way a value can be wrong; splitting the table of kinds would scatter
what a reader compares side by side.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.spec.keys import Key
from agent.spec.patterns import PatternError, compile_pattern
from agent.spec.provider import (
    PLACEHOLDERS,
    Address,
    Ready,
    fill_placeholders,
    has_control,
)
from agent.spec.sizes import format_size, size_bytes
from agent.spec.toml_strict import Invalid, expect_bool, quote

UNIX_PATH_MAX = 107  # sun_path is 108 bytes with the terminating NUL
MAX_NAME = 256  # characters of a model name or pattern


@dataclass(frozen=True)
class Host:
    """What validation needs to know about the machine it runs on."""

    cpu_count: int
    exists: Callable[[str], bool]


def this_host() -> Host:
    return Host(cpu_count=os.cpu_count() or 1, exists=os.path.exists)


# -- converters, one per key kind (agent.spec.keys.KINDS) --------------------------------------


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


def _number_text(value: float) -> str:
    """A number for a message: integral floats without ".0", and bounded in length."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return quote(value)


def _range(key: Key, value: float, unit: str = "") -> None:
    lo = -math.inf if key.low is None else key.low
    hi = math.inf if key.high is None else key.high
    if not lo <= value <= hi:  # also refuses nan; compares huge integers exactly
        raise Invalid(f"must be from {key.range_text()}{unit}, got {_number_text(value)}")


def _conv_string(value: object, key: Key, host: Host) -> str:
    text = _text(value)
    if has_control(text):
        raise Invalid(
            f"may not contain control characters (newlines, tabs, ...), got {quote(text)}"
        )
    return text


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


# An interface name as the kernel takes it (IFNAMSIZ 16 with the NUL), or an index.
_SCOPE_RE = re.compile(r"[A-Za-z0-9_.-]{1,15}|[0-9]{1,10}")


def _scope_problem(host: str) -> str | None:
    """Why the `%scope` of an IPv6 address text cannot be used, or None."""
    _, sep, scope = host.partition("%")
    if not sep:
        return None
    if not _SCOPE_RE.fullmatch(scope) or scope in (".", ".."):
        return (
            f"the scope of {quote(host)} is not an interface name "
            "(letters, digits, '_', '.' or '-', at most 15 characters, such as \"eth0\")"
        )
    return None


def parse_address(text: str) -> Address:
    """One listen address; raises Invalid with the expected forms."""
    forms = 'expected "host:port", "[v6]:port" or an absolute unix socket path'
    if text.startswith("/"):
        if len(text.encode()) > UNIX_PATH_MAX:
            raise Invalid(f"unix socket path {quote(text)} is longer than {UNIX_PATH_MAX} bytes")
        if has_control(text) or any(c.isspace() for c in text) or any(c in text for c in "%\\\"'"):
            raise Invalid(
                f"unix socket path {quote(text)} may not contain spaces, control characters, "
                "quotes, '\\' or '%'"
            )
        return Address(None, None, os.path.normpath(text))
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise Invalid(f"{forms}, got {quote(text)}")
        if (msg := _scope_problem(host)) is not None:
            raise Invalid(msg)
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
    if not (port.isascii() and port.isdigit()) or len(port) > 5 or not 1 <= int(port) <= 65535:
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
        if "%" in t:
            raise Invalid(
                f"{quote(t)}: an allow-list entry takes no interface scope ('%'); "
                "IPAddressAllow= matches addresses only"
            )
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
        if path.startswith("/") and not (has_control(path) or any(c.isspace() for c in path)):
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
    if has_control(text) or any(c.isspace() or c in ":\"'\\" for c in text):
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


def _conv_credentials(value: object, key: Key, host: Host) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise Invalid(
            "expected a table of absolute paths such as "
            f'{{ HF_TOKEN = "/etc/providerd/credentials/hf" }}, got {quote(value)}'
        )
    out: list[tuple[str, str]] = []
    for name, v in value.items():
        if not _ENV_NAME_RE.fullmatch(name) or len(name) > 128:
            raise Invalid(
                f"{quote(name)} is not a credential name (letters, digits and '_', not first a "
                "digit, at most 128)"
            )
        if name.startswith("PROVIDERD_") or name == "CREDENTIALS_DIRECTORY":
            raise Invalid(f"{quote(name)}: this name is set by providerd or systemd itself")
        if not isinstance(v, str):
            raise Invalid(f"{name}: expected the absolute path of a file, got {quote(v)}")
        # Not checked for existence here: the front, which validates its manifest too,
        # cannot see the credentials; `providerctl check` (root) warns instead.
        out.append((name, _abspath(v, "path")))
    return tuple(out)


def _conv_filemode(value: object, key: Key, host: Host) -> int:
    text = _text(value, 'an octal mode as a string, such as "0660"')
    if not re.fullmatch(r"0?[0-7]{3}", text):
        raise Invalid(f'expected an octal mode such as "0660" or "0600", got {quote(text)}')
    return int(text, 8)


_GROUP_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")


def _conv_group(value: object, key: Key, host: Host) -> str:
    text = _text(value, "a group name")
    if not _GROUP_RE.fullmatch(text):
        raise Invalid(
            f"{quote(text)} is not a group name (letters, digits, '_', '.', '-', at most 32)"
        )
    return text


def _conv_urlpaths(value: object, key: Key, host: Host) -> tuple[str, ...]:
    out = _strings(value, 'a list of HTTP paths such as ["/health"]')
    for t in out:
        if not t.startswith("/") or any(c.isspace() for c in t):
            raise Invalid(f'expected HTTP paths starting with "/", got {quote(t)}')
    return tuple(out)


MIN_MEMORY = 1 << 20


def _conv_size(value: object, key: Key, host: Host) -> int:
    size = size_bytes(value)
    if size is None:
        raise Invalid(
            f'expected a size such as "24G" or "512M" (K, M, G, T: powers of 1024), got {quote(value)}'
        )
    if key.low is not None or key.high is not None:  # a range of its own (providerd.toml)
        low, high = int(key.low or 0), int(key.high or 1 << 62)
        if not low <= size <= high:
            raise Invalid(
                f"must be from {format_size(low)} to {format_size(high)}, got {quote(value)}"
            )
        return size
    if size < MIN_MEMORY:
        raise Invalid(f"must be at least 1M, got {quote(value)}")
    if size >= 1 << 62:
        raise Invalid(f"must be less than 4E, got {quote(value)}")
    return size


_PERCENT_RE = re.compile(r"(\d{1,9})%")


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
    seen: set[str] = set()
    for t in out:
        if not t or has_control(t) or any(c.isspace() for c in t):
            raise Invalid(f"model names must be non-empty and without spaces, got {quote(t)}")
        if len(t) > MAX_NAME:
            raise Invalid(f"model names may be at most {MAX_NAME} characters, got {len(t)}")
        if t in seen:
            raise Invalid(f"{quote(t)} is listed twice")
        seen.add(t)
    return tuple(out)


def _conv_regexes(value: object, key: Key, host: Host) -> tuple[str, ...]:
    out = _strings(value, 'a list of regular expressions such as ["llama-3\\\\..*"]')
    for t in out:
        if len(t) > MAX_NAME:
            raise Invalid(f"patterns may be at most {MAX_NAME} characters, got {len(t)}")
        try:
            compile_pattern(t)
        except PatternError as e:
            raise Invalid(f"{quote(t)} {e}") from None
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
    "credentials": _conv_credentials,
    "filemode": _conv_filemode,
    "group": _conv_group,
}
