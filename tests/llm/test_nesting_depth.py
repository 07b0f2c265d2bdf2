"""Request params nested past Python's recursion limit: every field of SamplingParams,
PoolingParams and StructuredOutputsParams is refused by name (a ``ValueError``) when its
containers nest deeper than ``dfllm.errors.MAX_NESTING_DEPTH``. The refusals' messages show
the value, and a value nested past Python's limit made them raise ``RecursionError``, which
failed a dataframe's whole partition instead of the row holding it."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nesting_data import DEPTHS, WRAPS, deep, far_nested, nested

from dfllm.errors import MAX_NESTING_DEPTH, nesting_depth, value_repr
from dfllm.inputs import check_conversation
from dfllm.pooling_params import PoolingParams
from dfllm.sampling_params import SamplingParams
from dfllm.structured_outputs import StructuredOutputsParams
from dfllm.tasks.write_key import canonical

SAMPLING = [f.name for f in dataclasses.fields(SamplingParams) if f.init and f.name != "structured_outputs"]
POOLING = [f.name for f in dataclasses.fields(PoolingParams)]
STRUCTURED = ["regex", "choice", "grammar", "json_object", "structural_tag", "backend", "whitespace_pattern"]

VALUES = st.builds(nested, DEPTHS, st.sampled_from(WRAPS), st.sampled_from([1, "x", 0.5, None]))


@settings(max_examples=15, deadline=None)
@given(name=st.sampled_from(SAMPLING), value=VALUES)
def test_sampling_params_field_nested_too_deep_is_refused_by_name(name, value):
    with pytest.raises(ValueError, match=f"{name} must be nested at most {MAX_NESTING_DEPTH} levels deep"):
        SamplingParams.from_dict({name: value})


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(STRUCTURED), value=VALUES)
def test_structured_outputs_field_nested_too_deep_is_refused_by_name(name, value):
    with pytest.raises(ValueError, match=f"structured_outputs.{name} must be nested at most"):
        SamplingParams(structured_outputs={name: value})


@settings(max_examples=15, deadline=None)
@given(name=st.sampled_from(POOLING), value=VALUES)
def test_pooling_params_field_nested_too_deep_is_refused_by_name(name, value):
    with pytest.raises(ValueError, match=f"{name} must be nested at most {MAX_NESTING_DEPTH} levels deep"):
        PoolingParams(**{name: value})


def test_deep_schema_beside_another_kind_is_refused_without_recursion():
    """Two kinds given, one a schema nested 5000 levels: vLLM's message lists them, the
    schema shown as "..."."""
    with pytest.raises(ValueError, match=r"multiple are specified: \{'json': '...', 'regex': 'x'\}"):
        StructuredOutputsParams(json=nested(5_000, "dict", {}), regex="x")


@given(depth=st.integers(0, MAX_NESTING_DEPTH), wrap=st.sampled_from(WRAPS))
def test_nesting_at_the_limit_is_measured_exactly(depth, wrap):
    assert nesting_depth(nested(depth, wrap, 1)) == depth
    assert nesting_depth(far_nested(wrap)) == MAX_NESTING_DEPTH + 1  # counted up to the limit only


# ---- structured outputs' JSON schemas: refused before anything walks them ---------------------------
def schema_chain(levels: int, kind: str) -> dict:
    """A schema of ``levels`` nested arrays (one dict a level) or objects (two: the schema and
    its ``properties``) around a string's schema, built without recursion."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        if kind == "array":
            schema = {"type": "array", "items": schema}
        else:
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def schema_text(levels: int, kind: str) -> str:
    """:func:`schema_chain` as JSON text, written without recursion."""
    if kind == "array":
        return '{"type": "array", "items": ' * levels + '{"type": "string"}' + "}" * levels
    return '{"type": "object", "required": ["a"], "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


@settings(max_examples=25, deadline=None)
@given(depth=DEPTHS, kind=st.sampled_from(["array", "object"]), as_text=st.booleans())
def test_a_schema_nested_past_the_limit_is_refused_before_any_key(depth, kind, as_text):
    """A schema nested 33 to 1000 levels was built (its JSON round trip read it), and the
    response cache's key of a request carrying it (``canonical``, two frames a level) then
    recursed past Python's limit and failed the dataframe's partition. The one limit refuses
    it by name first, as dict and as JSON text."""
    levels = depth if kind == "array" else depth // 2  # containers: one or two a level
    value = schema_text(levels, kind) if as_text else schema_chain(levels, kind)
    with pytest.raises(ValueError, match=f"^structured_outputs.json must be nested at most {MAX_NESTING_DEPTH} levels"):
        SamplingParams(temperature=0, structured_outputs={"json": value})


@pytest.mark.parametrize("kind", ["array", "object"])
def test_a_schema_at_the_limit_is_kept_and_keyed(kind):
    """The deepest schema of its kind within the limit is built and keyed; one level more is refused."""
    levels = next(n for n in itertools.count() if nesting_depth(schema_chain(n + 1, kind)) > MAX_NESTING_DEPTH)
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs={"json": schema_chain(levels, kind)})
    assert canonical(params)  # the response cache's key
    with pytest.raises(ValueError, match=f"^structured_outputs.json must be nested at most {MAX_NESTING_DEPTH} levels"):
        SamplingParams(temperature=0, structured_outputs={"json": schema_chain(levels + 1, kind)})


# ---- a conversation's messages --------------------------------------------------------------------------
FIELDS = ["role", "content", "name", "tool_calls", "extra"]


@settings(max_examples=30, deadline=None)
@given(field=st.sampled_from(FIELDS), depth=DEPTHS, wrap=st.sampled_from(WRAPS), at=st.integers(0, 2))
def test_a_message_field_nested_too_deep_is_refused_by_name(field, depth, wrap, at):
    """A message's field nested past the limit is refused naming the conversation, the message
    and the field (the chat template walked it: past Python's limit it failed with "maximum
    recursion depth exceeded", a role's message recursed in its repr)."""
    conv = [{"role": "user", "content": "hi"} for _ in range(3)]
    conv[at] = {**conv[at], field: deep(depth, wrap)}
    with pytest.raises(ValueError) as info:
        check_conversation(conv, "conversation 4")
    assert str(info.value) == (
        f"conversation 4, message {at}: field {field!r} must be nested at most {MAX_NESTING_DEPTH} levels deep"
    )


def test_message_fields_at_the_limit_pass():
    tool_calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    check_conversation([{"role": "user", "content": "hi", "extra": nested(MAX_NESTING_DEPTH, "dict", 1)}], "c")
    check_conversation([{"role": "assistant", "content": "", "tool_calls": tool_calls}], "c")


@settings(max_examples=20, deadline=None)
@given(depth=st.one_of(DEPTHS, st.integers(0, MAX_NESTING_DEPTH)), wrap=st.sampled_from(WRAPS))
def test_value_repr_never_recurses_past_the_limit(depth, wrap):
    value = deep(depth, wrap)
    text = value_repr(value)
    if depth > MAX_NESTING_DEPTH:
        assert text == f"a {type(value).__name__} nested more than {MAX_NESTING_DEPTH} levels deep"
    else:
        assert text == repr(value)
    assert value_repr(10**5000) == "an int that cannot be written as text"
