"""``.llm.judge`` and ``.llm.filter`` equal the per-row judgment of the same model
(``LLM.chat`` row by row, greedy, constrained to True/False) on pandas, Polars and Dask;
failed rows keep their ``llm_error``; on a LocalCluster of worker processes with a killed
worker every row comes out exactly once; ``write_parquet`` resumes them.

Data: short product reviews whose topics are known (tests/semantic_data.py); model: a tiny
random Llama whose answers differ from row to row (conftest's ``tiny_judge``).
"""

from __future__ import annotations

import math

import dask.dataframe as dd
import pandas as pd
import polars as pl
import pytest
from semantic_data import ENGINE, INSTRUCTION, direct_judge, reviews

import dfllm
from dfllm.semantic.filter import verdict_probability
from dfllm.semantic.prompts import semantic_prompt

from helpers import kill_a_worker_mid_task, local_client

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_judge_equals_the_per_row_judgment(tiny_judge):
    df = reviews(null_at=3)
    got = df.llm.judge(INSTRUCTION, model=str(tiny_judge), **ENGINE)
    want = direct_judge(tiny_judge, df)
    assert list(got.columns) == ["id", "review", "label", "verdict", "verdict_probability", "llm_error"]
    assert str(got["verdict"].dtype) == "bool[pyarrow]" and str(got["verdict_probability"].dtype) == "double[pyarrow]"
    assert got["verdict"].isna().tolist() == [w is None for w in want]
    assert got.loc[3, "llm_error"] == "column 'review' is null"
    ok = [i for i, w in enumerate(want) if w is not None]
    assert [bool(got["verdict"][i]) for i in ok] == [want[i][0] for i in ok]
    assert {want[i][0] for i in ok} == {True, False}  # the model's answers differ: the test can tell them apart
    assert [got["verdict_probability"][i] for i in ok] == pytest.approx([want[i][1] for i in ok], abs=1e-6)
    assert all(0.5 <= p <= 1 for p in got["verdict_probability"].dropna())


@pytest.mark.slow
def test_probability_over_the_whole_vocabulary(tiny_judge):
    """logprobs=-1 reads both answers' tokens: the probability is exact, not the 0.5 bound."""
    df = reviews(1)
    got = df.llm.judge(INSTRUCTION, model=str(tiny_judge), logprobs=-1, **ENGINE)
    want = direct_judge(tiny_judge, df, logprobs=-1)
    assert got["verdict"].tolist() == [w[0] for w in want]
    assert got["verdict_probability"].tolist() == pytest.approx([w[1] for w in want], abs=1e-6)
    assert 0.5 < got["verdict_probability"][0] < 1


def test_verdict_probability_from_the_listed_tokens():
    def tokens(*pairs):
        return {i: {"logprob": lp, "decoded_token": t, "rank": i} for i, (t, lp) in enumerate(pairs)}

    # both answers listed ("T" and "True" begin True): exact over the two answers
    p = verdict_probability(
        tokens(("True", math.log(0.3)), ("T", math.log(0.1)), ("False", math.log(0.2)), ("x", math.log(0.4))), True
    )
    assert p == pytest.approx(0.4 / 0.6)
    assert verdict_probability(tokens(("False", math.log(0.2)), ("True", math.log(0.3))), False) == pytest.approx(0.4)
    # the other answer unlisted: counted at the least likely listed token, a lower bound
    assert verdict_probability(tokens(("True", math.log(0.5)), ("x", math.log(0.1))), True) == pytest.approx(0.5 / 0.6)
    # the answer itself below every listed token: no information
    assert verdict_probability(tokens(("x", math.log(0.5)), ("False", math.log(0.01))), False) == pytest.approx(0.5)
    assert verdict_probability(None, True) is None


def test_filter_keeps_the_true_rows_and_the_failed_ones_on_pandas_and_polars(tiny_judge):
    df = reviews(null_at=3)
    judged = df.llm.judge(INSTRUCTION, model=str(tiny_judge), **ENGINE)
    want = judged[judged["verdict"].fillna(False).astype(bool) | judged["llm_error"].notna()]["id"].tolist()
    assert 3 in want and 0 < len(want) < len(df)
    kept = df.llm.filter(INSTRUCTION, model=str(tiny_judge), **ENGINE)
    assert kept["id"].tolist() == want
    assert list(kept.columns) == ["id", "review", "label", "llm_error"]
    eager = pl.from_pandas(df).llm.filter(INSTRUCTION, model=str(tiny_judge), **ENGINE)
    lazy = pl.from_pandas(df).lazy().llm.filter(INSTRUCTION, model=str(tiny_judge), **ENGINE)
    assert isinstance(lazy, pl.LazyFrame)
    assert eager["id"].to_list() == lazy.collect()["id"].to_list() == want
    polars_judged = pl.from_pandas(df).llm.judge(INSTRUCTION, model=str(tiny_judge), **ENGINE)
    assert polars_judged["verdict"].to_list() == [None if v is pd.NA else bool(v) for v in judged["verdict"]]


