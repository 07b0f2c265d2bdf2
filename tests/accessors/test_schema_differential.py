"""Differential: random frames with nested and mixed-type columns through dfllm's writer.

Each example goes through ``dfllm run``'s reader and writer (JSON Lines files) and through
``write_parquet`` of a pandas-built Dask frame (fresh, resumed, resumed with other
partitions), and through Dask's own ``to_parquet`` of the same input as the reference of
what a reader should see. Every output is read back with pandas, pyarrow and Polars: every
input row exactly once, every input field intact, one schema across parts. A value that
cannot fit its column (text among lists) is null with its row's ``llm_error`` naming the
column, and nothing else of that row is lost.
"""

from __future__ import annotations

import datetime
import decimal
import json
import shutil
from pathlib import Path

import dask
import dask.dataframe as dd
import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dfllm
from dfllm.jobs.sources import read_input

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.usefixtures("object_columns")]


@pytest.fixture
def object_columns():
    """Dask's from_pandas keeps object columns of dicts and lists as they are (by default it
    turns them into their text)."""
    with dask.config.set({"dataframe.convert-string": False}):
        yield


KEYS = ("a", "b", "c")
ints = st.one_of(st.none(), st.integers(-(2**40), 2**40))
structs = st.one_of(st.none(), st.dictionaries(st.sampled_from(KEYS), ints, max_size=3))
lists = st.one_of(st.none(), st.lists(st.text(max_size=4), max_size=3))
nested = st.one_of(
    st.none(),
    st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": st.text(max_size=5)}),
        max_size=2,
    ),
)
#: mostly lists, sometimes text: the text rows are the misfits
mixed = st.one_of(
    st.lists(st.integers(0, 9), max_size=2),
    st.lists(st.integers(0, 9), max_size=2),
    st.lists(st.integers(0, 9), max_size=2),
    st.just("text"),
)
row = st.fixed_dictionaries({"s": structs, "l": lists, "n": nested, "x": mixed})


