"""The accessors and the prefix cache: the ``num_cached_tokens`` engine column, and
``sort_by``, which orders a partition's requests without changing any row's output or the
rows' order. Real engines on the tiny Llama, on pandas, Polars and a real Dask cluster."""

from __future__ import annotations

import dask.dataframe as dd
import pandas as pd
import polars as pl
import pyarrow as pa
import pytest

import dfllm  # noqa: F401  (registers the accessors)
from dfllm import SamplingParams
from dfllm.engine.input_processor import EngineRequest
from dfllm.tasks.runners import request_order

from helpers import local_client

SP = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
INT64 = pd.ArrowDtype(pa.int64())
BLOCK = 16  # the engine's KV block size: prefix cache hits come in whole blocks
DOCS = {
    "A": " ".join(f"alpha{i}" for i in range(12)),
    "B": " ".join(f"beta{i}" for i in range(12)),
    "C": " ".join(f"gamma{i}" for i in range(12)),
}


@pytest.fixture(scope="module")
def kw(tiny_llama):
    return dict(model=str(tiny_llama), max_model_len=128, kv_cache_memory_bytes=2**22)


@pytest.fixture(scope="module")
def rows():
    """Questions about three documents, interleaved, with duplicates and a bad row."""
    docs = ["A", "B", "C", "A", "B", "A", "C", "B", "A"]
    qs = ["one?", "two?", "three?", "one?", "five?", None, "three?", "two?", "nine?"]
    return pd.DataFrame({"doc": docs, "q": qs, "text": [DOCS[d] for d in docs]}, index=range(100, 109))


TEMPLATE = "{text}\nQ: {q}"


def test_num_cached_tokens_only_when_asked_and_typed(rows, kw):
    plain = rows.llm.generate(TEMPLATE, sampling_params=SP, **kw)
    assert "num_cached_tokens" not in plain.columns
    out = rows.llm.generate(TEMPLATE, sampling_params=SP, engine_columns="num_cached_tokens", **kw)
    assert list(out.columns) == [
        *rows.columns,
        "generated_text",
        "num_input_tokens",
        "num_generated_tokens",
        "finish_reason",
        "num_cached_tokens",
        "llm_error",
    ]
    assert out.dtypes["num_cached_tokens"] == INT64
    pd.testing.assert_frame_equal(out.drop(columns="num_cached_tokens"), plain)
    ok = out.llm_error.isna()
    assert ok.tolist() == [True] * 5 + [False] + [True] * 3 and out.num_cached_tokens[~ok].isna().all()
    cached, length = out.num_cached_tokens[ok], out.num_input_tokens[ok]
    assert ((cached >= 0) & (cached <= length - 1)).all()
    # chat too, and a list of engine columns; an empty frame has the typed columns as well
    chat = rows.llm.chat("{q}", sampling_params=SP, engine_columns=["num_cached_tokens", "prompt_token_ids"], **kw)
    assert chat.dtypes["num_cached_tokens"] == INT64 and list(chat.columns[-3:]) == [
        "num_cached_tokens",
        "prompt_token_ids",
        "llm_error",
    ]
    empty = rows.iloc[:0].llm.generate(TEMPLATE, engine_columns=["num_cached_tokens"], **kw)
    assert empty.dtypes["num_cached_tokens"] == INT64 and empty.empty


@pytest.mark.slow
def test_duplicate_rows_are_computed_once(rows, kw):
    """With prefix caching off, only deduplication serves prompt tokens: each copy of a row
    gets ``num_cached_tokens`` = its prompt length - 1, the first of them 0, all the same output."""
    out = rows.llm.generate(
        TEMPLATE, sampling_params=SP, engine_columns="num_cached_tokens", enable_prefix_caching=False, **kw
    )
    copies = out.duplicated(["doc", "q"]) & out.llm_error.isna()
    assert copies.tolist() == [False, False, False, True, False, False, True, True, False]
    assert (out.num_cached_tokens[copies] == out.num_input_tokens[copies] - 1).all()
    assert (out.num_cached_tokens[~copies].dropna() == 0).all()
    for _, group in out[out.llm_error.isna()].groupby(["doc", "q"]):
        assert group.generated_text.nunique() == 1
    apart = rows.llm.generate(
        TEMPLATE,
        sampling_params=SP,
        engine_columns="num_cached_tokens",
        enable_prefix_caching=False,
        deduplicate_requests=False,
        **kw,
    )
    assert (apart.num_cached_tokens.dropna() == 0).all()
    pd.testing.assert_series_equal(apart.generated_text, out.generated_text)


