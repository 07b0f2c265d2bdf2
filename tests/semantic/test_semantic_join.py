"""``.llm.join`` and ``.llm.sim_join`` against brute force with the same models.

The join's reference is the cross product judged pair by pair with ``dfllm.LLM.chat`` (the
operator's prompt, greedy, True/False); the blocked join must equal that judgment on the
pairs its embeddings keep, and its recall against the full cross product is printed and
bounded. ``sim_join`` is checked against ``LLM.embed`` and numpy's cosine top k.
"""

from __future__ import annotations

import dask.dataframe as dd
import numpy as np
import pandas as pd
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from semantic_data import reviews, two_answer_model

import dfllm  # noqa: F401  (registers .llm)
from dfllm import LLM, SamplingParams, StructuredOutputsParams
from dfllm.semantic.join import JOIN_PREAMBLE
from dfllm.semantic.prompts import semantic_prompt

ENGINE = {"max_model_len": 512, "kv_cache_memory_bytes": 2**24}
INSTRUCTION = "{review} is about {topic}"
TOPICS = pd.DataFrame(
    {"topic_id": [10, 11, 12, 13], "topic": ["shipping or delivery", "sound quality", "the price", "durability"]}
)
ANSWER = "Does the statement hold for these two records? Answer True or False."


def brute_force(model, left: pd.DataFrame, right: pd.DataFrame) -> set[tuple[int, int]]:
    """``(id, topic_id)`` of every pair of the cross product the model judges True, pair by pair."""
    llm = LLM(str(model), **ENGINE)
    prompt = semantic_prompt(
        JOIN_PREAMBLE,
        "{__l_review} is about {__r_topic}",
        answer=ANSWER,
        names={"__l_review": "review", "__r_topic": "topic"},
    )
    sp = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["True", "False"])
    )
    pairs = [(lrow, rrow) for lrow in left.to_dict("records") for rrow in right.to_dict("records")]
    convs = [
        [
            {"role": "system", "content": prompt.system},
            {"role": "user", "content": prompt.template.format(__l_review=lrow["review"], __r_topic=rrow["topic"])},
        ]
        for lrow, rrow in pairs
    ]  # one request per pair
    outs = llm.chat(convs, sp, use_tqdm=False)
    return {(lrow["id"], rrow["topic_id"]) for (lrow, rrow), o in zip(pairs, outs) if o.outputs[0].text == "True"}


def pairs_of(df: pd.DataFrame) -> set[tuple[int, int]]:
    ok = df[df.llm_error.isna()]
    return {(int(a), int(b)) for a, b in zip(ok["id"], ok["topic_id"])}


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return brute_force(tiny_llama, reviews(), TOPICS)


@pytest.mark.slow
def test_join_equals_cross_product(tiny_llama, expected):
    left = reviews()
    out, cost = left.llm.join(TOPICS, INSTRUCTION, model=str(tiny_llama), return_stats=True, **ENGINE)
    assert list(out.columns) == ["id", "review", "label", "topic_id", "topic", "llm_error"]
    assert pairs_of(out) == expected and out.llm_error.isna().all()
    assert cost.counts == {"cross_product": 32, "pairs_judged": 32} and cost.engine_calls == 1
    print(f"join: {len(expected)} of 32 pairs match; 32 judged in 1 engine call, {cost.input_tokens} prompt tokens")

    lazy = dd.from_pandas(left, npartitions=3).llm.join(TOPICS, INSTRUCTION, model=str(tiny_llama), **ENGINE)
    assert list(lazy.columns) == list(out.columns)
    assert pairs_of(lazy.compute()) == expected

    polars = pl.from_pandas(left).llm.join(pl.from_pandas(TOPICS), INSTRUCTION, model=str(tiny_llama), **ENGINE)
    assert isinstance(polars, pl.DataFrame) and pairs_of(polars.to_pandas()) == expected


