"""Request params nested past Python's recursion limit: every field of SamplingParams,
PoolingParams and StructuredOutputsParams is refused by name (a ``ValueError``) when its
containers nest deeper than ``dfllm.errors.MAX_NESTING_DEPTH``. The refusals' messages show
the value, and a value nested past Python's limit made them raise ``RecursionError``, which
failed a dataframe's whole partition instead of the row holding it."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dfllm.errors import MAX_NESTING_DEPTH, nesting_depth
from dfllm.pooling_params import PoolingParams
from dfllm.sampling_params import SamplingParams
from dfllm.structured_outputs import StructuredOutputsParams

SAMPLING = [f.name for f in dataclasses.fields(SamplingParams) if f.init and f.name != "structured_outputs"]
POOLING = [f.name for f in dataclasses.fields(PoolingParams)]
STRUCTURED = ["regex", "choice", "grammar", "json_object", "structural_tag", "backend", "whitespace_pattern"]


def nested(depth: int, wrap: str, leaf: object) -> object:
    """``leaf`` inside ``depth`` lists or dicts, built without recursion."""
    return functools.reduce(lambda x, _: [x] if wrap == "list" else {"a": x}, range(depth), leaf)


# past the limit, just under Python's recursion limit (a check at a shallow stack passes,
# code deeper in the stack recurses), and far past it
DEPTHS = st.one_of(st.integers(MAX_NESTING_DEPTH + 1, 200), st.integers(900, 1000), st.sampled_from([5_000, 100_000]))
VALUES = st.builds(nested, DEPTHS, st.sampled_from(["list", "dict"]), st.sampled_from([1, "x", 0.5, None]))


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


@given(depth=st.integers(0, MAX_NESTING_DEPTH), wrap=st.sampled_from(["list", "dict"]))
def test_nesting_at_the_limit_is_measured_exactly(depth, wrap):
    assert nesting_depth(nested(depth, wrap, 1)) == depth
    assert nesting_depth(nested(10**5, wrap, 1)) == MAX_NESTING_DEPTH + 1  # counted up to the limit only
