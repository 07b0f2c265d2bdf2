"""``.llm.dedup`` against brute-force pairwise similarity components, and ``.llm.agg``
against the same fold computed directly with ``dfllm.LLM`` (pandas, and Dask's tree
reduction over several partitions)."""

from __future__ import annotations

import dask.dataframe as dd
import numpy as np
import pandas as pd
import polars as pl
import pytest
from semantic_data import reviews

import dfllm  # noqa: F401  (registers .llm)
from dfllm import LLM, SamplingParams, StructuredOutputsParams
from dfllm.semantic.agg import AGG_PREAMBLE, FOLD_PREAMBLE
from dfllm.semantic.dedup import DEDUP_PREAMBLE, DEFAULT_CONFIRM
from dfllm.semantic.prompts import semantic_prompt

ENGINE = {"max_model_len": 512, "kv_cache_memory_bytes": 2**24}
TEXTS = [
    "My parcel arrived two weeks late.",
    "The headphones have great sound and deep bass.",
    "My parcel arrived two weeks late!",
    "Way too expensive for what you get.",
    "My package arrived two weeks late.",
    "Great sound and deep bass on these headphones.",
    "The battery died after a week.",
    "Far too expensive for what you get.",
]
THRESHOLD = 0.8


def components(n: int, links: list[tuple[int, int]]) -> list[int]:
    """Each node's component, named by its smallest member (breadth-first search)."""
    adj: dict[int, set[int]] = {i: set() for i in range(n)}
    for a, b in links:
        adj[a].add(b)
        adj[b].add(a)
    label = [-1] * n
    for s in range(n):
        if label[s] < 0:
            stack, label[s] = [s], s
            while stack:
                for y in adj[stack.pop()]:
                    if label[y] < 0:
                        label[y] = s
                        stack.append(y)
    return label


@pytest.fixture(scope="module")
def similar_pairs():
    vecs = np.array([o.outputs.embedding for o in LLM("all-minilm-l6-v2").embed(TEXTS, use_tqdm=False)])
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    sims = vecs @ vecs.T
    upper = sims[np.triu_indices(len(TEXTS), 1)]
    assert np.abs(upper - THRESHOLD).min() > 0.02  # no pair on the edge of the threshold
    return [(i, j) for i in range(len(TEXTS)) for j in range(i + 1, len(TEXTS)) if sims[i, j] >= THRESHOLD]


def test_dedup_equals_similarity_components(similar_pairs):
    df = pd.DataFrame({"text": TEXTS, "n": range(len(TEXTS))})
    expected = components(len(TEXTS), similar_pairs)
    assert len(set(expected)) < len(TEXTS)  # there are duplicates to find
    out, cost = df.llm.dedup("text", threshold=THRESHOLD, return_stats=True)
    assert out.cluster_id.tolist() == expected
    assert out.is_representative.tolist() == [c == i for i, c in enumerate(expected)]
    assert out.llm_error.isna().all() and cost.counts["candidate_pairs"] == len(similar_pairs)
    print(
        f"dedup: {len(TEXTS)} rows, {len(similar_pairs)} pairs above {THRESHOLD}, {len(set(expected))} clusters; "
        f"{cost.engine_calls} engine call, {cost.requests} texts embedded"
    )

    lazy = dd.from_pandas(df, npartitions=3).llm.dedup("text", threshold=THRESHOLD)
    assert list(lazy.columns) == ["text", "n", "cluster_id", "is_representative", "llm_error"]
    assert lazy.compute().cluster_id.tolist() == expected
    polars = pl.from_pandas(df).llm.dedup("text", threshold=THRESHOLD)
    assert polars["cluster_id"].to_list() == expected

    with_null = pd.concat([df, pd.DataFrame({"text": [None], "n": [99]})], ignore_index=True)
    out = with_null.llm.dedup("text", threshold=THRESHOLD)
    assert out.cluster_id.tolist()[:-1] == expected and pd.isna(out.cluster_id.iloc[-1])
    assert "'text' is null" in out.llm_error.iloc[-1] and len(out) == len(with_null)


