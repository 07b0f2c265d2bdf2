"""Cascades: on a labelled synthetic task (a proxy whose scores carry known noise, the labels
as the large model) the achieved recall and precision meet their targets in at least
``1 - failure_probability`` of repeated runs, while most rows skip the large model; on real
models (an embedding proxy, a tiny Llama as the large model) every row the large model
decided has its own per-row verdict, the proxy's rows follow the learned thresholds, and the
share sent to the large model is reported, equally on pandas and Polars (Dask, on a cluster:
tests/semantic/test_semantic_filter.py).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import polars as pl
import pytest
from semantic_data import ENGINE, INSTRUCTION, reviews

import dfllm
from dfllm.semantic.cascade import Cascade, run_cascade

pytestmark = pytest.mark.timeout(300)


def synthetic(seed: int, n: int = 2000, prevalence: float = 0.3, separation: float = 2.5, noise: float = 1.5):
    """Labels, and a proxy's scores: sigmoid(+-separation + normal noise)."""
    rng = np.random.default_rng(seed)
    y = rng.random(n) < prevalence
    return y, 1 / (1 + np.exp(-(separation * (2 * y - 1) + rng.normal(0, noise, n))))


def achieved(y: np.ndarray, scores: np.ndarray, cascade: Cascade):
    sampled, band, decisions, stats = run_cascade(scores, lambda idx: y[idx].astype(float), cascade)
    pred = decisions.copy()
    pred[sampled], pred[band] = y[sampled], y[band]  # the large model's rows: its answers
    tp = int((pred & y).sum())
    return tp / y.sum(), tp / max(int(pred.sum()), 1), stats


@pytest.mark.slow
@pytest.mark.parametrize(
    "recall, precision, delta, most_share", [(0.9, 0.9, 0.2, 0.3), (0.95, 0.8, 0.1, 0.4), (0.8, 0.95, 0.2, 0.3)]
)
def test_targets_hold_at_the_stated_rate(recall, precision, delta, most_share):
    runs, met, shares = 100, 0, []
    for k in range(runs):
        y, s = synthetic(k)
        cascade = Cascade(
            proxy="embedding",
            recall_target=recall,
            precision_target=precision,
            failure_probability=delta,
            seed=10_000 + k,
        )
        r, p, stats = achieved(y, s, cascade)
        met += r >= recall and p >= precision
        shares.append(stats.large_model_share)
        assert stats.large_model_rows == stats.sampled_rows + stats.band_rows
    print(
        f"targets {recall}/{precision} at 1-{delta}: met in {met}/{runs} runs, mean share to the large model "
        f"{np.mean(shares):.3f}"
    )
    assert met / runs >= 1 - delta
    assert np.mean(shares) <= most_share  # the proxy decides most rows: the cascade saves work


def test_a_perfect_proxy_sends_little_and_a_useless_one_almost_everything():
    y, _ = synthetic(0)
    r, p, stats = achieved(y, y.astype(float) * 0.8 + 0.1, Cascade(proxy="embedding", seed=1))
    assert (r, p) == (1.0, 1.0) and stats.band_rows == 0 and stats.large_model_share <= 0.11
    met, shares = 0, []
    for k in range(50):  # scores that say nothing: the targets still hold, by sending nearly every row on
        y, _ = synthetic(k)
        r, p, stats = achieved(y, np.random.default_rng(500 + k).random(len(y)), Cascade(proxy="embedding", seed=k))
        met += r >= 0.9 and p >= 0.9
        shares.append(stats.large_model_share)
    assert met / 50 >= 0.8 and np.mean(shares) > 0.85


