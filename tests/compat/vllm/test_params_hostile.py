"""Any value in any field of the request parameters is either accepted or refused naming that
field: vLLM's ``SamplingParams``, ``PoolingParams``, ``StructuredOutputsParams`` and
``BeamSearchParams`` built from hostile values (wrong types, huge integers, NaN, lone
surrogates, nested containers) raise :class:`~dfllm.errors.InvalidRequestError` with
``parameter`` set to the field, never a bare ``TypeError`` from a comparison inside a check."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dfllm import PoolingParams, SamplingParams
from dfllm.beam_search import BeamSearchParams
from dfllm.errors import InvalidRequestError
from dfllm.structured_outputs import StructuredOutputsParams

HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.binary(max_size=3),
    st.lists(st.one_of(st.integers(-3, 70_000), st.text(max_size=2), st.none()), max_size=3),
    st.dictionaries(
        st.one_of(st.text(max_size=2), st.integers(-3, 3)), st.one_of(st.integers(), st.text(max_size=2)), max_size=2
    ),
    st.sampled_from(
        [np.int64(3), np.float32(0.5), np.array([1, 2]), "\ud800", [[1, [2]]], {"5": 1.0}, (1, 2), {1, 2}, object()]
    ),
)


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


@pytest.mark.parametrize(
    "cls, base",
    [
        (SamplingParams, {"max_tokens": 4}),
        (PoolingParams, {}),
        (StructuredOutputsParams, {"regex": "a+"}),
        (BeamSearchParams, {"beam_width": 2, "max_tokens": 4}),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_hostile_field_is_accepted_or_refused_by_name(cls, base, data):
    name = data.draw(st.sampled_from(_fields(cls)), label="field")
    value = data.draw(HOSTILE, label="value")
    try:
        cls(**{**base, name: value})
    except InvalidRequestError as exc:
        assert exc.parameter is not None, f"{cls.__name__}({name}={value!r}): refused without naming a field: {exc}"
        assert name in str(exc) or exc.parameter in str(exc), exc
    except ValueError as exc:  # a plain ValueError must still name the field
        assert name in str(exc), f"{cls.__name__}({name}={value!r}): {exc}"


def test_nan_and_huge_values_are_named():
    for kw, field in (
        ({"temperature": math.nan}, "temperature"),
        ({"min_tokens": {}}, "min_tokens"),
        ({"seed": 2**70}, "seed"),
    ):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kw)
        assert info.value.parameter == field


@pytest.mark.parametrize("cls", [SamplingParams, PoolingParams, StructuredOutputsParams, BeamSearchParams])
def test_an_array_in_any_field_is_read_as_its_list_or_refused_by_name(cls):
    """A dataframe's list column holds NumPy arrays, whose truth value raises."""
    base = {StructuredOutputsParams: {"regex": "a+"}, BeamSearchParams: {"beam_width": 2, "max_tokens": 4}}.get(cls, {})
    for name in _fields(cls):
        for value in (np.array([1, 2]), np.array([[1], [2]]), np.array(["embed"])):
            try:
                cls(**{**base, name: value})
            except ValueError as exc:
                assert name in str(exc), f"{cls.__name__}({name}={value!r}): {exc}"
    assert SamplingParams(stop_token_ids=np.array([7, 8]), max_tokens=3).stop_token_ids == [7, 8]


@pytest.mark.parametrize("keys", [{"": 0, 0: 0}, {1: "x"}, {None: 1, "json": {}}])
def test_dicts_with_keys_of_mixed_types_are_refused_by_name(keys):
    for build in (
        lambda: SamplingParams.from_dict(keys),
        lambda: SamplingParams(structured_outputs=keys),
        lambda: StructuredOutputsParams.from_dict(keys),
    ):
        with pytest.raises(ValueError, match="unknown field"):
            build()
