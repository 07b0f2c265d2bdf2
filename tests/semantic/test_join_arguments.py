"""``join``'s and ``sim_join``'s arguments of any value are taken or refused by name, at call time.

``suffix`` must be a string (``None`` made ``topicNone``); ``min_similarity`` a real number in
[-1, 1] (a NumPy ``float32`` too; ``True`` is not 1); ``sampling_params`` a
:class:`dfllm.SamplingParams` (each of its fields, as a dict of the same fields would set
them) or a dict, anything else refused naming it (a SamplingParams was refused over the
fields it derives, a string raised Python's "must be called with a dataclass"). A column of
either frame named as the join's own working columns is refused by name (it was dropped
from the result, or crashed the join), and so, for a Polars frame (whose result names its
columns by strings), is a pandas ``other``'s column whose name is another's as text (``0``
beside ``"0"``: Polars' ``DuplicateError`` once every pair had been judged).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import polars as pl
import pytest
from semantic_data import ENGINE

import dfllm

LEFT = pd.DataFrame({"review": ["late parcel", "great sound"]})
RIGHT = pd.DataFrame({"topic": ["shipping", "sound"]})
STATEMENT = "{review} is about {topic}"
WORKING_COLUMNS = ["__dfllm_embedding__", "__dfllm_error__"]


@pytest.mark.parametrize("name", WORKING_COLUMNS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_column_named_as_the_joins_own_is_refused(tiny_judge, name, side):
    left = LEFT.assign(**{name: [1, 2]}) if side == "left" else LEFT
    right = RIGHT.assign(**{name: [1, 2]}) if side == "right" else RIGHT
    where = "the frame" if side == "left" else "other"
    message = f"{where} has a column named '{name}', a name the join uses itself"
    for call in (
        lambda: left.llm.sim_join(right, "review", "topic", 1),
        lambda: pl.from_pandas(left).lazy().llm.sim_join(pl.from_pandas(right), "review", "topic", 1),
        lambda: left.llm.join(right, STATEMENT, model=str(tiny_judge), block_k=1, **ENGINE),
    ):
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.parametrize("suffix", [None, 3, b"_r", ("_r",)])
def test_a_suffix_that_is_not_a_string_is_refused(suffix):
    with pytest.raises(ValueError, match=r"sim_join: suffix must be a string, got "):
        LEFT.llm.sim_join(RIGHT.rename(columns={"topic": "review"}), "review", "review", 1, suffix=suffix)


def test_an_empty_suffix_is_fine_where_no_name_clashes():
    out = LEFT.llm.sim_join(RIGHT, "review", "topic", 1, suffix="")
    assert list(out.columns) == ["review", "topic", "similarity", "llm_error"]


@pytest.mark.parametrize("bound", [True, np.bool_(False), "0.5", float("nan"), 1.5])
def test_min_similarity_must_be_a_real_number_in_range(bound):
    with pytest.raises(ValueError, match="min_similarity must be a number in"):
        LEFT.llm.sim_join(RIGHT, "review", "topic", 1, min_similarity=bound)


def test_min_similarity_of_any_real_type():
    want = LEFT.llm.sim_join(RIGHT, "review", "topic", 2, min_similarity=0.25)
    for bound in (np.float32(0.25), np.float64(0.25), np.float16(0.25)):
        got = LEFT.llm.sim_join(RIGHT, "review", "topic", 2, min_similarity=bound)
        pd.testing.assert_frame_equal(got, want)


def test_join_takes_sampling_params_as_an_object_or_a_dict(tiny_judge):
    kw = dict(model=str(tiny_judge), **ENGINE)
    as_dict = LEFT.llm.join(RIGHT, STATEMENT, sampling_params={"temperature": 0.0, "max_tokens": 6}, **kw)
    as_object = LEFT.llm.join(
        RIGHT, STATEMENT, sampling_params=dfllm.SamplingParams(temperature=0.0, max_tokens=6), **kw
    )
    pd.testing.assert_frame_equal(as_object, as_dict)
    # the object's fields are checked as the dict's are
    with pytest.raises(ValueError, match=r"join: .*n"):
        LEFT.llm.join(RIGHT, STATEMENT, sampling_params=dfllm.SamplingParams(n=2, temperature=0.5), **kw)


@pytest.mark.parametrize("params", ["greedy", 5, [("max_tokens", 3)]])
def test_join_refuses_sampling_params_of_another_type(tiny_judge, params):
    with pytest.raises(ValueError, match="join: sampling_params must be a dfllm.SamplingParams or a dict"):
        LEFT.llm.join(RIGHT, STATEMENT, model=str(tiny_judge), sampling_params=params, **ENGINE)


HUGE = 10**5000  # past Python's 4300-digit limit for str and repr


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: LEFT.llm.sim_join(RIGHT, "review", "topic", -HUGE), "sim_join: k must be a positive integer, got "),
        (lambda: LEFT.llm.sim_join(RIGHT, HUGE, "topic", 1), "sim_join: left_on .* is not a column of the frame"),
        (lambda: LEFT.llm.sim_join(RIGHT, "review", HUGE, 1), "sim_join: right_on .* is not a column of other"),
        (lambda: LEFT.llm.sim_join(RIGHT, "review", "topic", 1, suffix=HUGE), "sim_join: suffix must be a string"),
        (lambda: LEFT.llm.sim_join(RIGHT, "review", "topic", 1, min_similarity=HUGE), "min_similarity must be"),
        (lambda: LEFT.llm.sim_join(RIGHT, "review", "topic", 1, similarity_column=HUGE), "similarity_column must"),
        (lambda: LEFT.llm.sim_join(RIGHT, "review", "topic", 1, left_images=HUGE), "left_images must be True or"),
        (lambda: LEFT.llm.dedup(HUGE), "dedup: column .* is not in the frame"),
        (lambda: LEFT.llm.dedup("review", threshold=HUGE), "dedup: threshold must be"),
        (lambda: LEFT.llm.topk("{review} is best", -HUGE), "topk: k must be a positive integer"),
    ],
)
def test_an_argument_too_long_to_write_is_refused_by_name(call, message):
    """The refusal names the argument and writes its value as dfllm.errors.value_repr does,
    never Python's 'Exceeds the limit (4300 digits)' from writing it."""
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "4300" not in str(info.value)