def canon(v):
    """A read-back value in plain Python form: numpy arrays as lists, at any depth."""
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        v = v.tolist()
    if isinstance(v, dict):
        return {k: canon(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [canon(x) for x in v]
    if v is None or (isinstance(v, float) and v != v):
        return None
    return v


def same_struct(got, want) -> bool:
    """A struct read back holds every field the input had (others null: the union's)."""
    if want is None:
        return got is None
    if isinstance(got, list):  # only empty dicts were seen: a map column
        got = dict(got)
    return (
        got is not None
        and all(got.get(k) == v for k, v in want.items())
        and all(v is None for k, v in got.items() if k not in want)
    )


def check(out: Path, rows: list[dict]) -> None:
    schemas = [pq.read_schema(p).remove_metadata() for p in sorted(out.glob("part.*.parquet"))]
    assert schemas and all(s.equals(schemas[0]) for s in schemas)
    table = pq.read_table(out)
    polars = pl.read_parquet(str(out / "part.*.parquet"))
    back = pd.read_parquet(out)
    assert len(back) == table.num_rows == polars.height == len(rows)
    got = {int(r["id"]): r for r in back.to_dict("records")}
    assert sorted(got) == list(range(len(rows)))  # every row exactly once
    texts = sum(isinstance(r["x"], str) for r in rows)
    lists_win = len(rows) - texts >= texts  # the most common kind of value sets the type (lists on a tie)
    for i, want in enumerate(rows):
        r = got[i]
        assert same_struct(canon(r["s"]), want["s"]), (r["s"], want["s"])
        assert canon(r["l"]) == want["l"]
        assert canon(r["n"]) == want["n"]
        if isinstance(want["x"], str) == lists_win and 0 < texts < len(rows):
            assert canon(r["x"]) is None and "column 'x'" in r["llm_error"]
        else:
            assert canon(r["x"]) == want["x"]
            assert pd.isna(r["llm_error"])


def generate(ddf, model: Path):
    return ddf.llm.generate(
        "row {id}",
        model=str(model),
        max_model_len=32,
        kv_cache_memory_bytes=2**21,
        sampling_params={"max_tokens": 1, "temperature": 0.0, "ignore_eos": True},
    )


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(row, min_size=1, max_size=9), split=st.integers(1, 3), other=st.integers(1, 4))
def test_random_nested_frames_read_back_whole(tiny_llama, tmp_path_factory, rows, split, other):
    tmp = tmp_path_factory.mktemp("diff")
    rows = [{"id": i, **r} for i, r in enumerate(rows)]
    # dfllm run's path: JSON Lines files (the rows split over `split` files) -> reader -> writer
    src = tmp / "in"
    src.mkdir()
    for f in range(split):
        (src / f"{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[f::split]))
    ddf = read_input(str(src))
    out = tmp / "run"
    summary = dfllm.write_parquet(generate(ddf, tiny_llama), str(out), progress=False)
    assert summary.rows == len(rows)
    check(out, rows)
    # write_parquet of a pandas-built frame: fresh, resumed, resumed with other partitions
    frame = pd.DataFrame(rows)
    out = tmp / "frame"
    n = min(split, len(rows))
    first = dfllm.write_parquet(
        generate(dd.from_pandas(frame, npartitions=n, sort=False), tiny_llama), str(out), progress=False
    )
    check(out, rows)
    again = dfllm.write_parquet(
        generate(dd.from_pandas(frame, npartitions=n, sort=False), tiny_llama), str(out), progress=False, resume=True
    )
    assert (again.written, again.skipped) == (0, first.partitions)
    check(out, rows)
    m = min(other, len(rows))
    dfllm.write_parquet(
        generate(dd.from_pandas(frame, npartitions=m, sort=False), tiny_llama), str(out), progress=False, resume=True
    )
    check(out, rows)
    shutil.rmtree(tmp)


def test_typed_columns_keep_their_types_through_a_write(tiny_llama, tmp_path):
    """Timestamps with zones, decimals, large strings, dictionaries and maps keep their
    Arrow types; Dask's own to_parquet of the same input is the reference of the values."""
    table = pa.table(
        {
            "id": pa.array([0, 1, 2], pa.int64()),
            "ts": pa.array(
                [datetime.datetime(2024, 1, 1, 12), None, datetime.datetime(2025, 6, 1)],
                pa.timestamp("us", tz="Europe/Paris"),
            ),
            "dec": pa.array([decimal.Decimal("1.25"), None, decimal.Decimal("-3.50")], pa.decimal128(10, 2)),
            "big": pa.array(["x", "y", None], pa.large_string()),
            "cat": pa.array(["u", "v", "u"]).dictionary_encode(),
            "m": pa.array([[("k", 1)], None, []], pa.map_(pa.string(), pa.int64())),
        }
    )
    src = tmp_path / "in"
    src.mkdir()
    pq.write_table(table.slice(0, 2), src / "0.parquet")
    pq.write_table(table.slice(2), src / "1.parquet")
    reference = tmp_path / "dask"
    dd.read_parquet(str(src), dtype_backend="pyarrow").to_parquet(str(reference))
    out = tmp_path / "out"
    dfllm.write_parquet(generate(read_input(str(src)), tiny_llama), str(out), progress=False)
    got = pq.read_table(out)
    want = pq.read_table(reference)
    for name in ("ts", "dec", "big", "m"):
        assert got.schema.field(name).type == table.schema.field(name).type, name
        assert got.column(name).to_pylist() == want.column(name).to_pylist() == table.column(name).to_pylist()
    assert got.column("cat").to_pylist() == ["u", "v", "u"]
    back = pl.read_parquet(str(out / "part.*.parquet"))
    assert back["dec"].to_list() == [decimal.Decimal("1.25"), None, decimal.Decimal("-3.50")]
