"""``build_processor`` on hostile values, wherever they are: every input row comes out
exactly once, a hostile row's error names its field, the other rows keep their outputs.

- A value of any type (a dict, a list, invalid UTF-8 bytes, a lone surrogate...) in the
  error column postprocess returns is that row's error, as text; with
  ``should_continue_on_error=False`` a :class:`RowFailedError` naming the row.
- A lone surrogate (or any non-text value) in the ``prompt`` preprocess returns is that row's
  error naming ``prompt``; a key postprocess returns with no UTF-8 form is that row's error.
- A postprocess value with no Arrow type (a lone surrogate, ``2**70``, a list of an int and
  a dict) is that row's error naming its column, in row 0 as in any other, on pandas and in
  Dask's sampled head; it does not decide the column's type.
- An input with a repeated column name is refused at the call, naming the column.
"""

from __future__ import annotations

import math
import pickle

import dask
import dask.dataframe as dd
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dfllm
from dfllm.accessors.arrow_schema import STRING, infer_dtype, typed_column
from dfllm.errors import value_text
from dfllm.jobs.processor import RowFailedError

SP = dict(temperature=0.0, max_tokens=1, ignore_eos=True)
ENGINE = {"max_model_len": 64, "kv_cache_memory_bytes": 2**22}
BOM = "\ufeffhi"
SURROGATE_KEY = "\udc80k"
#: name -> a hostile value; the kind of value (as the output's type inference counts it)
HOSTILE = {
    "surrogate": ("\udc80", "string"),
    "bad_utf8": (b"\xff\xfe", "binary"),
    "dict": ({"a": 1}, "struct"),
    "list": ([1, "x"], "list"),
    "nested": ({"a": [1, {"b": None}]}, "struct"),
    "huge": (2**70, None),  # no Arrow type: counts for nothing
    "nan": (math.nan, "null"),
    "none": (None, "null"),
    "empty": ("", "string"),
    "bom": (BOM, "string"),
}
#: values with no Arrow type (or none a string column holds): always their row's error
UNTYPABLE = {"surrogate", "huge", "nested"}
NULL = {"nan", "none"}
WHERE = ("good", "prompt", "s", "error", "key")

rows_strategy = st.lists(st.tuples(st.sampled_from(WHERE), st.sampled_from(sorted(HOSTILE))), min_size=1, max_size=6)


@pytest.fixture(scope="module")
def config(tiny_llama):
    return dfllm.ProcessorConfig(model_source=str(tiny_llama), engine_kwargs=ENGINE, batch_size=4)


def hostile_processor(config, plan: list[tuple[str, str]]):
    """Row ``i`` gets ``HOSTILE[plan[i][1]]`` where ``plan[i][0]`` says: in the prompt, in
    postprocess's column ``s``, as postprocess's error value, or as a key postprocess returns
    (a lone surrogate's); ``good`` rows get none."""
    err = config.error_column or "llm_error"

    def pre(row):
        where, name = plan[row["id"]]
        return dict(prompt=HOSTILE[name][0] if where == "prompt" else f"item {row['id']}", sampling_params=SP)

    def post(row):
        where, name = plan[row["id"]]
        value = HOSTILE[name][0]
        out = {"id": row["id"], "s": value if where == "s" else "ok", err: value if where == "error" else None}
        if where == "key":
            out[SURROGATE_KEY] = 1
        return out

    return dfllm.build_processor(config, preprocess=pre, postprocess=post)


def string_wins(plan: list[tuple[str, str]]) -> bool:
    """Whether the text values of ``s`` outnumber those of every other kind (the column is then text)."""
    kinds: dict[str, int] = {}
    for where, name in plan:
        if where == "prompt" and name != "bom":
            continue  # an error row: postprocess does not run
        kind = HOSTILE[name][1] if where == "s" else "string"
        if kind not in (None, "null"):
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds.get("string", 0) > max((n for k, n in kinds.items() if k != "string"), default=0)


