"""A differential test of the whole data path: hypothesis draws frames (one to many
partitions, empty ones included; nulls, NaN, ints, floats, unicode, duplicate rows,
over-long rows) and each goes through the pandas, Polars and Dask (a LocalCluster with
worker processes) accessors; a frame also goes through ``dfllm.write_parquet`` on a
cluster of ``dask worker`` processes, one of which is killed mid-write, and is then
resumed with another partitioning. Every path must give, per input row and exactly once,
what ``LLM.generate`` gives that row alone, or an error where (and only where) the row is
bad.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import dask
import dask.dataframe as dd
import pandas as pd
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dfllm
from dfllm import LLM, SamplingParams

from helpers import CLICluster, local_client

pytestmark = pytest.mark.slow

MAX_LEN = 64
SP = {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}
TEMPLATE = "Q{n} [{x:.1f}]: {q}"
SETTINGS = settings(
    max_examples=8,
    deadline=None,
    print_blob=True,
    derandomize=not os.environ.get("DFLLM_HYPOTHESIS_RANDOM"),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=24).filter(
    lambda s: any(c.isalnum() for c in s)
)
BAD_TEXTS = [None, "", "  \t", "word " * 80]  # null, empty, blank, past max_model_len
questions = st.one_of(texts, texts, st.sampled_from(BAD_TEXTS))
rows = st.tuples(questions, st.integers(-(10**12), 10**12), st.one_of(st.floats(-1e6, 1e6), st.just(float("nan"))))


@st.composite
def frames(draw, max_rows: int = 10) -> tuple[pd.DataFrame, list[int]]:
    """A frame with a unique ``id`` per row (duplicate rows otherwise allowed) and the
    partition boundaries to cut it at (empty partitions allowed)."""
    drawn = draw(st.lists(rows, min_size=1, max_size=max_rows))
    if draw(st.booleans()):  # duplicate rows
        drawn += drawn[: draw(st.integers(1, len(drawn)))]
    df = pd.DataFrame(
        {
            "id": range(len(drawn)),
            "q": pd.Series([r[0] for r in drawn], dtype=object),
            "n": [r[1] for r in drawn],
            "x": [r[2] for r in drawn],
        }
    )
    cuts = sorted(draw(st.lists(st.integers(0, len(df)), min_size=0, max_size=4)))
    return df, cuts


def partitioned(df: pd.DataFrame, cuts: list[int]) -> dd.DataFrame:
    bounds = [0, *cuts, len(df)]
    chunks = [df.iloc[a:b] for a, b in zip(bounds, bounds[1:])]
    return dd.from_map(lambda i: chunks[i], range(len(chunks)), meta=df.iloc[:0], enforce_metadata=False)


@pytest.fixture(scope="module")
def kw(tiny_llama):
    return dict(model=str(tiny_llama), max_model_len=MAX_LEN, kv_cache_memory_bytes=2**22)


@pytest.fixture(scope="module")
def expected(kw):
    """id -> the text ``LLM.generate`` gives that row alone, or None where the row is bad."""
    llm = LLM(kw["model"], max_model_len=MAX_LEN, kv_cache_memory_bytes=2**22)
    cache: dict[str, str | None] = {}

    def alone(prompt: str) -> str | None:
        if prompt not in cache:
            try:
                cache[prompt] = llm.generate(prompt, SamplingParams(**SP), use_tqdm=False)[0].outputs[0].text
            except ValueError:  # past max_model_len: the row's error in a dataframe
                cache[prompt] = None
        return cache[prompt]

    def for_frame(df: pd.DataFrame) -> dict[int, str | None]:
        out = {}
        for r in df.to_dict("records"):
            q = r["q"]
            bad = q is None or not str(q).strip() or pd.isna(r["x"])
            out[r["id"]] = None if bad else alone(TEMPLATE.format(**r))
        return out

    return for_frame


def check(out: pd.DataFrame, df: pd.DataFrame, want: dict[int, str | None], path: str) -> None:
    ids = out["id"].tolist()
    assert sorted(ids) == sorted(df["id"]), f"{path}: rows lost or duplicated"
    got = out.set_index("id")
    inputs = df.set_index("id")
    for i, text in want.items():
        row = got.loc[i]
        assert row["n"] == inputs.loc[i, "n"], f"{path}: row {i} lost its values"
        if text is None:
            assert isinstance(row["llm_error"], str) and row["llm_error"], f"{path}: bad row {i} has no error"
            assert pd.isna(row["generated_text"])
        else:
            assert pd.isna(row["llm_error"]), f"{path}: good row {i} failed: {row['llm_error']}"
            assert row["generated_text"] == text, f"{path}: row {i}"


@pytest.fixture(scope="module")
def client():
    with local_client(workers=1, threads=3) as c:
        yield c


@SETTINGS
@given(frame=frames())
def test_pandas_polars_and_dask_give_each_row_its_own_result(client, kw, expected, frame):
    df, cuts = frame
    want = expected(df)
    check(df.llm.generate(TEMPLATE, sampling_params=SP, **kw), df, want, "pandas")
    polars = pl.from_pandas(df).llm.generate(TEMPLATE, sampling_params=SP, **kw)
    check(polars.to_pandas(), df, want, "polars")
    with client.as_current():
        out = partitioned(df, cuts).llm.generate(TEMPLATE, sampling_params=SP, **kw).compute()
    check(out, df, want, "dask")


def test_write_parquet_killed_worker_then_resumed_with_other_partitions(kw, expected, tmp_path):
    """One frame with every kind of row, written by ``write_parquet`` while a worker is killed
    (Dask reruns its tasks), then written again with ``resume=True`` over a different
    partitioning: each time every row exactly once, with its own result."""
    texts_ = ["Hello there", "¿Qué tal?", "数据框", "x", "", None, "word " * 80, "Hello there"]
    df = pd.DataFrame(
        {
            "id": range(24),
            "q": pd.Series([texts_[i % len(texts_)] for i in range(24)], dtype=object),
            "n": [i * 10**9 for i in range(24)],
            "x": [float("nan") if i == 5 else i / 3 for i in range(24)],
        }
    )
    want = expected(df)
    slow = {**SP, "max_tokens": 24}  # slow enough to kill a worker mid-write
    llm = LLM(kw["model"], max_model_len=MAX_LEN, kv_cache_memory_bytes=2**22)
    for i, r in enumerate(df.to_dict("records")):
        if want[i] is not None:
            want[i] = llm.generate(TEMPLATE.format(**r), SamplingParams(**slow), use_tqdm=False)[0].outputs[0].text
    out = tmp_path / "out"
    cluster = CLICluster(workers=2, threads=1)
    try:
        client = cluster.client()
        with client.as_current():

            def job(npartitions: int):
                with dask.config.set({"dataframe.convert-string": False}):
                    ddf = dd.from_pandas(df, npartitions=npartitions, sort=False)
                return ddf.llm.generate(TEMPLATE, sampling_params=slow, **kw)

            summaries = []
            writer = threading.Thread(
                target=lambda: summaries.append(dfllm.write_parquet(job(8), str(out), progress=False))
            )
            writer.start()
            deadline = time.time() + 240
            while not list(out.glob("part.*.parquet")) and time.time() < deadline and writer.is_alive():
                time.sleep(0.05)
            victim = sorted(cluster.worker_pids().values())[0]
            os.kill(victim, signal.SIGKILL)
            writer.join(timeout=400)
            assert summaries, "write_parquet did not finish after a worker was killed"
            first = pd.read_parquet(out)
            check(first, df, want, "write_parquet with a killed worker")
            assert summaries[0].rows == len(first) == 24

            again = dfllm.write_parquet(job(5), str(out), resume=True, progress=False)
            second = pd.read_parquet(out)
            check(second, df, want, "write_parquet resumed with 5 partitions")
            assert again.rows == len(second) == 24
    finally:
        cluster.close()
