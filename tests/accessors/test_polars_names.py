"""Names on Polars. An expression's refusal names the expression's own column, never the frame
column it runs in (``'__dfllm_input__'``): an ``Int128`` column, which cannot go through Arrow
to pandas, is refused as ``'big' (Int128)`` in ``pl.col("big").llm.embed()``, eager or lazy,
and in either side of ``score``; the error keeps its type. An ``output_column`` that is not a
string (Polars names columns by strings) is refused by name at call time, on a DataFrame, a
LazyFrame and an expression (it raised Polars' ``KeyError``/``TypeError`` after the model ran)."""

from __future__ import annotations

import polars as pl
import pytest

import dfllm  # noqa: F401  (registers .llm)
from dfllm.accessors.frontend import SERIES_INPUT

FRAME = pl.DataFrame(
    [pl.Series("big", [2**100, None], dtype=pl.Int128), pl.Series("text", ["late parcel", "great sound"])]
)


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize(
    "expression",
    [
        lambda: pl.col("big").llm.embed(),
        lambda: pl.col("big").llm.score(pl.col("text")),
        lambda: pl.col("text").llm.score("big"),
    ],
    ids=["embed", "score-left", "score-right"],
)
def test_an_expressions_refusal_names_its_column(expression, lazy):
    frame = FRAME.lazy() if lazy else FRAME
    with pytest.raises(ValueError, match=r"column\(s\) 'big' \(Int128\) cannot go through Arrow to pandas") as info:
        out = frame.with_columns(expression().alias("out"))
        if lazy:
            out.collect()
    assert SERIES_INPUT not in str(info.value)


def test_an_expression_over_a_column_arrow_holds_runs():
    out = FRAME.with_columns(pl.col("text").llm.score(pl.lit("shipping")).alias("s"))
    assert out.schema["s"] == pl.Float64 and out["s"].null_count() == 0


@pytest.mark.parametrize("name", [5, None, b"out", ("a",)])
@pytest.mark.parametrize(
    "call",
    [
        lambda name: FRAME.llm.embed("text", output_column=name),
        lambda name: FRAME.lazy().llm.embed("text", output_column=name),
        lambda name: FRAME.with_columns(pl.col("text").llm.embed(output_column=name)),
        lambda name: FRAME.with_columns(pl.col("text").llm.score("text", output_column=name)),
    ],
    ids=["frame", "lazy", "expression", "score"],
)
def test_an_output_column_that_is_not_a_string_is_refused(call, name):
    with pytest.raises(ValueError, match=r"(embed|score): output_column must be a string .*, got "):
        call(name)