def check(out: pd.DataFrame, plan: list[tuple[str, str]], sampled: int | None = None) -> None:
    """Every row exactly once, in its place; each hostile row's error names its field; good
    rows' outputs (``sampled``: the number of first rows the types came from, else all)."""
    n = len(plan)
    assert out.index.tolist() == list(range(n))
    assert out["id"].tolist() == list(range(n))
    if all(where == "prompt" and name != "bom" for where, name in plan[:sampled]):
        assert "s" not in out  # no row got through postprocess: the input's columns only
    text = "s" in out and out.dtypes["s"] == STRING
    if string_wins(plan[:sampled]):
        assert text, out.dtypes
    for i, (where, name) in enumerate(plan):
        value = HOSTILE[name][0]
        error, s = out["llm_error"].iloc[i], out["s"].iloc[i] if "s" in out else pd.NA
        error = None if pd.isna(error) else error
        if where == "prompt" and name != "bom":
            assert error is not None and "'prompt'" in error, (i, name, error)
        elif where == "s" and (name in UNTYPABLE or (text and HOSTILE[name][1] not in ("string", "null"))):
            assert error is not None and "'s'" in error and pd.isna(s), (i, name, error)
        elif where == "s" and name in NULL:
            assert error is None and pd.isna(s)
        elif where == "s" and text:
            assert error is None and s == value, (i, name, error)
        elif where == "error" and name not in NULL:
            assert error is not None and error.startswith(value_text(value)), (i, name, error)
            if text:
                assert error == value_text(value) and s == "ok"
        elif where == "key":
            assert error is not None and "postprocess returned column(s)" in error and "\\udc80k" in error
        elif text:  # a good row (a BOM prompt, a null error value)
            assert error is None and s == "ok", (i, name, error)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=rows_strategy)
def test_hostile_values_pandas_every_row_once(config, plan):
    df = pd.DataFrame({"id": range(len(plan))})
    check(hostile_processor(config, plan)(df), plan)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=rows_strategy)
def test_hostile_values_dask_every_row_once(config, plan):
    """The same on Dask (the output's types come from the first partition's rows)."""
    ddf = dd.from_pandas(pd.DataFrame({"id": range(len(plan))}), npartitions=2)
    first = ddf.get_partition(0).index.compute().tolist()
    with dask.config.set(scheduler="synchronous"):
        if all(plan[i][0] == "prompt" and plan[i][1] != "bom" for i in first):
            with pytest.raises(ValueError, match="none of the .* sampled rows"):
                hostile_processor(config, plan)(ddf)  # no row to take the columns from: the documented refusal
            return
        lazy = hostile_processor(config, plan)(ddf)
        out = lazy.compute().sort_index()
    assert lazy._meta.dtypes.to_dict() == out.dtypes.to_dict()
    check(out, plan, sampled=len(first))


@pytest.mark.slow
@pytest.mark.parametrize("bad_row", [0, 1, 2])
@pytest.mark.parametrize("value", [{"a": 1}, [1], b"\xff", "\udc80", 5], ids=["dict", "list", "bytes", "surr", "int"])
def test_error_value_of_any_type_fails_its_row(config, bad_row, value):
    """A non-text error value is that row's error (as text), whichever mode."""
    df = pd.DataFrame({"id": range(3)})
    pre = lambda r: dict(prompt="x", sampling_params=SP)  # noqa: E731
    for continue_on_error, column in ((None, "llm_error"), (True, "__inference_error__")):
        cfg = dfllm.ProcessorConfig(
            model_source=config.model_source, engine_kwargs=ENGINE, should_continue_on_error=continue_on_error
        )
        post = lambda r, c=column: {"id": r["id"], c: value if r["id"] == bad_row else None}  # noqa: E731
        out = dfllm.build_processor(cfg, preprocess=pre, postprocess=post)(df)
        assert out["id"].tolist() == [0, 1, 2]
        assert out[column].isna().tolist() == [i != bad_row for i in range(3)]
        assert out[column].iloc[bad_row] == value_text(value)
    # False: no error column in the output; the rows run with llm_error (as an incoming one is read)
    cfg = dfllm.ProcessorConfig(model_source=config.model_source, engine_kwargs=ENGINE, should_continue_on_error=False)
    post = lambda r: {"id": r["id"], "llm_error": value if r["id"] == bad_row else None}  # noqa: E731
    with pytest.raises(RowFailedError) as info:
        dfllm.build_processor(cfg, preprocess=pre, postprocess=post)(df)
    assert info.value.row == bad_row and info.value.error == value_text(value)


