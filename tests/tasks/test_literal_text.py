"""``literal_text``: a cell's text read as a list or dict (conversations, token ids, per-row
sampling params) is that value or a ``ValueError`` for its row, whatever the text holds:
never another exception, which would fail the whole partition."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dfllm.tasks.rows import literal_text

NESTINGS = [("[", "]"), ("{", "}"), ('{"a": ', "}"), ("(", ")"), ("[1, ", "]"), ("-", "")]


@settings(max_examples=60, deadline=None)
@given(
    nesting=st.sampled_from(NESTINGS),
    depth=st.one_of(st.integers(0, 50), st.integers(900, 1100), st.just(100_000)),
    core=st.sampled_from(["", "1", '"x"', "[]", "{}", "None", "\ud800"]),
    kind=st.sampled_from([(list, "a list of messages"), (dict, "a dict of SamplingParams fields")]),
)
def test_any_text_is_a_value_or_its_rows_error(nesting, depth, core, kind):
    opening, closing = nesting
    text = opening * depth + core + closing * depth
    try:
        value = literal_text(text, *kind)
    except ValueError as exc:
        assert str(exc).startswith("a string ")
    else:
        assert isinstance(value, kind[0])


@pytest.mark.parametrize("opening,closing", [("[", "]"), ('{"a": ', "}")])
def test_json_nested_past_pythons_limit_says_so(opening, closing):
    with pytest.raises(ValueError, match="^a string nested too deeply to read as a list of messages$"):
        literal_text(opening * 100_000 + "1" + closing * 100_000, list, "a list of messages")
