"""Writing values into unit files so that systemd reads back exactly what was meant. Pure.

A line break in a value would start a new directive and a trailing backslash would
swallow the next line: `assignment` and `comment` refuse both (`Unrenderable`), whatever
the manifest's checks let through. `exec_word`, `environment_assignment` and
`escape_specifiers` quote for ExecStart=, Environment= and every other directive
(an EnvironmentFile='s text is `agent.systemd.envfile`'s).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.errors import ProviderdError


@dataclass(frozen=True)
class Link:
    """A file the generator writes as a symbolic link to `target` (the rest are text)."""

    target: str


# (section, directive, value exactly as written in the file)
Assignment = tuple[str, str, str]


class Unrenderable(ProviderdError, ValueError):
    """A value that a unit file would not carry as it is: a line break would start a new
    directive, a trailing backslash would swallow the next line. The last guard, whatever
    the manifest's checks let through."""

    code = "unrenderable"

    def __init__(self, directive: str, reason: str) -> None:
        super().__init__(f"cannot be written safely as {directive}: the value {reason}")
        self.directive = directive


# systemd ends a line at \n, \r and NUL; other control characters have no business in a unit.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")


def _check(directive: str, value: str) -> None:
    if m := _UNSAFE.search(value):
        raise Unrenderable(directive, f"holds the control character U+{ord(m.group()):04X}")
    if value.endswith("\\"):
        raise Unrenderable(directive, "ends with '\\', which would continue it onto the next line")
    if value != value.strip(" "):
        raise Unrenderable(directive, "starts or ends with a space, which systemd drops")


def assignment(directive: str, value: str) -> str:
    """`Directive=value` as one line, or Unrenderable if systemd would read it otherwise."""
    _check(f"{directive}=", value)
    return f"{directive}={value}"


def comment(text: str) -> str:
    """`# text` as one line (a comment never continues, but a line break would end it)."""
    _check("a comment", text.replace("\\", "/"))
    return f"# {text}"


def dropin_text(head: str, assignments: list[Assignment]) -> str:
    """A drop-in: the `head` comment, then each section's assignments, in order."""
    lines = [comment(head)]
    section = None
    for sec, directive, value in assignments:
        if sec != section:
            lines += ["", f"[{sec}]"]
            section = sec
        lines.append(assignment(directive, value))
    return "\n".join(lines) + "\n"


_SAFE_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./{}$^~-]+")


_NEEDS_ESCAPE = re.compile(r'[\\"\x00-\x1f\x7f]')


def _c_escape(text: str) -> str:
    if not _NEEDS_ESCAPE.search(text):
        return text
    out = []
    for c in text:
        if c == "\\":
            out.append("\\\\")
        elif c == '"':
            out.append('\\"')
        elif c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return "".join(out)


def escape_specifiers(text: str) -> str:
    """`%` → `%%`: systemd expands specifiers in almost every value."""
    return text.replace("%", "%%")


# Stands for a variable in a word given to exec_word(): no manifest value holds a NUL.
VARIABLE = "\0"


def exec_word(word: str, variable: str = "") -> str:
    """One argv item for ExecStart=: `%`→`%%`, `$`→`$$`, C-style quoting where needed.
    Each VARIABLE in `word` becomes `${variable}`, which systemd replaces with the
    variable's value as it is (one argument, whatever it holds)."""
    pieces = [escape_specifiers(p).replace("$", "$$") for p in word.split(VARIABLE)]
    if len(pieces) > 1 and not variable.isidentifier():
        raise ValueError(f"not a variable name: {variable!r}")
    word = f"${{{variable}}}".join(pieces)
    if _SAFE_WORD.fullmatch(word):
        return word
    return '"' + _c_escape(word) + '"'


def exec_line(argv: list[str], variable: str = "") -> str:
    return " ".join(exec_word(w, variable) for w in argv)


def environment_assignment(name: str, value: str) -> str:
    """The value of one Environment= line: `$` stays literal there, `%` does not."""
    return '"' + _c_escape(escape_specifiers(f"{name}={value}")) + '"'


def one_line(text: str) -> str:
    return escape_specifiers(" ".join(text.split()))


def seconds(value: float) -> str:
    return f"{int(value)}s" if float(value).is_integer() else f"{value:g}s"