@pytest.mark.slow
def test_dedup_confirmed_by_the_model(tiny_llama, similar_pairs):
    llm = LLM(str(tiny_llama), **ENGINE)
    prompt = semantic_prompt(
        DEDUP_PREAMBLE,
        DEFAULT_CONFIRM,
        {"A": "a", "B": "b"},
        answer="Does the statement hold for A and B? Answer True or False.",
    )
    sp = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["True", "False"])
    )
    convs = [
        [
            {"role": "system", "content": prompt.system},
            {"role": "user", "content": prompt.template.format(a=TEXTS[i], b=TEXTS[j])},
        ]
        for i, j in similar_pairs
    ]
    confirmed = [p for p, o in zip(similar_pairs, llm.chat(convs, sp, use_tqdm=False)) if o.outputs[0].text == "True"]
    df = pd.DataFrame({"text": TEXTS})
    out, cost = df.llm.dedup(
        "text", threshold=THRESHOLD, confirm=True, model=str(tiny_llama), return_stats=True, **ENGINE
    )
    assert out.cluster_id.tolist() == components(len(TEXTS), confirmed)
    assert cost.counts["pairs_judged"] == len(similar_pairs)
    print(f"dedup confirmed: {len(confirmed)} of {len(similar_pairs)} candidate pairs confirmed by the model")


def direct_summary(llm: LLM, preamble: str, label: str, instruction: str, texts: list[str], max_tokens: int) -> str:
    prompt = semantic_prompt(preamble, instruction, {label: "body"})
    msgs = [
        {"role": "system", "content": prompt.system},
        {"role": "user", "content": prompt.template.format(body="\n\n".join(texts))},
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return llm.chat(msgs, sp, use_tqdm=False)[0].outputs[0].text.strip()


AGG = "Summarise the complaints in {review}"


@pytest.mark.slow
def test_agg_dask_tree_equals_direct_fold(tiny_llama):
    df = reviews()
    llm = LLM(str(tiny_llama), **ENGINE)
    parts = [df.iloc[0:3], df.iloc[3:6], df.iloc[6:8]]
    partials = [
        direct_summary(llm, AGG_PREAMBLE, "records", AGG, [f"[review]: {r}" for r in p.review], 8) for p in parts
    ]
    expected = direct_summary(llm, FOLD_PREAMBLE, "partial summaries", AGG, partials, 8)
    ddf = dd.from_pandas(df, npartitions=3)
    assert [len(p) for p in ddf.partitions] == [3, 3, 2]
    lazy = ddf.llm.agg(AGG, model=str(tiny_llama), max_tokens=8, **ENGINE)
    assert list(lazy.columns) == ["summary", "llm_error"]
    out = lazy.compute()
    assert out.summary.tolist() == [expected] and out.llm_error.isna().all()

    by = df.llm.agg(AGG, by="label", model=str(tiny_llama), max_tokens=8, **ENGINE)
    assert by.label.tolist() == ["price", "quality", "shipping"]
    for label, summary in zip(by.label, by.summary):
        rows = [f"[review]: {r}" for r in df.review[df.label == label]]
        assert summary == direct_summary(llm, AGG_PREAMBLE, "records", AGG, rows, 8)


def test_agg_folds_within_max_model_len(tiny_llama):
    df = reviews(24, null_at=5)
    out, cost = df.llm.agg(
        AGG, model=str(tiny_llama), max_tokens=8, return_stats=True, max_model_len=192, kv_cache_memory_bytes=2**24
    )
    assert cost.counts["summaries"] > 3 and cost.engine_calls >= 2  # several chunks, then at least one fold
    assert isinstance(out.summary.iloc[0], str) and out.summary.iloc[0]
    assert out.llm_error.iloc[0] == "the row of index 5 was left out: its field 'review' is null"
    assert cost.input_tokens / cost.requests <= 192 - 8
    print(
        f"agg: 23 rows in {cost.counts['summaries']} summaries over {cost.engine_calls} engine calls "
        f"(max_model_len=192), {cost.input_tokens} prompt tokens"
    )
    with pytest.raises(ValueError, match="raise max_model_len"):
        df.llm.agg(AGG, model=str(tiny_llama), max_tokens=8, max_model_len=64)


def test_candidate_links_blockwise_equal_the_full_matrix():
    from dfllm.semantic.dedup import candidate_links

    rng = np.random.default_rng(0)
    vecs = rng.normal(size=(50, 4)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    ok = np.ones(50, bool)
    ok[7] = False  # a row that failed is never linked
    sims = vecs @ vecs.T
    want = [(i, j) for i in range(50) for j in range(i + 1, 50) if ok[i] and ok[j] and sims[i, j] >= 0.8]
    assert candidate_links(vecs, ok, 0.8, block=7) == candidate_links(vecs, ok, 0.8) == want and want