@pytest.mark.slow
def test_explanations(tiny_judge):
    df = reviews(3)
    got = df.llm.judge(INSTRUCTION, model=str(tiny_judge), return_explanations=True, **ENGINE)
    want = direct_judge(tiny_judge, df, explanations=True)
    assert list(got.columns)[-3:] == ["verdict_probability", "explanation", "llm_error"]
    assert got["verdict"].tolist() == [w[0] for w in want]
    assert got["explanation"].tolist() == [w[2] for w in want]
    assert all(isinstance(e, str) and e for e in got["explanation"])


def test_prompt_puts_the_instruction_first_and_the_fields_last():
    prompt = semantic_prompt("Preamble.", "{review} of {product} is about shipping")
    assert prompt.system == "Preamble."
    assert prompt.template == ("[review] of [product] is about shipping\n\n[review]: {review}\n[product]: {product}")
    a = prompt.text({"review": "late", "product": "a lamp"})
    b = prompt.text({"review": "broken", "product": "a lamp"})
    fixed = "Preamble.\n\n[review] of [product] is about shipping\n\n[review]: "
    assert a.startswith(fixed) and b.startswith(fixed)  # rows share everything up to their own fields
    completion = semantic_prompt("Use {braces}.", "{q} holds", chat=False)
    assert completion.system is None and completion.text({"q": "x"}) == "Use {braces}.\n\n[q] holds\n\n[q]: x\nAnswer:"


def test_the_prefix_cache_serves_the_instruction_once(tiny_judge):
    """Every row after the first reads the fixed part (system message and instruction, three
    full blocks of 16 tokens or more) from the prefix cache."""
    from dfllm.worker.engine_cache import engines

    def hits() -> float:
        return sum(
            m.value
            for llm in engines()
            if llm.engine is not None
            for m in llm.get_metrics()
            if m.name == "dfllm_prefix_cache_hits" and m.labels["model_name"] == tiny_judge.name
        )

    df = reviews(8)
    df.llm.judge(INSTRUCTION, model=str(tiny_judge), **ENGINE)  # the engine exists, its counters count from here
    before = hits()
    df.assign(review=df["review"] + " (again)").llm.judge(INSTRUCTION, model=str(tiny_judge), **ENGINE)
    assert hits() - before >= 8 * 3 * 16


def test_chained_operators_keep_earlier_errors_and_columns(tiny_judge):
    df = reviews(4).assign(llm_error=["earlier failure", None, None, None], num_input_tokens=[1, 2, 3, 4])
    df.loc[1, "review"] = None
    got = df.llm.judge(INSTRUCTION, model=str(tiny_judge), **ENGINE)
    assert list(got.columns) == [
        "id",
        "review",
        "label",
        "num_input_tokens",
        "verdict",
        "verdict_probability",
        "llm_error",
    ]
    assert got["num_input_tokens"].tolist() == [1, 2, 3, 4]
    assert got["llm_error"].tolist()[:2] == ["earlier failure", "column 'review' is null"]
    assert got["llm_error"].isna().tolist()[2:] == [True, True]


def test_bad_calls_fail_before_any_work(tiny_judge):
    df = reviews(2)
    with pytest.raises(ValueError, match=r"column\(s\) \['text'\]"):
        df.llm.filter("{text} is late", model=str(tiny_judge))
    with pytest.raises(ValueError, match="names no column"):
        df.llm.judge("it is late", model=str(tiny_judge))
    with pytest.raises(ValueError, match="return_stats"):
        df.llm.judge(INSTRUCTION, model=str(tiny_judge), return_stats=True)
    with pytest.raises(ValueError, match="already exist"):
        df.assign(verdict=1).llm.judge(INSTRUCTION, model=str(tiny_judge))
    with pytest.raises(ValueError, match="logprobs"):
        df.llm.judge(INSTRUCTION, model=str(tiny_judge), logprobs=1)
    with pytest.raises(ValueError, match="unknown argument"):
        df.llm.judge(INSTRUCTION, model=str(tiny_judge), not_an_engine_argument=1)


