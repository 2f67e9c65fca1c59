"""Kubernetes behaviour the export relies on, re-implemented for tests."""

from __future__ import annotations

from collections.abc import Callable


def expand(text: str, mapping: Callable[[str], str | None]) -> str:
    """Kubernetes' `$(VAR)` expansion of command, args and env values (a port of
    k8s.io/kubernetes third_party/forked/golang/expansion Expand): `$$` gives `$`,
    `$(NAME)` the variable's value when it is defined, anything else is kept."""
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    n = len(text)
    while cursor < n:
        if text[cursor] == "$" and cursor + 1 < n:
            out.append(text[checkpoint:cursor])
            rest = text[cursor + 1 :]
            if rest[0] == "$":
                read, advance = "$", 1
            elif rest[0] == "(":
                close = rest.find(")", 1)
                if close >= 0:
                    name = rest[1:close]
                    value = mapping(name)
                    read, advance = (value if value is not None else f"$({name})"), close + 1
                else:
                    read, advance = "$(", 1
            else:
                read, advance = "$" + rest[0], 1
            out.append(read)
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    return "".join(out) + text[checkpoint:]
