"""``.llm`` on Polars DataFrames, LazyFrames and expressions (Polars' namespace API).

Frames go through Arrow to pandas (zero-copy where Arrow allows), run in this process,
and come back as Polars; a LazyFrame maps its batches lazily with the output schema known
up front; ``pl.col("q").llm.generate(...)`` gives the main output inside ``with_columns``
(``pl.col("a").llm.score(pl.col("b"))`` scores two expressions row by row, as pandas' and
Dask's ``series.llm.score(other)`` do).

:func:`register` puts ``.llm`` there; ``import dfllm`` arranges for that on the first ``.llm``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pandas as pd
import polars as pl
import pyarrow as pa

from dfllm.accessors.adapter import polars_to_pandas
from dfllm.accessors.frontend import SERIES_INPUT, LLMFrameMethods
from dfllm.errors import shown, value_repr
from dfllm.tasks.kinds import KINDS, LOGPROB_MAP
from dfllm.tasks.runners import run_task
from dfllm.tasks.task import LLMTask, make_task

POLARS_TYPES: dict[str, Any] = {
    "string": pl.String,
    "int64": pl.Int64,
    "double": pl.Float64,
    "list<item: float>": pl.List(pl.Float32),
}
#: The Arrow types of the engine columns that pandas holds as Python objects (per token a dict
#: token id -> its Logprob's fields): a Polars list of maps.
OBJECT_COLUMNS = {
    "logprobs": pd.ArrowDtype(pa.list_(LOGPROB_MAP)),
    "prompt_logprobs": pd.ArrowDtype(pa.list_(LOGPROB_MAP)),
}


def _run(df: pl.DataFrame, task: LLMTask) -> pl.DataFrame:
    """``df`` with the task's output columns. Only the columns the task reads go to pandas;
    every other column stays as it is, untouched (its exact dtype: an Enum, an Int128, an
    Object column...), and the output columns get the types :func:`_polars_schema` declares."""
    needed = task.columns_needed()
    inputs = df.select([c for c in df.columns if c in needed]) if needed else df.select([])
    if not inputs.width:  # no column read (cannot happen for a checked task): keep the row count
        inputs = pl.DataFrame({"__dfllm_row__": pl.zeros(df.height, eager=True)})
    result = run_task(polars_to_pandas(inputs), task, progress=True)
    outputs = result[list(task.output_dtypes())]
    objects = {c: OBJECT_COLUMNS[c] for c in task.engine_columns if c in OBJECT_COLUMNS}
    out = pl.from_pandas(outputs.astype(objects) if objects else outputs)
    schema = _polars_schema(task)
    differ = {c: t for c, t in schema.items() if out.schema[c] != t}
    if differ:  # a choice column: pandas category -> Enum of the choices; an all-null column...
        out = out.cast(differ)
    return df.hstack(out)


def _polars_dtype(dtype, column: str = "") -> pl.DataType:
    """The Polars type of an output column's pandas dtype (structs and lists included)."""
    if isinstance(dtype, pd.CategoricalDtype):
        return pl.Enum(list(dtype.categories))
    if not isinstance(dtype, pd.ArrowDtype):  # a column of Python objects
        dtype = OBJECT_COLUMNS[column]
    name = str(dtype.pyarrow_dtype)
    if name in POLARS_TYPES:
        return POLARS_TYPES[name]
    return pl.Series(pa.array([], type=dtype.pyarrow_dtype)).dtype


def _check_output_column(kind: str, output_column: object) -> None:
    """``ValueError`` for an ``output_column`` that is not a string (a Polars column's name is one):
    ``output_column=5`` raised Polars' ``KeyError`` or ``TypeError`` once the task had run."""
    if not isinstance(output_column, str):
        raise ValueError(
            f"{kind}: output_column must be a string (Polars names columns by strings), got {shown(output_column)}"
        )


def _polars_schema(task: LLMTask) -> dict:
    return {c: _polars_dtype(d, c) for c, d in task.output_dtypes().items()}


class PolarsLLMNamespace(LLMFrameMethods):
    def _apply(self, task: LLMTask, resources: dict | None = None) -> pl.DataFrame:
        _check_output_column(task.kind, task.output_column)
        return _run(self._obj, task)


class PolarsLazyLLMNamespace(LLMFrameMethods):
    def _apply(self, task: LLMTask, resources: dict | None = None) -> pl.LazyFrame:
        _check_output_column(task.kind, task.output_column)
        schema = {**self._obj.collect_schema(), **_polars_schema(task)}
        return self._obj.map_batches(lambda df: _run(df, task), schema=schema)