@pytest.mark.slow
def test_blocked_join_recall(tiny_llama, expected):
    left = reviews()
    out, cost = left.llm.join(TOPICS, INSTRUCTION, model=str(tiny_llama), block_k=3, return_stats=True, **ENGINE)
    # the pairs blocking keeps: each review's 3 nearest topics by the records' MiniLM embeddings
    embedder = LLM("all-minilm-l6-v2")
    lv = np.array(
        [o.outputs.embedding for o in embedder.embed([f"[review]: {r}" for r in left.review], use_tqdm=False)]
    )
    rv = np.array(
        [o.outputs.embedding for o in embedder.embed([f"[topic]: {t}" for t in TOPICS.topic], use_tqdm=False)]
    )
    sims = (lv / np.linalg.norm(lv, axis=1, keepdims=True)) @ (rv / np.linalg.norm(rv, axis=1, keepdims=True)).T
    kept = {(int(left.id[i]), int(TOPICS.topic_id[j])) for i in range(len(left)) for j in np.argsort(-sims[i])[:3]}
    assert pairs_of(out) == expected & kept  # blocking drops pairs, never changes a judgment
    assert cost.counts["pairs_judged"] == 24 and cost.counts["cross_product"] == 32
    found = {(a, b): s for a, b, s in zip(out["id"], out["topic_id"], out["similarity"])}
    for (a, b), s in found.items():
        i, j = int(np.flatnonzero(left.id == a)[0]), int(np.flatnonzero(TOPICS.topic_id == b)[0])
        assert s == pytest.approx(sims[i, j], abs=1e-4)
    recall = len(pairs_of(out) & expected) / len(expected) if expected else 1.0
    print(
        f"blocked join (block_k=3 of 4): 24 of 32 pairs judged, recall {recall:.2f} against the cross product "
        f"({len(pairs_of(out) & expected)} of {len(expected)} matches)"
    )
    assert recall >= 0.5


def test_join_reports_rows_and_pairs_it_cannot_judge(tiny_llama):
    left = reviews(3, null_at=1)
    left.loc[2, "review"] = "word " * 600  # every pair of this row is past max_model_len
    out = left.llm.join(TOPICS, INSTRUCTION, model=str(tiny_llama), **ENGINE)
    bad = out[out.llm_error.notna()]
    null_row = bad[bad.id == 1]
    assert len(null_row) == 1 and null_row.topic_id.isna().all()
    long_rows = bad[bad.id == 2]
    assert sorted(long_rows.topic_id.astype(int)) == [10, 11, 12, 13]  # each failed pair, never dropped as False
    assert all("could not be judged" in e for e in long_rows.llm_error)
    with pytest.raises(ValueError, match="must name a field of each frame"):
        left.llm.join(TOPICS, "{review} is long", model=str(tiny_llama))
    with pytest.raises(ValueError, match=r"\{id:left\} or \{id:right\}"):
        left.llm.join(TOPICS.rename(columns={"topic_id": "id"}), "{id} is {topic} {review}", model=str(tiny_llama))


