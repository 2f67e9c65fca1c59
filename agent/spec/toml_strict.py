"""Reading TOML strictly, for manifests and providerd.toml alike: bounded nesting, one
message for a file that is not TOML, and the wording of every message about a value
(`Invalid`, `quote`, `did you mean`). Pure."""

from __future__ import annotations

import difflib
import re
import sys
import tomllib
from collections.abc import Callable, Iterable
from typing import Any

from agent.errors import ProviderdError
from agent.spec.provider import CONTROL

MAX_DEPTH = 32  # arrays and tables inside each other; no key needs more than 3


class Invalid(ProviderdError):
    """A TOML value that cannot be used; the message says what was expected (for a
    `Problem`). Raised by the converters here and by agent.spec.settings."""

    code = "invalid_value"


def _escape_control(m: re.Match[str]) -> str:
    c = m.group()
    return {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c) or f"\\u{ord(c):04x}"


def quote(value: object) -> str:
    """A value quoted for a message, TOML-like, on one line and short."""
    if isinstance(value, str):
        text = value[:200].replace("\\", "\\\\").replace('"', '\\"')
        text = '"' + CONTROL.sub(_escape_control, text) + ('"' if len(value) <= 200 else "")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**60:
        text = f"an integer of {len(str(abs(value)))} digits"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, dict):
        text = "a table"
    elif isinstance(value, list):
        text = "[" + ", ".join(quote(v) for v in value[:4]) + (", ...]" if len(value) > 4 else "]")
    else:
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _depth(data: object) -> int:
    """How deeply arrays and tables nest in `data` (iteratively: no recursion limit)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Iterable[object] = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((v, depth + 1) for v in children)
    return deepest


def load_toml(raw: bytes, what: str) -> dict[str, Any]:
    """The TOML document in `raw` (the text of `what`, such as "a manifest"), with
    bounded nesting; raises Invalid with the message for the whole file."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Invalid(f"is not UTF-8 text (byte {e.start}); {what} is a TOML file") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise Invalid(f"is not valid TOML: {e}") from None
    except RecursionError:
        raise Invalid(f"nests arrays or tables too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:  # int(): more digits than the interpreter converts
        if "digits" not in str(e):
            raise
        limit = sys.get_int_max_str_digits()
        raise Invalid(f"holds an integer of more than {limit} digits; no key takes one") from None
    if _depth(data) > MAX_DEPTH:
        raise Invalid(f"nests arrays or tables more than {MAX_DEPTH} levels deep")
    return data


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
