"""A join's result holds each side's values exactly, of one dtype whichever rows failed.

A join's result puts nulls beside a row that could not be used (its other side) on both
sides, so a NumPy integer or boolean column, which cannot hold a null, comes out as the Arrow
type of the same values (``int64[pyarrow]``, ``uint64[pyarrow]``, ``bool[pyarrow]``), in
every result and in a Dask join's ``meta``: an id past 2**53 is never rounded through
``float64``. A Polars ``other``'s columns come back with their Polars dtypes, as the frame's
own do (an ``Enum`` stays an ``Enum``, renamed by ``suffix`` or not).
"""

from __future__ import annotations

import dask
import dask.dataframe as dd
import pandas as pd
import polars as pl
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from semantic_data import ENGINE

import dfllm  # noqa: F401  (registers .llm)

TEXTS = ["late parcel", "great sound", "too expensive", None]
TOPICS = ["shipping", "sound", "price", None]


def frames(ids: list, flags: list, texts: list, tids: list, topics: list) -> tuple[pd.DataFrame, pd.DataFrame]:
    left = pd.DataFrame(
        {
            "id": pd.Series(ids, dtype="int64"),
            "flag": pd.Series(flags, dtype=bool),
            "text": pd.Series(texts, dtype=object),
        }
    )
    right = pd.DataFrame({"tid": pd.Series(tids, dtype="uint64"), "topic": pd.Series(topics, dtype=object)})
    return left, right


def values(column: pd.Series) -> list:
    """A column's values as Python values, None for a null."""
    return [None if v is None or v is pd.NA or v != v else v for v in column.tolist()]


def assert_rows_exact(out: pd.DataFrame, left: pd.DataFrame, right: pd.DataFrame) -> None:
    """Every result row's left part is a left row and its right part a right row, value for
    value (as Python ints, never rounded), or nulls; every left row with a null text is there
    once with its error, and so is every right row with a null topic."""
    lrows = set(zip(*(values(left[c]) for c in ("id", "flag", "text"))))
    rrows = set(zip(*(values(right[c]) for c in ("tid", "topic"))))
    got_left = list(zip(*(values(out[c]) for c in ("id", "flag", "text"))))
    got_right = list(zip(*(values(out[c]) for c in ("tid", "topic"))))
    for lrow, rrow, err in zip(got_left, got_right, values(out["llm_error"])):
        assert lrow in lrows or all(v is None for v in lrow), lrow
        assert rrow in rrows or all(v is None for v in rrow), rrow
        assert None not in lrow + rrow or isinstance(err, str)
    for i, text in zip(values(left["id"]), values(left["text"])):
        if text is None:
            assert values(out["id"]).count(i) == 1
    for j, topic in zip(values(right["tid"]), values(right["topic"])):
        if topic is None:
            assert values(out["tid"]).count(j) == 1


DTYPES = {"id": pd.ArrowDtype(pa.int64()), "flag": pd.ArrowDtype(pa.bool_()), "tid": pd.ArrowDtype(pa.uint64())}


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_sim_join_integer_and_boolean_columns_come_back_exact(data):
    n = data.draw(st.integers(1, 4), label="left rows")
    m = data.draw(st.integers(1, 3), label="right rows")
    ids = data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n, unique=True), label="ids")
    flags = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="flags")
    texts = data.draw(st.lists(st.sampled_from(TEXTS), min_size=n, max_size=n), label="texts")
    tids = data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=m, max_size=m, unique=True), label="tids")
    topics = data.draw(st.lists(st.sampled_from(TOPICS), min_size=m, max_size=m), label="topics")
    left, right = frames(ids, flags, texts, tids, topics)
    out = left.llm.sim_join(right, "text", "topic", data.draw(st.integers(1, 3), label="k"))
    assert {c: out[c].dtype for c in DTYPES} == DTYPES  # the same whichever rows failed
    assert_rows_exact(out, left, right)


def test_join_keys_past_2_53_exact_beside_failed_rows(tiny_judge):
    """Rows failing on both sides put nulls beside the other side's columns: the ids stay exact."""
    left, right = frames(
        [2**62 + 1, 2**53 + 1, -(2**63)],
        [True, False, True],
        ["late parcel", None, "great sound"],
        [2**64 - 1, 2**63 + 3],
        ["shipping", None],
    )
    out = left.llm.join(right, "{text} is about {topic}", model=str(tiny_judge), **ENGINE)
    assert {c: out[c].dtype for c in DTYPES} == DTYPES
    assert_rows_exact(out, left, right)
    assert values(out["id"]).count(2**53 + 1) == 1 and values(out["tid"]).count(2**63 + 3) == 1


