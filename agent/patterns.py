"""Model-name patterns checked in time linear in the name.

`[models] patterns` are Python regular expressions, full-matched against model names.
Python's `re` backtracks: `(a+)+b` against forty `a`s never finishes. Checking every
pattern against every other provider's names at each boot must not hang the
generator, so patterns are compiled here into a small automaton (Thompson's
construction) and matched by simulating it: time in O(len(program) x len(name)),
whatever the pattern. The regular part of the syntax is supported (literals, `.`,
classes, `\\d \\w \\s`, groups, `|`, `* + ? {m,n}` greedy or lazy, `^` and `$`);
back-references, look-arounds, conditionals, atomic groups, possessive repeats,
word boundaries and inline flags are refused with a message, as is a program of
more than `MAX_PROGRAM` steps (`a{1000}`, say).

`literal_prefix` gives the characters every match starts with, so the check across
providers tests a pattern only against the names that share them.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_parser: Any = importlib.import_module("re._parser")  # the stdlib's own parser (3.11+)

MAX_PROGRAM = 4096  # steps of a compiled pattern
_MAXREPEAT: int = _parser.MAXREPEAT


class PatternError(ValueError):
    """A pattern that cannot be checked in linear time (or at all); the message says why."""


# Instructions: ("char", predicate) consumes one character; ("split", a, b) and
# ("jmp", a) move without consuming; ("bol",) and ("eol",) assert a position.
Instr = tuple[Any, ...]
Pred = Callable[[str], bool]


def _category(name: str) -> Pred:
    preds: dict[str, Pred] = {
        "CATEGORY_DIGIT": str.isdecimal,
        "CATEGORY_NOT_DIGIT": lambda c: not c.isdecimal(),
        "CATEGORY_SPACE": str.isspace,
        "CATEGORY_NOT_SPACE": lambda c: not c.isspace(),
        "CATEGORY_WORD": lambda c: c.isalnum() or c == "_",
        "CATEGORY_NOT_WORD": lambda c: not (c.isalnum() or c == "_"),
    }
    if name not in preds:
        raise PatternError(f"uses the class {name}, which model patterns do not support")
    return preds[name]


def _in(items: list[tuple[Any, Any]]) -> Pred:
    negate = False
    chars: set[str] = set()
    ranges: list[tuple[int, int]] = []
    cats: list[Pred] = []
    for op, arg in items:
        kind = str(op)
        if kind == "NEGATE":
            negate = True
        elif kind == "LITERAL":
            chars.add(chr(arg))
        elif kind == "RANGE":
            ranges.append((arg[0], arg[1]))
        elif kind == "CATEGORY":
            cats.append(_category(str(arg)))
        else:
            raise PatternError(f"uses {kind} in a class, which model patterns do not support")

    def pred(c: str) -> bool:
        hit = c in chars or any(lo <= ord(c) <= hi for lo, hi in ranges) or any(f(c) for f in cats)
        return hit != negate

    return pred


class _Compiler:
    def __init__(self) -> None:
        self.prog: list[Instr] = []

    def emit(self, *instr: Any) -> int:
        if len(self.prog) >= MAX_PROGRAM:
            raise PatternError(f"is too complex to check (more than {MAX_PROGRAM} steps)")
        self.prog.append(tuple(instr))
        return len(self.prog) - 1

    def patch(self, at: int, *instr: Any) -> None:
        self.prog[at] = tuple(instr)

    def seq(self, items: Any) -> None:
        for op, arg in items:
            self.one(str(op), arg)

    def one(self, kind: str, arg: Any) -> None:
        if kind == "LITERAL":
            c = chr(arg)
            self.emit("char", c.__eq__)
        elif kind == "NOT_LITERAL":
            c = chr(arg)
            self.emit("char", c.__ne__)
        elif kind == "ANY":
            self.emit("char", "\n".__ne__)
        elif kind == "IN":
            self.emit("char", _in(arg))
        elif kind == "SUBPATTERN":
            _group, add_flags, del_flags, body = arg
            if add_flags or del_flags:
                raise PatternError(
                    "uses inline flags such as (?i), which model patterns do not support"
                )
            self.seq(body)
        elif kind == "BRANCH":
            self.branch(arg[1])
        elif kind in ("MAX_REPEAT", "MIN_REPEAT"):
            lo, hi, body = arg
            self.repeat(lo, hi, body)
        elif kind == "AT":
            at = str(arg)
            if at in ("AT_BEGINNING", "AT_BEGINNING_STRING"):
                self.emit("bol")
            elif at in ("AT_END", "AT_END_STRING"):
                self.emit("eol")
            else:
                raise PatternError("uses \\b, \\B, \\A or \\Z, which model patterns do not support")
        else:
            what = {
                "GROUPREF": "a back-reference",
                "GROUPREF_EXISTS": "a conditional group",
                "ASSERT": "a look-around",
                "ASSERT_NOT": "a look-around",
                "ATOMIC_GROUP": "an atomic group",
                "POSSESSIVE_REPEAT": "a possessive repeat",
            }.get(kind, kind)
            raise PatternError(f"uses {what}, which model patterns do not support")

    def branch(self, alternatives: list[Any]) -> None:
        jumps: list[int] = []
        for i, alt in enumerate(alternatives):
            if i < len(alternatives) - 1:
                split = self.emit("split", 0, 0)
                self.seq(alt)
                jumps.append(self.emit("jmp", 0))
                self.patch(split, "split", split + 1, len(self.prog))
            else:
                self.seq(alt)
        for j in jumps:
            self.patch(j, "jmp", len(self.prog))

    def repeat(self, lo: int, hi: int, body: Any) -> None:
        for _ in range(lo):
            self.seq(body)
        if hi == _MAXREPEAT:
            split = self.emit("split", 0, 0)
            self.seq(body)
            self.emit("jmp", split)
            self.patch(split, "split", split + 1, len(self.prog))
            return
        ends: list[int] = []
        for _ in range(hi - lo):
            ends.append(self.emit("split", 0, 0))
            self.seq(body)
        for s in ends:
            self.patch(s, "split", s + 1, len(self.prog))


def _literal_prefix(items: Any) -> str:
    out = []
    for op, arg in items:
        if str(op) != "LITERAL":
            break
        out.append(chr(arg))
    return "".join(out)


@dataclass(frozen=True)
class Pattern:
    text: str
    program: tuple[Instr, ...]
    literal_prefix: str  # every name it matches starts with this

    def fullmatch(self, name: str) -> bool:
        """Whether the whole of `name` matches, as `re.fullmatch` answers for the same
        pattern; in O(len(program) x len(name)) time."""
        n = len(name)
        prog = self.program
        current = self._closure([0], 0, n)
        for i, c in enumerate(name):
            nxt: list[int] = []
            for pc in current:
                if pc < len(prog) and prog[pc][1](c):  # the closure holds only "char" and the end
                    nxt.append(pc + 1)
            if not nxt:
                return False
            current = self._closure(nxt, i + 1, n)
        return len(prog) in current

    def _closure(self, starts: list[int], pos: int, n: int) -> list[int]:
        """The consuming instructions (and the end, len(program)) reachable from `starts`
        without consuming a character at position `pos`."""
        prog = self.program
        end = len(prog)
        seen: set[int] = set()
        out: list[int] = []
        stack = list(reversed(starts))
        while stack:
            pc = stack.pop()
            if pc in seen:
                continue
            seen.add(pc)
            if pc == end:
                out.append(pc)
                continue
            instr = prog[pc]
            op = instr[0]
            if op == "char":
                out.append(pc)
            elif op == "jmp":
                stack.append(instr[1])
            elif op == "split":
                stack.append(instr[2])
                stack.append(instr[1])
            elif op == "bol":
                if pos == 0:
                    stack.append(pc + 1)
            elif op == "eol" and pos == n:
                stack.append(pc + 1)
        return out


@functools.lru_cache(maxsize=1 << 16)
def compile_pattern(text: str) -> Pattern:
    """`text` as a `Pattern`; raises PatternError for what `re` refuses or this module
    cannot check in linear time. Cached: validation and the check across providers
    compile each pattern once."""
    try:
        parsed = _parser.parse(text)
    except re.error as e:
        raise PatternError(f"is not a valid regular expression: {e}") from None
    except RecursionError:
        raise PatternError("nests groups too deeply") from None
    if parsed.state.flags & ~re.UNICODE:
        raise PatternError("uses inline flags such as (?i), which model patterns do not support")
    if parsed.state.groups > 1 + 100:
        raise PatternError("has more than 100 groups")
    c = _Compiler()
    try:
        c.seq(parsed)
    except RecursionError:
        raise PatternError("nests groups too deeply") from None
    return Pattern(text, tuple(c.prog), _literal_prefix(parsed))