@pytest.mark.slow
@pytest.mark.parametrize("sort_by", ["prompt", "doc", ["doc", "prompt"], ["q", "doc"]])
def test_sort_by_keeps_every_rows_output_and_the_row_order(rows, kw, sort_by):
    unsorted = rows.llm.generate(TEMPLATE, sampling_params=SP, **kw)
    out = rows.llm.generate(TEMPLATE, sampling_params=SP, sort_by=sort_by, **kw)
    pd.testing.assert_frame_equal(out, unsorted)
    assert list(out.index) == list(rows.index)
    convs = rows.assign(conv=[[{"role": "user", "content": f"{d}: {q}"}] for d, q in zip(rows.doc, rows.q)])
    want = convs.llm.chat("conv", system="Be brief.", sampling_params=SP, **kw)
    got = convs.llm.chat("conv", system="Be brief.", sampling_params=SP, sort_by=sort_by, **kw)
    pd.testing.assert_frame_equal(got, want)


def test_sort_by_orders_the_requests_the_engine_gets(kw):
    """One row at a time through a KV cache that holds one document's rows: in frame order
    (A, B, A, B) each row evicts the other document's cached blocks; sorted by document,
    each second row finds its document's first block in the prefix cache. Outputs agree."""
    tight = dict(
        kw,
        max_model_len=80,
        kv_cache_memory_bytes=5 * 8 * 1024,
        max_num_seqs=1,
        prefix_aware_scheduling=False,
        deduplicate_requests=False,
    )
    df = pd.DataFrame({"doc": ["A", "B", "A", "B"], "q": ["one", "two", "three", "four"]})
    df["text"] = df.doc.map(DOCS)
    as_is = df.llm.generate(TEMPLATE, sampling_params=SP, engine_columns="num_cached_tokens", **tight)
    for key in ("doc", "prompt"):
        by_doc = df.llm.generate(TEMPLATE, sampling_params=SP, engine_columns="num_cached_tokens", sort_by=key, **tight)
        assert by_doc.generated_text.tolist() == as_is.generated_text.tolist()
        assert by_doc.num_cached_tokens[[2, 3]].ge(BLOCK).all(), key
        assert by_doc.num_cached_tokens.sum() > as_is.num_cached_tokens.sum(), key


def test_request_order():
    """The order requests go in: keys most significant first, ties in row order, nulls last;
    values that do not compare (lists) grouped in order of first appearance."""

    def req(ids):
        return EngineRequest(None, ids, SamplingParams())

    df = pd.DataFrame(
        {"k": ["b", None, "a", "b", "a"], "n": [3, 1, 2, 1, 2], "lists": [[2], [1], [2], [1, 1], [1]]},
        index=list("vwxyz"),
    )
    reqs = [req([5, 1]), req([4]), req([5]), req([4, 9]), req([5, 0])]
    rows = list(range(5))
    assert request_order(df, ("k",), rows, reqs) == [2, 4, 0, 3, 1]
    assert request_order(df, ("prompt",), rows, reqs) == [1, 3, 2, 4, 0]
    assert request_order(df, ("k", "prompt"), rows, reqs) == [2, 4, 3, 0, 1]
    assert request_order(df, ("n", "k"), rows, reqs) == [3, 1, 2, 4, 0]
    assert request_order(df, ("lists",), rows, reqs) in ([0, 2, 1, 3, 4], [1, 4, 3, 0, 2])
    # some rows only (the others had errors): positions into those
    assert request_order(df, ("k",), [0, 3, 4], [reqs[0], reqs[3], reqs[4]]) == [2, 0, 1]