def test_a_failed_row_is_named_by_its_label_once_and_a_repeated_label_by_its_position(config):
    """The error named the row twice ("row 13 failed: row 13: column 'prompt' is null"), and
    by a label alone where the partition has more than one row of it (frames concatenated
    from others each indexed from 0): its position in the partition then tells which."""
    strict = dfllm.ProcessorConfig(
        model_source=config.model_source, engine_kwargs=ENGINE, should_continue_on_error=False
    )
    processor = dfllm.build_processor(strict, preprocess=lambda r: dict(prompt=r["q"], sampling_params=SP))
    df = pd.DataFrame({"q": ["a", "b", "c", None]}, index=[10, 11, 12, 13])
    for index, label, position in (([10, 11, 12, 13], 13, None), ([0, 1, 0, 1], 1, 3)):
        with pytest.raises(RowFailedError) as info:
            processor(df.set_axis(index))
        error = pickle.loads(pickle.dumps(info.value))  # as Dask brings it back from a worker
        assert (error.row, error.position) == (label, position)
        assert str(error).count(f"row {label}") == 1 and "column 'prompt' is null" in str(error)
        where = "" if position is None else f" (position {position} in its partition"
        assert str(error).startswith(f"build_processor: row {label}{where}")


def test_a_multiindex_label_is_named_by_its_python_values(config):
    """A MultiIndex row's label was named with numpy's reprs, ``('x', np.int64(2))``, beside
    the engine's ``('x', 2)`` for the same row."""
    strict = dfllm.ProcessorConfig(
        model_source=config.model_source, engine_kwargs=ENGINE, should_continue_on_error=False
    )
    processor = dfllm.build_processor(strict, preprocess=lambda r: dict(prompt=r["q"], sampling_params=SP))
    df = pd.DataFrame({"q": ["a", None, "c"]}, index=pd.MultiIndex.from_tuples([("x", 1), ("x", 2), ("y", 1)]))
    with pytest.raises(RowFailedError) as info:
        processor(df)
    assert str(info.value).startswith("build_processor: row ('x', 2) failed: column 'prompt' is null")
    assert [type(v) for v in info.value.row] == [str, int]


@pytest.mark.slow
@pytest.mark.parametrize("bad_row", [0, 1])
@pytest.mark.parametrize("value", ["\udc80", 2**70, {"a": [1, {"b": None}]}], ids=["surr", "huge", "nested"])
def test_untypable_value_fails_its_row_wherever_it_is(config, bad_row, value):
    """Row 0 as any other, on pandas and in Dask's sampled head."""
    df = pd.DataFrame({"id": range(3)})
    pre = lambda r: dict(prompt="x", sampling_params=SP)  # noqa: E731
    post = lambda r: {"id": r["id"], "s": value if r["id"] == bad_row else "ok"}  # noqa: E731
    processor = dfllm.build_processor(config, preprocess=pre, postprocess=post)
    with dask.config.set(scheduler="synchronous"):
        results = (processor(df), processor(dd.from_pandas(df, npartitions=1)).compute())
    for out in results:
        assert out["id"].tolist() == [0, 1, 2] and out.dtypes["s"] == STRING
        assert out["s"].tolist() == ["ok" if i != bad_row else pd.NA for i in range(3)]
        assert out["llm_error"].notna().tolist() == [i == bad_row for i in range(3)]
        assert "column 's'" in out["llm_error"].iloc[bad_row]


@pytest.mark.slow
def test_column_of_only_untypable_values_is_text(config):
    """A column no value of which has an Arrow type: text (the fallback), each value its row's error."""
    df = pd.DataFrame({"id": range(2)})
    pre = lambda r: dict(prompt="x", sampling_params=SP)  # noqa: E731
    out = dfllm.build_processor(config, preprocess=pre, postprocess=lambda r: {"id": r["id"], "s": "\udc80"})(df)
    assert out.dtypes["s"] == STRING and out["s"].isna().all()
    assert all("column 's'" in e for e in out["llm_error"])