# ---- Dask on a cluster of worker processes ----------------------------------------------------------------
@pytest.fixture(scope="module")
def client():
    with local_client(workers=2, threads=1) as c:
        yield c


@pytest.mark.slow
def test_dask_with_a_killed_worker_every_row_once(client, tiny_judge):
    df = reviews(12, null_at=5)
    want = df.llm.judge(
        INSTRUCTION, model=str(tiny_judge), return_explanations=True, max_explanation_tokens=16, **ENGINE
    )
    ddf = dd.from_pandas(df, npartitions=6, sort=False)
    lazy = ddf.llm.judge(
        INSTRUCTION, model=str(tiny_judge), return_explanations=True, max_explanation_tokens=16, **ENGINE
    )
    assert list(lazy._meta.columns) == list(want.columns)
    new = ["verdict", "verdict_probability", "explanation", "llm_error"]  # Dask makes the input's str columns string
    assert lazy._meta.dtypes[new].astype(str).tolist() == want.dtypes[new].astype(str).tolist()
    future = client.compute(lazy)
    kill_a_worker_mid_task(client, future, "llm-sem-judge")
    got = future.result(timeout=240)
    assert sorted(got["id"]) == list(range(12))  # every row exactly once
    got = got.sort_values("id").reset_index(drop=True)
    pd.testing.assert_series_equal(got["verdict"], want["verdict"], check_names=False)
    assert got["explanation"].tolist() == want["explanation"].tolist()
    assert got["llm_error"].tolist() == want["llm_error"].tolist()


@pytest.mark.slow
def test_dask_filter_then_extract_and_resumed_writes(client, tiny_judge, tmp_path):
    df = reviews(12, null_at=2)
    schema = {"negative": bool}
    want = df.llm.filter(INSTRUCTION, model=str(tiny_judge), **ENGINE).llm.extract(
        "{review}", schema, model=str(tiny_judge), **ENGINE
    )
    ddf = dd.from_pandas(df, npartitions=4, sort=False)
    chained = ddf.llm.filter(INSTRUCTION, model=str(tiny_judge), **ENGINE).llm.extract(
        "{review}", schema, model=str(tiny_judge), **ENGINE
    )
    got = chained.compute().sort_values("id")
    assert got["id"].tolist() == want["id"].tolist()
    assert got["negative"].tolist() == want["negative"].tolist()
    assert got["llm_error"].tolist() == want["llm_error"].tolist()
    for name, result in [
        ("judge", ddf.llm.judge(INSTRUCTION, model=str(tiny_judge), **ENGINE)),
        ("filter", ddf.llm.filter(INSTRUCTION, model=str(tiny_judge), **ENGINE)),
        ("extract", ddf.llm.extract("{review}", schema, model=str(tiny_judge), **ENGINE)),
    ]:
        out = tmp_path / name
        first = dfllm.write_parquet(result, str(out), progress=False)
        again = dfllm.write_parquet(result, str(out), resume=True, progress=False)
        assert (first.written, again.skipped, again.written) == (4, 4, 0), name
        back = pd.read_parquet(out).sort_values("id")
        if name == "filter":
            assert back["id"].tolist() == want["id"].tolist()
        else:
            assert back["id"].tolist() == list(range(12))
            assert first.rows == again.rows == 12


@pytest.mark.slow
def test_dask_cascade_on_the_cluster_equals_pandas(client, tiny_judge):
    df = reviews(48, null_at=7)
    cascade = dfllm.Cascade(
        proxy="embedding",
        recall_target=0.6,
        precision_target=0.6,
        failure_probability=0.3,
        min_sample=12,
        sample_fraction=0.25,
        seed=3,
    )
    want = df.llm.filter(INSTRUCTION, model=str(tiny_judge), cascade=cascade, **ENGINE)
    lazy = dd.from_pandas(df, npartitions=3, sort=False).llm.filter(
        INSTRUCTION, model=str(tiny_judge), cascade=cascade, **ENGINE
    )
    assert list(lazy._meta.columns) == list(want.columns) == ["id", "review", "label", "decided_by", "llm_error"]
    got = lazy.compute().sort_values("id")
    assert got["id"].tolist() == want["id"].tolist()
    assert got["decided_by"].tolist() == want["decided_by"].tolist()
    assert (want["decided_by"] == "proxy").any()
