"""One walk of a pattern's parsed tree both refuses it and compiles it: validation runs it
without building the program (made on the first match), and counts exactly the steps
the program will have."""

from __future__ import annotations

import pytest

from agent.spec.patterns import MAX_DEPTH, MAX_PROGRAM, PatternError, compile_pattern


def test_validation_builds_no_program_and_counts_its_steps_exactly() -> None:
    # A fresh Pattern, past the cache: one that a test before this matched has its program.
    p = compile_pattern.__wrapped__("(?:ab|c){2,5}d+")
    assert "program" not in vars(p)  # not made until a name is matched
    assert p.fullmatch("abcabd") and not p.fullmatch("abd")
    edge = "(?:a{64}){64}"  # exactly MAX_PROGRAM steps
    assert MAX_PROGRAM == 64 * 64
    assert len(compile_pattern(edge).program) == MAX_PROGRAM
    with pytest.raises(PatternError, match=f"more than {MAX_PROGRAM} steps"):
        compile_pattern(edge + "b")


def test_a_body_repeated_no_times_is_still_checked() -> None:
    with pytest.raises(PatternError, match="uses a look-around"):
        compile_pattern("x(?:(?=a)b){0}")


def test_groups_nested_too_deep() -> None:
    ok = "(" * MAX_DEPTH + "a" + ")" * MAX_DEPTH
    assert compile_pattern(ok).fullmatch("a")
    with pytest.raises(PatternError, match=f"nests groups more than {MAX_DEPTH} deep"):
        compile_pattern("(" + ok + ")")