@pytest.mark.slow
def test_surrogate_prompt_is_its_rows_error(config):
    df = pd.DataFrame({"id": range(3)})
    pre = lambda r: dict(prompt="\udc80" if r["id"] == 1 else "x", sampling_params=SP)  # noqa: E731
    out = dfllm.build_processor(config, preprocess=pre)(df)
    assert out["id"].tolist() == [0, 1, 2]
    assert out["llm_error"].notna().tolist() == [False, True, False]
    assert "'prompt'" in out["llm_error"].iloc[1]
    assert out["generated_text"].notna().tolist() == [True, False, True]


def test_repeated_input_column_is_refused_at_the_call(tiny_llama):
    cfg = dfllm.ProcessorConfig(model_source=str(tiny_llama), engine_kwargs=ENGINE)
    df = pd.DataFrame([[1, "a", 2], [2, "b", 3]], columns=["item", "item", "n"])
    processor = dfllm.build_processor(cfg, preprocess=lambda r: dict(prompt="x"))
    for frame in (df, dd.from_pandas(df, npartitions=1)):
        with pytest.raises(ValueError, match=r"more than one column named \['item'\]; rename them"):
            processor(frame)


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


@pytest.mark.slow
def test_hostile_exception_messages_are_their_rows_errors(config):
    """A user function's exception whose message has a lone surrogate, or cannot be made
    text at all: that row's error, as text."""

    def pre(row):
        if row["id"] == 0:
            raise ValueError("bad \udc80")
        if row["id"] == 1:
            raise Unprintable()
        return dict(prompt="x", sampling_params=SP)

    def post(row):
        if row["id"] == 2:
            raise KeyError("\udc80")
        if row["id"] == 3:
            raise ValueError("\udc80")
        return {"id": row["id"], "t": row["generated_text"]}

    out = dfllm.build_processor(config, preprocess=pre, postprocess=post)(pd.DataFrame({"id": range(5)}))
    errors = out["llm_error"].tolist()
    assert out["id"].tolist() == list(range(5))
    assert errors[0] == "preprocess: ValueError: bad \\udc80"
    assert errors[1].startswith("preprocess: Unprintable: ")
    assert errors[2].startswith("postprocess: KeyError: ") and errors[3] == "postprocess: ValueError: \\udc80"
    assert pd.isna(errors[4]) and isinstance(out["t"].iloc[4], str)


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(
        st.one_of(st.sampled_from([v for v, _ in HOSTILE.values()]), st.sampled_from(["ok", "x"])), max_size=8
    )
)
def test_infer_dtype_never_fails_and_untypable_values_are_row_errors(values):
    """Whatever the values and wherever the hostile ones: a dtype, and each value that does
    not fit it (all of those with no Arrow type) is its row's error naming the column."""
    dtype = infer_dtype(values, "s", None)
    errors: list = [None] * len(values)
    column = typed_column(list(values), dtype, pd.RangeIndex(len(values)), "s", errors)
    assert len(column) == len(values)
    for v, e, got in zip(values, errors, column.tolist()):
        untypable = v is HOSTILE["huge"][0] or v is HOSTILE["nested"][0] or v is HOSTILE["surrogate"][0]
        if untypable:
            assert e is not None and "column 's'" in e
        if e is not None:
            assert "column 's'" in e and pd.isna(got)
    text = sum(isinstance(v, str) for v in values)
    others: dict = {}
    for v in values:
        kind = next((k for name, (h, k) in HOSTILE.items() if h is v and not isinstance(v, str)), None)
        if kind not in (None, "null"):
            others[kind] = others.get(kind, 0) + 1
    if text > max(others.values(), default=0):
        assert dtype == STRING
        assert all(e is None for v, e in zip(values, errors) if isinstance(v, str) and v != "\udc80")
    if values and all(v is HOSTILE["huge"][0] or v is None for v in values):
        assert dtype == STRING  # none has a type: the fallback
    assert dtype.pyarrow_dtype != pa.null()