@pytest.mark.parametrize(("column", "side"), [("c.d", "left"), ("e[0]", "right")])
def test_a_field_naming_a_column_with_a_dot_or_bracket_is_refused_by_its_name(tiny_judge, column, side):
    left = LEFT.assign(**{column: ["x", "y"]}) if side == "left" else LEFT
    right = RIGHT.assign(**{column: ["x", "y"]}) if side == "right" else RIGHT
    statement = f"{{review}} is {{{column}}} and {{topic}}"
    with pytest.raises(ValueError, match=rf"join: the instruction's field .* names the {side} column '{column[0]}"):
        left.llm.join(right, statement, model=str(tiny_judge), **ENGINE)


@pytest.mark.parametrize(
    ("left_extra", "right_extra"), [({}, {0: ["a", "b"], "0": ["c", "d"]}), ({"1.0": [1, 2]}, {1.0: ["a", "b"]})]
)
def test_a_polars_result_refuses_names_that_are_the_same_as_text(left_extra, right_extra):
    left = pl.from_pandas(LEFT.assign(**left_extra))
    right = pd.concat([RIGHT, pd.DataFrame(right_extra)], axis=1)
    for frame in (left, left.lazy()):
        with pytest.raises(ValueError, match=r"sim_join: a Polars result names its columns by strings, and \['"):
            frame.llm.sim_join(right, "review", "topic", 1)
    out = LEFT.assign(**left_extra).llm.sim_join(right, "review", "topic", 1)  # pandas holds them apart
    assert len(out.columns) == len(LEFT.columns) + len(left_extra) + len(right.columns) + 2
