"""``.llm.agg`` on hostile cells and keys, drawn at random rows and groups of pandas, Polars and
Dask frames: every row comes out once, either summarised in its group or named in its group's
``llm_error``; no cell crashes the call and none is summarised as its ``repr()``.

The reference for "summarised" is the same ``agg`` over the good rows alone: a group's summary
must be the one its good rows give (the prompts are then the same, and decoding is greedy)."""

from __future__ import annotations

from collections import Counter

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from semantic_data import ENGINE, REVIEWS

import dfllm  # noqa: F401  (registers .llm)

AGG = "Summarise the complaints in {review}"
PROPERTY = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

#: name -> (value, whether agg may summarise it). Drawn by name, so that a failing example
#: prints (``repr(10**5000)`` raises).
VALUES = {
    "text0": (REVIEWS[0][0], True),
    "text1": (REVIEWS[3][0], True),
    "bom": ("\ufeffThe box was crushed.", True),  # a BOM is valid text
    "utf8_bytes": (b"Late again.", True),  # bytes are read as UTF-8
    "int70": (2**70, True),
    "empty": ("", False),
    "blank": ("  \n", False),
    "surrogate": ("\ud800 lone surrogate", False),
    "bad_bytes": (b"\xff\xfe", False),
    "list": (["a", "list"], False),
    "dict": ({"k": "v"}, False),
    "nested": ([[1], {"x": None}], False),
    "none": (None, False),
    "nan": (float("nan"), False),
    "pd_na": (pd.NA, False),
    "huge_int": (10**5000, False),
    "ndarray": (np.array([1, 2]), False),
}
GROUPS = ["a", "b", "c"]
rows_strategy = st.lists(st.tuples(st.sampled_from(GROUPS), st.sampled_from(sorted(VALUES))), min_size=1, max_size=8)


def left_out(error, label, what: str = "field 'review'") -> bool:
    return isinstance(error, str) and f"the row of index {label!r} was left out: its {what}" in error


def null(v) -> bool:
    return v is None or v is pd.NA or (isinstance(v, float) and v != v)


def check_groups(out: pd.DataFrame, groups: dict, bad: set, clean: pd.DataFrame, what: str = "field 'review'"):
    """``out`` has one row per key of ``groups`` (key -> its rows' labels); each label in
    ``bad`` is named in its group's error and no other is; each group's summary is ``clean``'s
    (the agg of the good rows alone), or null for a group without good rows."""
    assert len(out) == len(groups), (out, groups)
    reference = dict(zip(clean.g, clean.summary))
    for key, summary, error in zip(out.g, out.summary, out.llm_error):
        labels = groups[key]
        for label in labels:
            assert left_out(error, label, what) == (label in bad), (key, label, error)
        good = [label for label in labels if label not in bad]
        if good:
            assert isinstance(summary, str) and summary == reference[key], (key, summary, reference.get(key))
        else:
            assert null(summary) and error.startswith("agg: no rows to summarise"), (key, summary, error)


@PROPERTY
@given(rows=rows_strategy, shift=st.integers(0, 5))
def test_pandas_hostile_cells_are_their_groups_errors(tiny_llama, rows, shift):
    names = [name for _, name in rows]
    labels = [n * 7 + shift for n in range(len(rows))]  # an index that is not the positions
    df = pd.DataFrame(
        {"g": [g for g, _ in rows], "review": pd.Series([VALUES[n][0] for n in names], index=labels, dtype=object)},
        index=labels,
    )
    out = df.llm.agg(AGG, by="g", model=str(tiny_llama), max_tokens=8, **ENGINE)
    assert list(out.columns) == ["g", "summary", "llm_error"]
    assert out.g.tolist() == sorted(set(df.g))
    good = [VALUES[n][1] for n in names]
    clean = df[good].llm.agg(AGG, by="g", model=str(tiny_llama), max_tokens=8, **ENGINE) if any(good) else None
    groups = {g: [label for label, gg in zip(labels, df.g) if gg == g] for g in set(df.g)}
    bad = {label for label, ok in zip(labels, good) if not ok}
    check_groups(out, groups, bad, clean if clean is not None else pd.DataFrame({"g": [], "summary": []}))

    # without by: one row, the same rule
    one = df.assign(g="all").llm.agg(AGG, model=str(tiny_llama), max_tokens=8, **ENGINE)
    assert len(one) == 1
    for label, ok in zip(labels, good):
        assert left_out(one.llm_error.iloc[0], label) == (not ok)
    assert isinstance(one.summary.iloc[0], str) == any(good)


#: Polars dtype -> value name -> (value, summarised?): a typed column holds one kind of value
POLARS = {
    "str": (
        pl.Utf8,
        {"t0": (REVIEWS[0][0], True), "bom": ("\ufeffok", True), "empty": ("", False), "null": (None, False)},
    ),
    "binary": (pl.Binary, {"utf8": (b"Late again.", True), "bad": (b"\xff\xfe", False), "null": (None, False)}),
    "list": (pl.List(pl.Utf8), {"list": (["a", "b"], False), "empty": ([], False), "null": (None, False)}),
    "struct": (pl.Struct({"k": pl.Utf8}), {"struct": ({"k": "v"}, False), "null": (None, False)}),
}


