"""What the manifest, unit and generator tests share: case files and a reader
of systemd unit syntax that follows systemd's own rules, so that quoting is
checked by parsing the output back rather than by comparing strings."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from support.paths import ROOT

from agent.spec.values import Host

CASES = Path(__file__).resolve().parent
REPO = ROOT
EXAMPLES = REPO / "examples"
UNITS = REPO / "units"

# Deterministic host facts for case files: 4 CPUs; paths under /srv/present exist.
CASE_HOST = Host(cpu_count=4, exists=lambda p: p.startswith("/srv/present"))
# For the examples: their weight paths are documented, not present on a test machine.
ANY_PATHS_HOST = Host(cpu_count=os.cpu_count() or 1, exists=lambda p: True)


def install(src: Path, directory: Path, name: str | None = None) -> Path:
    """Copy a manifest into `directory` with the modes the ownership check accepts."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)
    dest = directory / (name or src.name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.parent.chmod(0o755)
    shutil.copyfile(src, dest)
    dest.chmod(0o644)
    return dest


def write(directory: Path, name: str, text: str) -> Path:
    """Write a manifest into `directory` with accepted modes; `name` may be `slug/provider.toml`."""
    dest = directory / name
    for d in [directory, *list(dest.parents)[: len(Path(name).parts) - 1]]:
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)
    dest.write_text(text, encoding="utf-8")
    dest.chmod(0o644)
    return dest


def directives(path: Path, name: str) -> list[str]:
    """The values of `## name: value` lines in a case file, in order."""
    prefix = f"## {name}:"
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith(prefix):
            out.append(line[len(prefix) :].strip())
    return out


# -- systemd unit syntax -------------------------------------------------------------------

_CESCAPES = {
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "\\": "\\",
    '"': '"',
    "'": "'",
    "s": " ",
}


def _cunescape_one(s: str, i: int) -> tuple[str, int]:
    """The character escaped at s[i] (just after a backslash) and the next index."""
    c = s[i]
    if c in _CESCAPES:
        return _CESCAPES[c], i + 1
    if c == "x":
        return chr(int(s[i + 1 : i + 3], 16)), i + 3
    raise ValueError(f"unsupported escape \\{c}")


def split_words(value: str) -> list[str]:
    """systemd's extract_first_word(EXTRACT_UNQUOTE|EXTRACT_CUNESCAPE), word by word."""
    words: list[str] = []
    i, n = 0, len(value)
    while True:
        while i < n and value[i] in " \t\n":
            i += 1
        if i >= n:
            return words
        word: list[str] = []
        quote: str | None = None
        while i < n:
            c = value[i]
            if quote:
                if c == quote:
                    quote = None
                    i += 1
                elif c == "\\":
                    ch, i = _cunescape_one(value, i + 1)
                    word.append(ch)
                else:
                    word.append(c)
                    i += 1
            elif c in "\"'":
                quote = c
                i += 1
            elif c == "\\":
                ch, i = _cunescape_one(value, i + 1)
                word.append(ch)
            elif c in " \t\n":
                break
            else:
                word.append(c)
                i += 1
        if quote:
            raise ValueError(f"unbalanced quote in {value!r}")
        words.append("".join(word))


def unspecify(text: str) -> str:
    """Resolve `%%` (the only specifier generated values may contain)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "%":
            if text[i + 1 : i + 2] != "%":
                raise ValueError(f"unexpected specifier in {text!r}")
            out.append("%")
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def unexpand(text: str, environ: dict[str, str] | None = None) -> str:
    """What systemd's $VAR expansion of ExecStart leaves of a word: `$$` is `$`, and
    `${NAME}` (of `environ` only) is NAME's value."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$":
            if text[i + 1 : i + 2] == "{" and environ is not None:
                end = text.index("}", i)
                out.append(environ[text[i + 2 : end]])
                i = end + 1
                continue
            if text[i + 1 : i + 2] != "$":
                raise ValueError(f"unexpected variable reference in {text!r}")
            out.append("$")
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def exec_argv(value: str, environ: dict[str, str] | None = None) -> list[str]:
    """An ExecStart= value → the argv the process gets (with `environ`: its variables)."""
    return [unexpand(unspecify(w), environ) for w in split_words(value)]


def environment(value: str) -> dict[str, str]:
    """An Environment= value → the variables it sets."""
    out = {}
    for w in split_words(value):
        name, _, v = unspecify(w).partition("=")
        out[name] = v
    return out


def parse_unit(text: str) -> list[tuple[str, str, str]]:
    """(section, key, raw value) for every assignment, in order."""
    out = []
    section = ""
    for line in text.splitlines():
        s = line.strip()
        if not s or s[0] in "#;":
            continue
        if s.startswith("["):
            section = s[1:-1]
            continue
        key, _, value = s.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def values(text: str, section: str, key: str) -> list[str]:
    return [v for s, k, v in parse_unit(text) if s == section and k == key]


# -- reading a unit file the way systemd's conf-parser does ---------------------------------

_WHITESPACE = " \t\n\r"
_EOL = "\n\r\0"


def _lines(text: str) -> list[str]:
    """systemd's read_line(): a line ends at \\n, \\r or NUL; \\r\\n counts as one end."""
    out: list[str] = []
    cur: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c in _EOL:
            out.append("".join(cur))
            cur = []
            if c == "\r" and text[i + 1 : i + 2] == "\n":
                i += 1
        else:
            cur.append(c)
        i += 1
    if cur:
        out.append("".join(cur))
    return out


def read_unit(text: str) -> list[tuple[str, str, str]]:
    """(section, key, raw value) for every assignment systemd would see, in order.

    Follows src/shared/conf-parser.c (v252): a line whose first non-blank character is
    `#` or `;` is a comment and skipped, even in the middle of a continuation; a line
    that ends in an unescaped backslash continues on the next one, the backslash
    becoming a space; `[Section]` headers; `Key=value` with both sides stripped.
    Raises ValueError where systemd would log a syntax error and ignore the line."""
    if text.startswith("\ufeff"):
        text = text[1:]
    out: list[tuple[str, str, str]] = []
    section = ""
    continuation: str | None = None
    for raw in _lines(text):
        stripped = raw.lstrip(_WHITESPACE)
        if stripped and stripped[0] in "#;":
            continue
        p = raw if continuation is None else continuation + raw
        escaped = False
        for c in p:
            escaped = False if escaped else c == "\\"
        if escaped:
            continuation = p[:-1] + " "
            continue
        continuation = None
        line = p.strip(_WHITESPACE)
        if not line:
            continue
        if line.startswith("["):
            if not line.endswith("]"):
                raise ValueError(f"invalid section header {line!r}")
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"missing '=' in {line!r}")
        out.append((section, key.strip(_WHITESPACE), value.strip(_WHITESPACE)))
    if continuation is not None:
        line = continuation.strip(_WHITESPACE)
        if line:
            key, sep, value = line.partition("=")
            if not sep:
                raise ValueError(f"missing '=' in {line!r}")
            out.append((section, key.strip(_WHITESPACE), value.strip(_WHITESPACE)))
    return out
