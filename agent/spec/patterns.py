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

`literal_prefix` gives the characters every match starts with, and `literal` some it
contains, so the check across providers tests a pattern only against the names that
have them.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.errors import ProviderdError

_parser: Any = importlib.import_module("re._parser")  # the stdlib's own parser (3.11+)

MAX_PROGRAM = 4096  # steps of a compiled pattern
MAX_DEPTH = 32  # groups, alternations and repeats inside each other
_MAXREPEAT: int = _parser.MAXREPEAT


class PatternError(ProviderdError, ValueError):
    """A pattern that cannot be checked in linear time (or at all); the message says why."""

    code = "invalid_pattern"


# Instructions: ("char", predicate) consumes one character; ("split", a, b) and
# ("jmp", a) move without consuming; ("bol",) and ("eol",) assert a position.
Instr = tuple[Any, ...]
Pred = Callable[[str], bool]


def _category(name: str) -> Pred:
    preds: dict[str, Pred] = {  # as sre's unicode categories
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


_CATEGORIES = (
    "CATEGORY_DIGIT",
    "CATEGORY_NOT_DIGIT",
    "CATEGORY_SPACE",
    "CATEGORY_NOT_SPACE",
    "CATEGORY_WORD",
    "CATEGORY_NOT_WORD",
)
_UNSUPPORTED = {
    "GROUPREF": "a back-reference",
    "GROUPREF_EXISTS": "a conditional group",
    "ASSERT": "a look-around",
    "ASSERT_NOT": "a look-around",
    "ATOMIC_GROUP": "an atomic group",
    "POSSESSIVE_REPEAT": "a possessive repeat",
}
_ANCHORS = ("AT_BEGINNING", "AT_BEGINNING_STRING", "AT_END", "AT_END_STRING")


class _Compiler:
    """Thompson's construction, and the one walk of the parsed tree: it refuses what it
    cannot compile, more than MAX_PROGRAM steps and groups nested more than MAX_DEPTH
    deep (PatternError). With `dry`, it only counts the steps: validation walks the tree
    without building the program, which is made on the first match."""

    def __init__(self, dry: bool = False) -> None:
        self.dry = dry
        self.size = 0
        self.prog: list[Instr] = []

    def emit(self, *instr: Any) -> int:
        self.size += 1
        if self.size > MAX_PROGRAM:
            raise PatternError(f"is too complex to check (more than {MAX_PROGRAM} steps)")
        if not self.dry:
            self.prog.append(tuple(instr))
        return self.size - 1

    def patch(self, at: int, *instr: Any) -> None:
        if not self.dry:
            self.prog[at] = tuple(instr)

    def seq(self, items: Any, depth: int = 0) -> None:
        if depth > MAX_DEPTH:
            raise PatternError(f"nests groups more than {MAX_DEPTH} deep")
        for op, arg in items:
            self.one(str(op), arg, depth)

    def one(self, kind: str, arg: Any, depth: int) -> None:
        if kind == "LITERAL":
            self.emit("char", chr(arg).__eq__)
        elif kind == "NOT_LITERAL":
            self.emit("char", chr(arg).__ne__)
        elif kind == "ANY":
            self.emit("char", "\n".__ne__)
        elif kind == "IN":
            _check_class(arg)
            self.emit("char", None if self.dry else _in(arg))
        elif kind == "SUBPATTERN":
            if arg[1] or arg[2]:
                raise PatternError(
                    "uses inline flags such as (?i), which model patterns do not support"
                )
            self.seq(arg[3], depth + 1)
        elif kind == "BRANCH":
            self.branch(arg[1], depth + 1)
        elif kind in ("MAX_REPEAT", "MIN_REPEAT"):
            lo, hi, body = arg
            self.repeat(lo, hi, body, depth + 1)
        elif kind == "AT":
            if str(arg) not in _ANCHORS:
                raise PatternError("uses \\b, \\B, \\A or \\Z, which model patterns do not support")
            self.emit("bol" if str(arg) in _ANCHORS[:2] else "eol")
        else:
            what = _UNSUPPORTED.get(kind, kind)
            raise PatternError(f"uses {what}, which model patterns do not support")

    def branch(self, alternatives: list[Any], depth: int) -> None:
        jumps: list[int] = []
        for i, alt in enumerate(alternatives):
            if i < len(alternatives) - 1:
                split = self.emit("split", 0, 0)
                self.seq(alt, depth)
                jumps.append(self.emit("jmp", 0))
                self.patch(split, "split", split + 1, self.size)
            else:
                self.seq(alt, depth)
        for j in jumps:
            self.patch(j, "jmp", self.size)

    def repeat(self, lo: int, hi: int, body: Any, depth: int) -> None:
        if hi == 0:  # no copy of the body: still one that could be compiled
            _Compiler(dry=True).seq(body, depth)
        for _ in range(lo):
            self.seq(body, depth)
        if hi == _MAXREPEAT:
            split = self.emit("split", 0, 0)
            self.seq(body, depth)
            self.emit("jmp", split)
            self.patch(split, "split", split + 1, self.size)
            return
        ends: list[int] = []
        for _ in range(hi - lo):
            ends.append(self.emit("split", 0, 0))
            self.seq(body, depth)
        for s in ends:
            self.patch(s, "split", s + 1, self.size)


def _check_class(items: list[tuple[Any, Any]]) -> None:
    for iop, iarg in items:
        ikind = str(iop)
        if ikind == "CATEGORY" and str(iarg) not in _CATEGORIES:
            raise PatternError(f"uses the class {iarg}, which model patterns do not support")
        if ikind not in ("NEGATE", "LITERAL", "RANGE", "CATEGORY"):
            raise PatternError(f"uses {ikind} in a class, which model patterns do not support")


def _literal_runs(items: Any) -> tuple[str, str]:
    """The literal prefix of a top-level sequence, and its longest run of literals: every
    match starts with the first and contains the second."""
    runs: list[str] = []
    run: list[str] = []
    prefix: str | None = None
    for op, arg in items:
        if str(op) == "LITERAL":
            run.append(chr(arg))
            continue
        if prefix is None:
            prefix = "".join(run)
        runs.append("".join(run))
        run = []
    runs.append("".join(run))
    if prefix is None:
        prefix = runs[0]
    return prefix, max(runs, key=len)


State = frozenset[int]
_MAX_STATES = 1 << 14  # transitions cached per pattern before the cache starts over


@dataclass(frozen=True)
class Pattern:
    """A compiled model pattern. `fullmatch` simulates the automaton, building the
    deterministic one lazily as names are matched (as RE2 does), so that matching many
    names is mostly dictionary look-ups; time stays O(len(program) x len(name))."""

    text: str
    parsed: Any = field(compare=False, repr=False)
    literal_prefix: str  # every name it matches starts with this
    literal: str  # ... and contains this (the longest literal run at the top level)
    _moves: dict[tuple[State, str], State] = field(default_factory=dict, compare=False, repr=False)
    _accepts: dict[State, bool] = field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def program(self) -> tuple[Instr, ...]:
        """The automaton, made on the first match (most patterns are never tried)."""
        c = _Compiler()
        c.seq(self.parsed)
        return tuple(c.prog)

    def fullmatch(self, name: str) -> bool:
        """Whether the whole of `name` matches, as `re.fullmatch` answers for the same
        pattern."""
        if not name:
            return len(self.program) in self._closure([0], bol=True, eol=True)
        state = self._closure([0], bol=True, eol=False)
        moves = self._moves
        for c in name:
            nxt = moves.get((state, c))
            if nxt is None:
                nxt = self._step(state, c)
                if len(moves) >= _MAX_STATES:
                    moves.clear()
                moves[(state, c)] = nxt
            if not nxt:
                return False
            state = nxt
        accepts = self._accepts.get(state)
        if accepts is None:
            accepts = len(self.program) in self._closure(list(state), bol=False, eol=True)
            if len(self._accepts) >= _MAX_STATES:
                self._accepts.clear()
            self._accepts[state] = accepts
        return accepts

    def _step(self, state: State, c: str) -> State:
        prog = self.program
        end = len(prog)
        nxt = [pc + 1 for pc in state if pc < end and prog[pc][0] == "char" and prog[pc][1](c)]
        return self._closure(nxt, bol=False, eol=False) if nxt else frozenset()

    def _closure(self, starts: list[int], *, bol: bool, eol: bool) -> State:
        """The instructions reachable from `starts` without consuming a character that
        wait for one (a "char", or an "eol" when not at the end), and the end."""
        prog = self.program
        end = len(prog)
        seen: set[int] = set()
        out: set[int] = set()
        stack = list(starts)
        while stack:
            pc = stack.pop()
            if pc in seen:
                continue
            seen.add(pc)
            if pc == end:
                out.add(pc)
                continue
            instr = prog[pc]
            op = instr[0]
            if op == "char":
                out.add(pc)
            elif op == "jmp":
                stack.append(instr[1])
            elif op == "split":
                stack += (instr[2], instr[1])
            elif op == "bol":
                if bol:
                    stack.append(pc + 1)
            elif op == "eol":
                if eol:
                    stack.append(pc + 1)
                else:
                    out.add(pc)  # may still pass at the end
        return frozenset(out)


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
    try:
        _Compiler(dry=True).seq(parsed)  # refuses what it cannot compile, builds nothing
    except RecursionError:
        raise PatternError("nests groups too deeply") from None
    prefix, literal = _literal_runs(parsed)
    return Pattern(text, parsed, prefix, literal)


def nested_repetition(pattern: Pattern | str) -> bool:
    """A repetition inside a repetition (`(a+)+`, `(x*y?)*`): the shape whose backtracking
    grows exponentially with the subject's length in a backtracking matcher (`re`); the
    router leaves such patterns out, as docs/router.md says."""
    if isinstance(pattern, str):
        try:
            pattern = compile_pattern(pattern)
        except PatternError:
            return False
    repeats = (_parser.MAX_REPEAT, _parser.MIN_REPEAT)

    def walk(items: Any, inside: bool) -> bool:
        for op, arg in items:
            if op in repeats:
                low, high, sub = arg
                varies = high is _MAXREPEAT or high != low
                if varies and inside:
                    return True
                if walk(sub, inside or high is _MAXREPEAT or high > 1):
                    return True
            elif (op == _parser.SUBPATTERN and walk(arg[-1], inside)) or (
                op == _parser.BRANCH and any(walk(b, inside) for b in arg[1])
            ):
                return True
        return False

    return walk(pattern.parsed, False)