@pytest.mark.slow
def test_real_models(tiny_judge):
    df = reviews(48, null_at=7)
    cascade = Cascade(
        proxy="embedding",
        recall_target=0.6,
        precision_target=0.6,
        failure_probability=0.3,
        min_sample=12,
        sample_fraction=0.25,
        seed=3,
    )
    got, stats = df.llm.judge(INSTRUCTION, model=str(tiny_judge), cascade=cascade, return_stats=True, **ENGINE)
    plain = df.llm.judge(INSTRUCTION, model=str(tiny_judge), **ENGINE)
    assert list(got.columns) == ["id", "review", "label", "verdict", "verdict_probability", "decided_by", "llm_error"]
    assert got.attrs["dfllm_cascade"] == stats.as_dict()
    by_model = got["decided_by"] == "model"
    assert int(by_model.sum()) == stats.large_model_rows < len(df)  # the proxy decided some rows
    assert got["verdict"][by_model].tolist() == plain["verdict"][by_model].tolist()
    assert got["llm_error"].tolist() == plain["llm_error"].tolist()  # the null row went to the large model
    proxy = got[~by_model]
    true = proxy["verdict"].astype(bool)
    assert (proxy["verdict_probability"][true] >= stats.tau_pos).all()
    assert (1 - proxy["verdict_probability"][~true] <= stats.tau_neg).all()
    truth, pred = plain["verdict"].fillna(False).astype(bool), got["verdict"].fillna(False).astype(bool)
    tp = int((truth & pred).sum())
    print(
        f"real models: {stats.large_model_rows}/{stats.rows} rows to the large model; against judging every "
        f"row, recall {tp / max(int(truth.sum()), 1):.2f}, precision {tp / max(int(pred.sum()), 1):.2f}"
    )

    kept = df.llm.filter(INSTRUCTION, model=str(tiny_judge), cascade=cascade, **ENGINE)
    true_or_failed = got["verdict"].fillna(False).astype(bool) | got["llm_error"].notna()
    assert kept["id"].tolist() == got[true_or_failed]["id"].tolist()
    # Dask, on a LocalCluster of worker processes: tests/semantic/test_semantic_filter.py
    polars = pl.from_pandas(df).lazy().llm.judge(INSTRUCTION, model=str(tiny_judge), cascade=cascade, **ENGINE)
    assert polars.collect()["verdict"].to_list() == [None if v is pd.NA else bool(v) for v in got["verdict"]]


@pytest.mark.slow
def test_a_smaller_model_as_the_proxy(tiny_judge, tiny_llama):
    df = reviews(16)
    cascade = Cascade(proxy="model", proxy_model=str(tiny_llama), min_sample=4, seed=0)
    got, stats = df.llm.judge(INSTRUCTION, model=str(tiny_judge), cascade=cascade, return_stats=True, **ENGINE)
    assert stats.proxy == "model" and stats.rows == 16 and 0 < stats.large_model_share <= 1
    assert int((got["decided_by"] == "model").sum()) == stats.large_model_rows
    assert got["verdict"].notna().all()


def test_bad_cascades_fail_before_any_work(tiny_judge):
    with pytest.raises(ValueError, match="proxy_model"):
        Cascade(proxy="model")
    with pytest.raises(ValueError, match="recall_target"):
        Cascade(proxy="embedding", recall_target=1.5)
    with pytest.raises(ValueError, match="on_error"):
        reviews(2).llm.judge(INSTRUCTION, model=str(tiny_judge), cascade=Cascade(proxy="embedding"), on_error="raise")
    with pytest.raises(ValueError, match="dfllm.Cascade"):
        reviews(2).llm.filter(INSTRUCTION, model=str(tiny_judge), cascade={"proxy": "embedding"})
    with pytest.raises(ValueError, match="decided_by"):
        reviews(2).assign(decided_by=1).llm.judge(
            INSTRUCTION, model=str(tiny_judge), cascade=Cascade(proxy="embedding")
        )
    assert dfllm.Cascade is Cascade
    empty, stats = reviews(0).llm.judge(
        INSTRUCTION, model=str(tiny_judge), cascade=Cascade(proxy="embedding"), return_stats=True, **ENGINE
    )
    assert len(empty) == 0 and "decided_by" in empty.columns and stats.rows == stats.large_model_rows == 0