@pytest.mark.parametrize("shape", ["unknown divisions", "an empty partition", "an empty other"])
def test_dask_join_meta_is_every_partitions_dtypes(shape):
    left, right = frames(
        [2**62 + 1, 2, 3, 4], [True, False, True, False], ["late parcel", None, "great sound", "x"], [7, 8], ["a", None]
    )
    lazy_left = dd.from_pandas(left, npartitions=2)
    lazy_right = dd.from_pandas(right, npartitions=2)
    if shape == "unknown divisions":
        lazy_left = lazy_left.clear_divisions()
    elif shape == "an empty partition":
        lazy_left = lazy_left[lazy_left["id"].isin([3, 4])]  # the first partition empty
    else:
        lazy_right = lazy_right[lazy_right["tid"] > 100]
    lazy = lazy_left.llm.sim_join(lazy_right, "text", "topic", 1)
    with dask.config.set(scheduler="sync"):
        parts = [p.compute() for p in lazy.to_delayed()]
    for part in parts:  # every partition's dtypes are the meta's (they differed where a row failed)
        assert part.dtypes.to_dict() == lazy._meta.dtypes.to_dict()
    got = pd.concat(parts)
    assert {c: got[c].dtype for c in DTYPES} == DTYPES
    ids = {"unknown divisions": [2**62 + 1, 2, 3, 4, None], "an empty partition": [3, 4, None], "an empty other": [2]}
    assert sorted(values(got["id"]), key=str) == sorted(ids[shape], key=str)  # the null: the failed right row


@pytest.mark.parametrize("lazy", [False, True])
def test_polars_other_keeps_its_dtypes(lazy):
    left = pl.DataFrame({"text": ["late parcel", None], "e": pl.Series(["a", "b"], dtype=pl.Enum(["a", "b"]))})
    right = pl.DataFrame(
        [
            pl.Series("topic", ["shipping", None]),
            pl.Series("e", ["x", "y"], dtype=pl.Enum(["x", "y", "z"])),  # renamed e_right
            pl.Series("kind", ["x", None], dtype=pl.Enum(["x", "y"])),
            pl.Series("n", [2**64 - 1, 3], dtype=pl.UInt64),
            pl.Series("small", [1, 2], dtype=pl.Int8),
        ]
    )
    if lazy:
        out = left.lazy().llm.sim_join(right.lazy(), "text", "topic", 1)
        declared = out.collect_schema()
        out = out.collect()
        assert out.schema == declared
    else:
        out = left.llm.sim_join(right, "text", "topic", 1)
    want = {"e": left.schema["e"], "e_right": right.schema["e"], "kind": right.schema["kind"]}
    want |= {"n": pl.UInt64, "small": pl.Int8}
    assert {c: out.schema[c] for c in want} == want
    assert out.height == 3 and sorted(out["n"].drop_nulls().to_list()) == [3, 2**64 - 1]


@pytest.mark.parametrize("op", ["sim_join", "join"])
def test_dask_other_with_a_partition_no_row_of_which_embeds(tiny_judge, op):
    """A right partition whose every row fails embeds to vectors of width 0: beside the other
    partitions' it is each row's error, not numpy's 'all input arrays must have the same shape'
    for the whole join."""
    left = pd.DataFrame({"id": [1, 2], "text": ["late parcel", "great sound"]})
    right = pd.DataFrame({"tid": [7, 8, 9], "topic": ["shipping", "sound", None]})
    lazy_right = dd.from_pandas(right, npartitions=2)  # the second partition: the null topic alone
    assert lazy_right.partitions[1].compute()["topic"].isna().all()
    lazy_left = dd.from_pandas(left, npartitions=1)
    if op == "sim_join":
        lazy = lazy_left.llm.sim_join(lazy_right, "text", "topic", 1)
    else:
        lazy = lazy_left.llm.join(lazy_right, "{text} is {topic}", model=str(tiny_judge), block_k=1, **ENGINE)
    with dask.config.set(scheduler="sync"):
        got = lazy.compute()
    failed = got[got["llm_error"].notna()]
    assert values(failed["tid"]) == [9] and "column 'topic' is null" in failed["llm_error"].iloc[0]
    assert set(values(got["id"])) - {None} <= {1, 2}
