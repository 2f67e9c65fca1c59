"""The export's YAML text: any plain data reads back exactly, with PyYAML (YAML 1.1) as a
typical consumer, and the same data always gives the same bytes."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.export import yamltext

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), 1 << 63), _text)
_data = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_text, inner, max_size=4)),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_text, _data, max_size=5))
def test_any_data_round_trips(data: dict[str, Any]) -> None:
    text = yamltext.documents([data, data])
    assert list(yaml.safe_load_all(text)) == [data, data]
    assert text == yamltext.documents([data, data])


@pytest.mark.parametrize(
    "word",
    ["yes", "No", "on", "OFF", "y", "true", "null", "~", "1.5", "0x10", "1e3", "-", ".inf",
     "a: b", "#x", "&a", "*a", "!t", "%x", "@x", "`x", "'q'", '"q"', "", " a", "a ", "1_000",
     "12:30", "2026-12-01", "<<", "=", "?", "|", ">"],
)  # fmt: skip
def test_strings_that_look_like_something_else_are_quoted(word: str) -> None:
    assert yaml.safe_load(yamltext.document({"k": word})) == {"k": word}
    assert yamltext.scalar(word).startswith('"')


def test_plain_names_stay_plain() -> None:
    for word in ["apps/v1", "nvidia.com/gpu", "keda-add-ons-http-interceptor-proxy", "_x"]:
        assert yamltext.scalar(word) == word


def test_other_types_are_refused() -> None:
    with pytest.raises(TypeError):
        yamltext.scalar(1.5)