def test_sim_join_equals_knn():
    left, right = reviews(), TOPICS
    embedder = LLM("all-minilm-l6-v2")
    lv = np.array([o.outputs.embedding for o in embedder.embed(list(left.review), use_tqdm=False)])
    rv = np.array([o.outputs.embedding for o in embedder.embed(list(right.topic), use_tqdm=False)])
    sims = (lv / np.linalg.norm(lv, axis=1, keepdims=True)) @ (rv / np.linalg.norm(rv, axis=1, keepdims=True)).T
    expected = [(int(left.id[i]), int(right.topic_id[j])) for i in range(len(left)) for j in np.argsort(-sims[i])[:2]]
    out, cost = left.llm.sim_join(right, "review", "topic", 2, return_stats=True)
    assert list(zip(out["id"], out["topic_id"])) == expected
    assert np.allclose(
        out.similarity.astype(float),
        [sims[i // 2, np.argsort(-sims[i // 2])[i % 2]] for i in range(len(out))],
        atol=1e-4,
    )
    assert cost.engine_calls == 2 and cost.requests == len(left) + len(right)
    lazy = dd.from_pandas(left, npartitions=3).llm.sim_join(dd.from_pandas(right, npartitions=2), "review", "topic", 2)
    assert sorted(zip(lazy.compute()["id"], lazy.compute()["topic_id"])) == sorted(expected)


@pytest.mark.slow
def test_dask_join_with_a_killed_worker_every_pair_once(tiny_llama):
    from helpers import kill_a_worker_mid_task, local_client

    left = reviews(16, null_at=5)
    want = left.llm.join(TOPICS, INSTRUCTION, model=str(tiny_llama), **ENGINE)
    with local_client(workers=2, threads=1) as client:
        lazy = dd.from_pandas(left, npartitions=8, sort=False).llm.join(
            TOPICS, INSTRUCTION, model=str(tiny_llama), **ENGINE
        )
        future = client.compute(lazy)
        kill_a_worker_mid_task(client, future, "llm-sem-join")
        got = future.result(timeout=240)
    key = ["id", "topic_id"]
    assert not got.duplicated(key).any()  # every pair exactly once
    assert pairs_of(got) == pairs_of(want)
    failed = got[got.llm_error.notna()]
    assert failed["id"].tolist() == [5] and failed["topic_id"].isna().all()  # the null row, once


@pytest.fixture(scope="module")
def true_false_model(tmp_path_factory, smollm2_dir):
    """A tiny random model whose verdict probabilities are informative ("True" and "False" lead
    its output layer; see :func:`semantic_data.two_answer_model`)."""
    return two_answer_model(tmp_path_factory.mktemp("join_tf"), smollm2_dir, "True", "False", seed=3)


@pytest.mark.slow
def test_join_with_a_cascade(true_false_model):
    """``cascade=``: the pairs go through ``.llm.judge(..., cascade=)``; those the large model
    decided match its judgment of every pair, and the figures say how many reached it. The
    proxy is the large model itself (a proxy that agrees with it), so the cascade can be sure of
    most pairs from a sample."""
    tiny_llama = true_false_model
    left = reviews(24)
    pairs = left.merge(TOPICS, how="cross")
    full = pairs.llm.judge("{review} is about {topic}", model=str(tiny_llama), **ENGINE)
    truth = {(int(a), int(b)) for a, b, v in zip(full["id"], full["topic_id"], full["verdict"]) if v}
    cascade = dfllm.Cascade(
        proxy="model",
        proxy_model=str(tiny_llama),
        recall_target=0.6,
        precision_target=0.6,
        failure_probability=0.5,
        min_sample=48,
        sample_fraction=0.5,
        proxy_kwargs=ENGINE,
    )
    out, cost = left.llm.join(TOPICS, INSTRUCTION, model=str(tiny_llama), cascade=cascade, return_stats=True, **ENGINE)
    assert list(out.columns) == ["id", "review", "label", "topic_id", "topic", "decided_by", "llm_error"]
    stats = cost.cascade
    assert stats.rows == 96 and cost.counts["large_model_pairs"] == stats.large_model_rows < 96
    by_model = out[out.decided_by == "model"]
    assert {(int(a), int(b)) for a, b in zip(by_model["id"], by_model["topic_id"])} <= truth
    got = pairs_of(out)
    recall = len(got & truth) / max(len(truth), 1)
    precision = len(got & truth) / max(len(got), 1)
    print(
        f"join cascade: {stats.large_model_rows} of 96 pairs reached the large model; recall {recall:.2f}, "
        f"precision {precision:.2f} against judging every pair (estimated {stats.estimated_recall:.2f}, "
        f"{stats.estimated_precision:.2f})"
    )
    assert recall >= 0.6 and precision >= 0.6
    with pytest.raises(ValueError, match="runs on pandas and Polars"):
        dd.from_pandas(left, npartitions=2).llm.join(TOPICS, INSTRUCTION, model=str(tiny_llama), cascade=cascade)


HOSTILE = ["", "   ", "\ud800 lone", b"\xff\xfe", ["x"], {"a": 1}, np.array([1.0]), 10**5000]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_row_whose_field_no_prompt_can_hold_comes_out_once(tiny_llama, data):
    """Unblocked and blocked: a left or right row whose field the pair's prompt cannot hold (empty,
    a lone surrogate, invalid UTF-8, a list...) is one row of the result with its error naming
    the column, not one failed pair per row of the other side; every good pair is judged."""

    def with_value(frame: pd.DataFrame, column: str, side: str) -> tuple[pd.DataFrame, int]:
        at = data.draw(st.integers(0, len(frame) - 1), label=f"{side} row")
        values = frame[column].tolist()
        values[at] = data.draw(st.sampled_from(HOSTILE), label=f"{side} value")
        return frame.assign(**{column: pd.Series(values, index=frame.index, dtype=object)}), at

    left, bad_left = with_value(reviews(3), "review", "left")
    right, bad_right = with_value(TOPICS.iloc[:3], "topic", "right")
    blocked = data.draw(st.booleans(), label="blocked")
    out = left.llm.join(right, INSTRUCTION, model=str(tiny_llama), block_k=3 if blocked else None, **ENGINE)
    lrow, rrow = out[out.id == bad_left], out[out.topic_id == right.topic_id.iloc[bad_right]]
    # named by its column, or (blocked: the embedding's error comes first) by its template "[review]: {review}"
    assert len(lrow) == 1 and lrow.topic_id.isna().all() and "review" in lrow.llm_error.iloc[0]
    assert len(rrow) == 1 and rrow.id.isna().all() and "topic" in rrow.llm_error.iloc[0]
    judged = out[out.id.notna() & out.topic_id.notna()]
    assert judged.llm_error.isna().all() and len(judged) <= 4  # the good pairs, judged True