@PROPERTY
@given(data=st.data(), kind=st.sampled_from(sorted(POLARS)), lazy=st.booleans())
def test_polars_hostile_fields_are_their_groups_errors(tiny_llama, data, kind, lazy):
    dtype, values = POLARS[kind]
    rows = data.draw(
        st.lists(st.tuples(st.sampled_from(GROUPS), st.sampled_from(sorted(values))), min_size=1, max_size=8)
    )
    df = pl.DataFrame(
        {"g": [g for g, _ in rows], "review": [values[n][0] for _, n in rows]}, schema={"g": pl.Utf8, "review": dtype}
    )
    out = (df.lazy() if lazy else df).llm.agg(AGG, by="g", model=str(tiny_llama), max_tokens=8, **ENGINE)
    out = (out.collect() if lazy else out).to_pandas()
    assert out.g.tolist() == sorted({g for g, _ in rows})
    good = [values[n][1] for _, n in rows]
    clean = df.filter(pl.Series(good))
    ref = clean.llm.agg(AGG, by="g", model=str(tiny_llama), max_tokens=8, **ENGINE).to_pandas() if len(clean) else None
    groups = {g: [i for i, (gg, _) in enumerate(rows) if gg == g] for g, _ in rows}
    bad = {i for i, ok in enumerate(good) if not ok}
    check_groups(out, groups, bad, ref if ref is not None else pd.DataFrame({"g": [], "summary": []}))


#: group keys: hashable ones group as they are; one that cannot be hashed counts as null
KEYS = {
    "a": ("a", True),
    "b": ("b", True),
    "huge_int": (10**5000, True),
    "surrogate": ("\ud800 key", False),  # not valid Unicode, as in a field
    "tuple": ((1, 2), True),  # does not sort with the others: groups keep their first row's order
    "none": (None, True),
    "nan": (float("nan"), True),
    "list": (["a"], False),
    "dict": ({"k": 1}, False),
    "ndarray": (np.array([1, 2]), False),
}


def key_id(v):
    return "<null>" if null(v) else (type(v).__name__, v)


@PROPERTY
@given(
    rows=st.lists(
        st.tuples(st.sampled_from(sorted(KEYS)), st.sampled_from(["text0", "text1", "empty"])), min_size=1, max_size=8
    )
)
def test_hostile_group_keys_are_their_rows_errors(tiny_llama, rows):
    keys = [KEYS[k][0] for k, _ in rows]
    df = pd.DataFrame({"g": pd.Series(keys, dtype=object), "review": [VALUES[n][0] for _, n in rows]})
    out = df.llm.agg(AGG, by="g", model=str(tiny_llama), max_tokens=8, **ENGINE)
    ids = [key_id(k) if KEYS[name][1] else "<null>" for name, k in zip((n for n, _ in rows), keys)]
    assert Counter(map(key_id, out.g)) == Counter(set(ids))  # each group once
    by_id = dict(zip(map(key_id, out.g), zip(out.summary, out.llm_error)))
    for i, ((name, value_name), gid) in enumerate(zip(rows, ids)):
        summary, error = by_id[gid]
        keyless, empty = not KEYS[name][1], value_name == "empty"
        assert left_out(error, i, "key 'g'") == keyless, (i, name, error)
        assert left_out(error, i) == (empty and not keyless), (i, name, error)
    for gid, (summary, error) in by_id.items():
        members = [i for i, g in enumerate(ids) if g == gid]
        summarised = [i for i in members if KEYS[rows[i][0]][1] and rows[i][1] != "empty"]
        assert isinstance(summary, str) == bool(summarised), (gid, summary, error)


def test_polars_list_keys_and_dask_partitions(tiny_llama):
    """A Polars List key cannot group: each row is named in the null group's error. On Dask,
    each partition's hostile rows reach the final groups' errors, each group once."""
    df = pl.DataFrame({"g": [["a"], None, ["b"]], "review": [REVIEWS[0][0], REVIEWS[1][0], REVIEWS[2][0]]})
    out = df.llm.agg(AGG, by="g", model=str(tiny_llama), max_tokens=8, **ENGINE)
    assert out.schema["g"] == pl.List(pl.Utf8) and out["g"].to_list() == [None]
    error = out["llm_error"][0]
    assert left_out(error, 0, "key 'g'") and left_out(error, 2, "key 'g'") and not left_out(error, 1, "key 'g'")
    assert isinstance(out["summary"][0], str)  # row 1 (a null key) is summarised

    names = ["text0", "surrogate", "list", "text1", "huge_int", "ndarray", "bad_bytes", "bom"]
    pdf = pd.DataFrame(
        {
            "g": ["a", "b", "a", "b", "a", "b", "a", "b"],
            "review": pd.Series([VALUES[n][0] for n in names], dtype=object),
        }
    )
    with dask.config.set({"dataframe.convert-string": False, "scheduler": "sync"}):  # keep the objects
        ddf = dd.from_pandas(pdf, npartitions=3)
        res = ddf.llm.agg(AGG, by="g", model=str(tiny_llama), max_tokens=8, **ENGINE).compute()
    assert res.g.tolist() == ["a", "b"] and res.summary.map(lambda s: isinstance(s, str)).all()
    errors = dict(zip(res.g, res.llm_error))
    for i, (g, n) in enumerate(zip(pdf.g, names)):
        assert left_out(errors[g], i) == (not VALUES[n][1]), (i, n, errors[g])


def test_by_llm_error_is_refused(tiny_llama):
    df = pd.DataFrame({"review": ["t1", "t2"], "llm_error": ["e1", None]})
    with pytest.raises(ValueError, match="llm_error"):
        df.llm.agg(AGG, by="llm_error", model=str(tiny_llama), max_tokens=8, **ENGINE)
    with pytest.raises(ValueError, match="llm_error"):
        df.llm.agg(AGG, by=["review", "llm_error"], model=str(tiny_llama), max_tokens=8, **ENGINE)
