"""Deterministic YAML text for plain data (dicts, lists, strings, ints, bools).

Keys keep their insertion order, so the same input gives the same bytes. A string is
written plain only when no YAML 1.1 or 1.2 reader could take it for anything but that
string; every other string is double-quoted with escapes, so the text round-trips
exactly (including control characters, non-ASCII and the empty string). No I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*")
# Words YAML 1.1 readers (PyYAML, many tools) turn into booleans or null.
_RESERVED = frozenset(["y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"])


def _plain(text: str) -> bool:
    return len(text) <= 200 and _PLAIN.fullmatch(text) is not None and text.lower() not in _RESERVED


def quote(text: str) -> str:
    """A YAML double-quoted scalar that reads back as exactly `text`."""
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def scalar(value: object) -> str:
    if value is True:
        return "true"
    if value is False:
        return "false"
    if value is None:
        return "null"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return value if _plain(value) else quote(value)
    raise TypeError(f"cannot write {type(value).__name__} as YAML")


def _lines(value: object, indent: int) -> Iterable[str]:
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            yield pad + "{}"
            return
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError("YAML keys must be strings here")
            head = f"{pad}{scalar(key)}:"
            if isinstance(item, dict | list) and item:
                yield head
                yield from _lines(item, indent + 2 if isinstance(item, dict) else indent)
            else:
                yield f"{head} {_inline(item)}"
    elif isinstance(value, list):
        if not value:
            yield pad + "[]"
            return
        for item in value:
            if isinstance(item, dict | list) and item:
                inner = list(_lines(item, indent + 2))
                yield pad + "- " + inner[0][indent + 2 :]
                yield from inner[1:]
            else:
                yield f"{pad}- {_inline(item)}"
    else:
        yield pad + scalar(value)


def _inline(value: object) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return scalar(value)


def document(value: dict[str, object]) -> str:
    """One YAML document (without the `---` separator), ending in a newline."""
    return "\n".join(_lines(value, 0)) + "\n"


def documents(values: Iterable[dict[str, object]]) -> str:
    """A YAML stream: each document after a `---` line."""
    return "".join("---\n" + document(v) for v in values)
