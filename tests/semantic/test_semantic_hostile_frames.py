"""Frames that earlier steps or their users made awkward reach every semantic operator as
normal input: an ``llm_error`` column of any type an earlier step can leave (all null as a
Polars ``Null`` column or a parquet column of nulls reads, numbers, bytes, lists, text with a
lone surrogate) keeps each row's earlier message in front of the new one and crashes
nothing; an output column named ``llm_error`` is refused (it would be overwritten); columns
named twice are refused by name; a pandas column ``0`` is not the field ``"0"``; a format
spec a row's value does not fit is that row's error.
"""

from __future__ import annotations

import pandas as pd
import polars as pl
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from semantic_data import ENGINE, INSTRUCTION, reviews

import dfllm
from dfllm.errors import value_text
from dfllm.semantic.frames import earlier_errors

pytestmark = pytest.mark.timeout(600)

# an earlier llm_error value of each kind a column can hold, and None (no earlier error)
EARLIER = st.sampled_from([None, "an earlier failure", "\ud800 lone", b"\xff\xfe", 7, 2.5, ["x"], {"a": 1}, 10**5000])


def earlier_column(values: list) -> pd.Series:
    return pd.Series(values, dtype=object)


@settings(max_examples=30, deadline=None)
@given(st.lists(EARLIER, min_size=1, max_size=8))
def test_earlier_errors_are_text_whatever_their_column_holds(values):
    got = earlier_errors(earlier_column(values))
    assert [g is None for g in got] == [v is None for v in values]
    for g, v in zip(got, values):
        if g is not None:
            assert g == value_text(v)
            g.encode("utf-8")  # a string column can hold it


def _operators(model: str):
    sp = dfllm.SamplingParams(temperature=0, max_tokens=4)
    return {
        "judge": lambda df: df.llm.judge(INSTRUCTION, model=model, **ENGINE),
        "filter": lambda df: df.llm.filter(INSTRUCTION, model=model, **ENGINE),
        "extract": lambda df: df.llm.extract("{review}", {"topic": "str"}, model=model, sampling_params=sp, **ENGINE),
        "dedup": lambda df: df.llm.dedup("review", threshold=0.99),
    }


@pytest.mark.parametrize("op", ["judge", "filter", "extract", "dedup"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(earlier=st.lists(EARLIER, min_size=4, max_size=4))
def test_an_earlier_llm_error_of_any_type_is_kept_in_front(tiny_judge, op, earlier):
    df = reviews(4).assign(llm_error=earlier_column(earlier))
    out = _operators(str(tiny_judge))[op](df)
    kept = out.set_index("id")["llm_error"]
    if op != "filter":  # filter keeps the rows it passes and every row with an error
        assert sorted(out["id"]) == list(range(4))
    for i, v in enumerate(earlier):
        if v is not None:
            assert i in kept.index  # an error row is never filtered away
            assert kept[i].startswith(value_text(v)), (kept[i], v)


@pytest.mark.parametrize("dtype", ["null", "polars-null"])
def test_an_all_null_llm_error_column_as_earlier_steps_leave_it(tiny_judge, dtype):
    """Every row of the earlier step succeeded: its error column is all null, typed as Arrow's
    null (a parquet column of nulls) or as Polars' ``Null``."""
    base = reviews(3)
    if dtype == "null":
        df = base.assign(llm_error=pd.Series([None] * 3, dtype=pd.ArrowDtype(pa.null())))
        out = df.llm.judge(INSTRUCTION, model=str(tiny_judge), **ENGINE)
        assert out["llm_error"].isna().all() and out["verdict"].notna().all()
    else:
        df = pl.from_pandas(base).with_columns(pl.lit(None).alias("llm_error"))
        assert df.schema["llm_error"] == pl.Null
        out = df.llm.judge(INSTRUCTION, model=str(tiny_judge), **ENGINE)
        assert out["llm_error"].null_count() == 3 and out["verdict"].null_count() == 0


def test_an_output_column_named_llm_error_is_refused(tiny_judge):
    df = reviews(2)
    model = str(tiny_judge)
    calls = {
        "judge output_column": lambda: df.llm.judge(INSTRUCTION, model=model, output_column="llm_error"),
        "judge probability_column": lambda: df.llm.judge(INSTRUCTION, model=model, probability_column="llm_error"),
        "filter explanation_column": lambda: df.llm.filter(
            INSTRUCTION, model=model, return_explanations=True, explanation_column="llm_error"
        ),
        "dedup cluster_column": lambda: df.llm.dedup("review", cluster_column="llm_error"),
        "dedup representative_column": lambda: df.llm.dedup("review", representative_column="llm_error"),
        "extract output_column": lambda: df.llm.extract(
            "{review}", {"topic": "str"}, model=model, output_column="llm_error", expand=False
        ),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="cannot be named 'llm_error'"):
            call()
            pytest.fail(name)


def test_columns_named_twice_are_refused_by_name(tiny_judge):
    dup = pd.DataFrame([["a text", "b"], ["c text", "d"]], columns=["review", "review"])
    topics = pd.DataFrame({"topic": ["shipping", "price"]})
    model = str(tiny_judge)
    for call in (
        lambda: dup.llm.judge(INSTRUCTION, model=model, **ENGINE),
        lambda: dup.llm.generate("{review}", model=model, **ENGINE),
        lambda: dup.llm.dedup("review"),
        lambda: dup.llm.join(topics, "{review} is about {topic}", model=model, **ENGINE),
        lambda: dup.llm.sim_join(topics, "review", "topic", k=1),
    ):
        with pytest.raises(ValueError, match=r"more than one column named \['review'\]"):
            call()


def test_a_pandas_column_0_is_not_the_field_0_and_passes_through(tiny_judge):
    df = pd.DataFrame({0: ["x", "y"], "review": ["good one", "bad one"]})
    topics = pd.DataFrame({0: [5, 6], "topic": ["shipping", "price"]})
    with pytest.raises(ValueError, match="column '0' is not in the frame"):
        df.llm.dedup("0")
    with pytest.raises(ValueError, match="left_on '0' is not a column"):
        df.llm.sim_join(topics, "0", "topic", k=1)
    out = df.llm.sim_join(topics, "review", "topic", k=1)  # column 0 on both sides: suffixed, kept
    assert list(out.columns[:3]) == [0, "review", "0_right"] and out["llm_error"].isna().all()
    out = df.llm.dedup("review", threshold=0.99)
    assert out[0].tolist() == ["x", "y"]


@pytest.mark.parametrize(
    ("template", "frame"),
    [
        ("{x:c}", pd.DataFrame({"x": pd.Series([65, 0x110000, 2**70], dtype=object)})),
        ("{x:.2f}", pd.DataFrame({"x": pd.Series([1, 10**400], dtype=object)})),
        ("{x:c}", pl.DataFrame({"x": [65, 0x110000]})),
        ("{x:>{w}}", pd.DataFrame({"x": ["a", "b"], "w": [3, 10**14]})),  # a width no memory holds
    ],
)
def test_a_format_spec_a_value_does_not_fit_is_that_rows_error(tiny_judge, template, frame):
    sp = dfllm.SamplingParams(temperature=0, max_tokens=2)
    out = frame.llm.generate(template, model=str(tiny_judge), sampling_params=sp, **ENGINE)
    errors = list(out["llm_error"]) if isinstance(out, pd.DataFrame) else out["llm_error"].to_list()
    assert errors[0] is None or pd.isna(errors[0])
    assert all(e.startswith(f"template {template!r}: ") for e in errors[1:]), errors