def test_bad_arguments_fail_at_call_time(rows, kw):
    with pytest.raises(ValueError, match=r"sort_by column 'nope' not in the dataframe.*'prompt'"):
        rows.llm.generate(TEMPLATE, sort_by="nope", **kw)
    with pytest.raises(ValueError, match=r"sort_by column 'missing'"):
        rows.llm.chat("{q}", sort_by=["doc", "missing"], **kw)
    with pytest.raises(ValueError, match=r"sort_by column 'nope'"):
        dd.from_pandas(rows, npartitions=2).llm.generate(TEMPLATE, sort_by="nope", **kw)
    with pytest.raises(ValueError, match="sort_by must be a name or a list of names"):
        rows.llm.generate(TEMPLATE, sort_by=1, **kw)
    with pytest.raises(ValueError, match=r"unknown engine column\(s\) \['num_cached'\]"):
        rows.llm.generate(TEMPLATE, engine_columns=["num_cached"], **kw)
    with pytest.raises(ValueError, match="already exist"):
        rows.assign(num_cached_tokens=1).llm.generate(TEMPLATE, engine_columns="num_cached_tokens", **kw)
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['sort_by'\]"):
        rows.llm.embed("q", sort_by="prompt")


def test_series_and_polars(rows, kw):
    want = rows.llm.generate(TEMPLATE, sampling_params=SP, engine_columns="num_cached_tokens", **kw)
    series = rows.assign(p=rows.text + "\nQ: " + rows.q).p.llm.generate(sampling_params=SP, sort_by="prompt", **kw)
    assert series.tolist() == want.generated_text.tolist() and list(series.index) == list(rows.index)
    frame = pl.from_pandas(rows.reset_index(drop=True))
    for result in (
        frame.llm.generate(
            TEMPLATE, sampling_params=SP, engine_columns="num_cached_tokens", sort_by=["doc", "prompt"], **kw
        ),
        frame.lazy()
        .llm.generate(TEMPLATE, sampling_params=SP, engine_columns="num_cached_tokens", sort_by="prompt", **kw)
        .collect(),
    ):
        assert result.schema["num_cached_tokens"] == pl.Int64
        assert result["generated_text"].to_list() == [None if pd.isna(t) else t for t in want.generated_text]
        assert result["doc"].to_list() == rows.doc.tolist()
        assert result["num_cached_tokens"].null_count() == 1
    # the engine columns pandas holds as Python objects are typed in Polars too (lists of maps)
    logprobs = frame.lazy().llm.generate(
        TEMPLATE, sampling_params={**SP, "logprobs": 1}, engine_columns="logprobs", **kw
    )
    schema, got = logprobs.collect_schema(), logprobs.collect()
    assert got.schema == schema and isinstance(schema["logprobs"], pl.List)
    assert len(got["logprobs"][0]) == SP["max_tokens"] and got["logprobs"].null_count() == 1


@pytest.mark.slow
def test_dask_on_a_cluster(rows, kw):
    """On worker processes: the meta carries the typed column, sorted partitions give the
    pandas result in the frame's order, and a copy in the same partition is computed once."""
    ddf = dd.from_pandas(rows, npartitions=2)
    lazy = ddf.llm.generate(
        TEMPLATE, sampling_params=SP, engine_columns=["num_cached_tokens"], sort_by=["doc", "prompt"], **kw
    )
    assert lazy._meta.dtypes["num_cached_tokens"] == INT64
    assert "num_cached_tokens" not in ddf.llm.generate(TEMPLATE, sampling_params=SP, **kw)._meta.columns
    with local_client(workers=1, threads=2):
        got = lazy.compute()
    assert got.dtypes.to_dict() == lazy._meta.dtypes.to_dict()
    want = rows.llm.generate(TEMPLATE, sampling_params=SP, **kw)
    assert list(got.index) == list(rows.index)
    pd.testing.assert_frame_equal(got.drop(columns="num_cached_tokens"), want, check_dtype=False)
    first = got.iloc[:5]  # the first partition holds rows 0 and 3, the same question on document A
    assert first.num_cached_tokens.iloc[3] == first.num_input_tokens.iloc[3] - 1