class PolarsExprLLMNamespace:
    """``pl.col(...).llm.<method>(...)``: the main output of each method, for ``with_columns``."""

    def __init__(self, expr: pl.Expr):
        self._expr = expr

    def _map(self, kind: str, output_column: str, **kwargs) -> pl.Expr:
        _check_output_column(kind, output_column)

        def apply(series: pl.Series) -> pl.Series:
            frame = series.to_frame(SERIES_INPUT)
            with _named({SERIES_INPUT: series.name}):
                result = getattr(PolarsLLMNamespace(frame), kind)(SERIES_INPUT, output_column=output_column, **kwargs)
            return result[output_column]

        probe = _probe_task(kind, output_column, kwargs.get("json_schema"), kwargs.get("choice"))
        return self._expr.map_batches(apply, return_dtype=_polars_schema(probe)[output_column])

    def generate(self, *, output_column: str = KINDS["generate"].output_column, **kwargs) -> pl.Expr:
        return self._map("generate", output_column, **kwargs)

    def chat(self, *, output_column: str = KINDS["chat"].output_column, **kwargs) -> pl.Expr:
        return self._map("chat", output_column, **kwargs)

    def embed(self, *, output_column: str = KINDS["embed"].output_column, **kwargs) -> pl.Expr:
        return self._map("embed", output_column, **kwargs)

    def classify(self, *, output_column: str = KINDS["classify"].output_column, **kwargs) -> pl.Expr:
        return self._map("classify", output_column, **kwargs)

    def score(self, other: pl.Expr | str, *, output_column: str = KINDS["score"].output_column, **kwargs) -> pl.Expr:
        """Scores of this expression's texts against ``other``'s, row by row: an expression (or a
        column name) of the same length, or of length 1 (``pl.lit("query")``: one text against
        every row). A Float64 expression named after this one; a null input gives a null score.
        Keyword arguments are those of ``DataFrame.llm.score`` (``model``, engine arguments...)."""
        _check_output_column("score", output_column)
        right = pl.col(other) if isinstance(other, str) else other
        if not isinstance(right, pl.Expr):
            raise TypeError(f"score: other must be a Polars expression or a column name, got {type(other).__name__}")
        second = SERIES_INPUT + "2"

        def apply(columns: Sequence[pl.Series]) -> pl.Series:
            left, texts = columns
            if len(texts) == 1 and len(left) != 1:  # one text against every row
                texts = pl.repeat(texts[0], len(left), dtype=texts.dtype, eager=True)
            frame = pl.DataFrame({SERIES_INPUT: left, second: texts})
            with _named({SERIES_INPUT: left.name, second: texts.name}):
                result = PolarsLLMNamespace(frame).score(SERIES_INPUT, second, output_column=output_column, **kwargs)
            return result[output_column]

        probe = LLMTask("score", (SERIES_INPUT, second), output_column)
        return pl.map_batches([self._expr, right], apply, return_dtype=_polars_schema(probe)[output_column])


@contextmanager
def _named(names: dict[str, str]) -> Iterator[None]:
    """Inside this block, a ``ValueError`` (a column Arrow cannot hold, a refused argument) that
    names an expression's input by the frame column it runs in (``'__dfllm_input__'``) names it
    by the expression's own name (``'text'``) instead; its type and fields are kept."""
    try:
        yield
    except ValueError as exc:
        message = str(exc)
        for internal, name in names.items():
            message = message.replace(repr(internal), value_repr(name))
        if message == str(exc):
            raise
        renamed = copy.copy(exc)
        renamed.args = (message,)
        raise renamed from None


def _probe_task(kind: str, output_column: str, json_schema=None, choice=None) -> LLMTask:
    return (
        make_task(
            kind, (SERIES_INPUT,), [SERIES_INPUT], output_column=output_column, json_schema=json_schema, choice=choice
        )
        if json_schema is not None or choice is not None
        else LLMTask(kind, (SERIES_INPUT,), output_column)
    )


def register() -> None:
    """Registers ``.llm`` on Polars' DataFrame, LazyFrame and Expr."""
    pl.api.register_dataframe_namespace("llm")(PolarsLLMNamespace)
    pl.api.register_lazyframe_namespace("llm")(PolarsLazyLLMNamespace)
    pl.api.register_expr_namespace("llm")(PolarsExprLLMNamespace)
