"""``.llm.topk`` against a full sort by the same comparator, computed pair by pair.

The comparator is the model's greedy A/B answer for each pair (the earlier row shown as A),
judged here directly with ``.llm.chat`` on every pair of a pool of rows. A pairwise LLM
comparator need not be transitive, and only for a transitive one is "the top k" defined, so
the test picks (deterministically) a table of 8 rows from the pool on which it is, and whose
order is not the rows' order: then quickselect, the heap, the Dask merge and the seeded
variant must all give the full sort's first k, with fewer comparisons than the 28 pairs.
"""

from __future__ import annotations

import functools
import itertools
import random

import dask.dataframe as dd
import pandas as pd
import polars as pl
import pytest
from semantic_data import two_answer_model

import dfllm  # noqa: F401  (registers .llm)
from dfllm import LLM, SamplingParams, StructuredOutputsParams
from dfllm.semantic.join import first_choice_probability
from dfllm.semantic.prompts import semantic_prompt
from dfllm.semantic.topk import AB, TOPK_ANSWER, TOPK_PREAMBLE

from helpers import build_tiny_model

INSTRUCTION = "{fruit} is the sweetest fruit"
POOL = [
    "apple",
    "banana",
    "cherry",
    "grape",
    "lemon",
    "mango",
    "peach",
    "plum",
    "kiwi",
    "melon",
    "fig",
    "lime",
    "pear",
    "date",
    "guava",
    "papaya",
    "apricot",
    "orange",
]
K = 3


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory, smollm2_dir):
    return str(build_tiny_model(tmp_path_factory.mktemp("topk"), smollm2_dir, seed=2))


def direct_judgments(model: str, texts: list[str]) -> dict[tuple[int, int], bool]:
    """For every pair i < j: whether the model answers A (row i better) when asked directly."""
    record = {"A.fruit": "a", "B.fruit": "b"}
    prompt = semantic_prompt(TOPK_PREAMBLE, INSTRUCTION, record, answer=TOPK_ANSWER)
    pairs = list(itertools.combinations(range(len(texts)), 2))
    frame = pd.DataFrame({"a": [texts[i] for i, _ in pairs], "b": [texts[j] for _, j in pairs]})
    out = frame.llm.chat(
        prompt.template,
        system=prompt.system,
        model=model,
        choice=list(AB),
        sampling_params={"temperature": 0.0, "max_tokens": 8},
    )
    assert out.llm_error.isna().all()
    return {p: a == "A" for p, a in zip(pairs, out.generated_text)}


def pick_table(wins: dict[tuple[int, int], bool], pool: list[str], size: int = 8) -> tuple[pd.DataFrame, list]:
    """A table of ``size`` rows of ``pool`` (in pool order) on which the comparator ``wins``
    (pair i < j -> whether i beats j) is a total order that is not the rows' order, and the
    first K of that order."""

    def better(x: int, y: int) -> bool:
        return wins[(x, y)] if x < y else not wins[(y, x)]

    rng, best, pairs = random.Random(0), None, size * (size - 1) // 2
    for _ in range(3000):
        sub = sorted(rng.sample(range(len(pool)), size))
        if any(better(a, b) and better(b, c) and not better(a, c) for a, b, c in itertools.permutations(sub, 3)):
            continue
        mixed = min(s := sum(wins[p] for p in itertools.combinations(sub, 2)), pairs - s)
        if best is None or mixed > best[0]:
            best = (mixed, sub)
    assert best is not None and best[0] >= 3, f"no transitive, non-trivial table of {size} rows in the pool"
    sub = best[1]
    order = sorted(sub, key=functools.cmp_to_key(lambda x, y: -1 if better(x, y) else 1))
    texts = [pool[i] for i in sub]
    ranked = [pool[i] for i in order]
    assert ranked[:K] != texts[:K] and ranked[:K] != texts[::-1][:K]  # not the rows' order either way
    return pd.DataFrame({"fruit": texts, "id": range(len(texts))}), ranked[:K]


@pytest.fixture(scope="module")
def table(judge_model):
    """A table of 8 rows on which the comparator is a total order, and the order it gives."""
    return pick_table(direct_judgments(judge_model, POOL), POOL)


@pytest.mark.slow
def test_topk_equals_full_sort(judge_model, table):
    df, expected = table
    out, cost = df.llm.topk(INSTRUCTION, K, model=judge_model, return_stats=True)
    assert out.fruit.tolist() == expected
    assert out["rank"].tolist() == [1, 2, 3] and out.llm_error.isna().all()
    assert list(out.index) == [df.index[df.fruit == f][0] for f in expected]  # the rows keep their index
    n = cost.counts["comparisons"]
    print(
        f"topk quick: {n} comparisons in {cost.engine_calls} engine calls, {cost.input_tokens} prompt tokens "
        f"(a full sort's tournament: 28)"
    )
    assert n < 28 and cost.engine_calls < n and cost.requests == n

    heap, hcost = df.llm.topk(INSTRUCTION, K, model=judge_model, method="heap", return_stats=True)
    assert heap.fruit.tolist() == expected
    assert hcost.counts["comparisons"] == hcost.engine_calls  # one comparison per engine call

    seeded, scost = df.llm.topk(INSTRUCTION, K, model=judge_model, seed_embeddings=True, return_stats=True)
    assert seeded.fruit.tolist() == expected and scost.counts["comparisons"] < 28

    polars = pl.from_pandas(df).llm.topk(INSTRUCTION, K, model=judge_model)
    assert isinstance(polars, pl.DataFrame) and polars["fruit"].to_list() == expected


def test_topk_dask_merges_partition_candidates(judge_model, table):
    df, expected = table
    ddf = dd.from_pandas(df, npartitions=3)
    lazy = ddf.llm.topk(INSTRUCTION, K, model=judge_model)
    assert list(lazy.columns) == ["fruit", "id", "rank", "llm_error"]
    out = lazy.compute()
    assert out.fruit.tolist() == expected and out["rank"].tolist() == [1, 2, 3]
    assert str(out["rank"].dtype) == str(lazy._meta["rank"].dtype)


def test_topk_reports_rows_it_cannot_rank(judge_model, table):
    df, expected = table
    bad = pd.concat([df, pd.DataFrame({"fruit": [None], "id": [99]})], ignore_index=True)
    out = bad.llm.topk(INSTRUCTION, K, model=judge_model)
    assert out.fruit.tolist()[:K] == expected
    assert len(out) == K + 1 and pd.isna(out["rank"].iloc[-1]) and "'fruit' is null" in out.llm_error.iloc[-1]
    with pytest.raises(ValueError, match="not in the frame"):
        df.llm.topk("{colour} is the best", 2, model=judge_model)
    with pytest.raises(ValueError, match="k must be a positive integer"):
        df.llm.topk(INSTRUCTION, 0, model=judge_model)
    with pytest.raises(ValueError, match="method must be one of"):
        df.llm.topk(INSTRUCTION, 2, model=judge_model, method="bubble")


@pytest.fixture(scope="module")
def ab_model(tmp_path_factory, smollm2_dir):
    """A tiny random model whose "A"/"B" answers lead its output layer
    (:func:`semantic_data.two_answer_model`)."""
    return two_answer_model(tmp_path_factory.mktemp("topk_ab"), smollm2_dir, "A", "B", seed=2)


@pytest.mark.slow
def test_topk_both_orders_equals_full_sort(ab_model):
    """``both_orders``: each pair asked both ways; i beats j when the probability of A (from the
    answer token's top-20 log-probabilities) is higher with i shown first. The reference reads
    the same probabilities from ``LLM.chat`` one request per ordered pair."""
    pool = POOL[:12]
    judge_model = ab_model
    llm = LLM(judge_model, max_model_len=512, kv_cache_memory_bytes=2**24)
    prompt = semantic_prompt(TOPK_PREAMBLE, INSTRUCTION, {"A.fruit": "a", "B.fruit": "b"}, answer=TOPK_ANSWER)
    sp = SamplingParams(
        temperature=0.0, max_tokens=8, logprobs=20, structured_outputs=StructuredOutputsParams(choice=list(AB))
    )
    ordered = list(itertools.permutations(range(len(pool)), 2))
    convs = [
        [
            {"role": "system", "content": prompt.system},
            {"role": "user", "content": prompt.template.format(a=pool[i], b=pool[j])},
        ]
        for i, j in ordered
    ]
    p_a = {}
    for (i, j), out in zip(ordered, llm.chat(convs, sp, use_tqdm=False)):
        first = {
            t: {"logprob": lp.logprob, "decoded_token": lp.decoded_token}
            for t, lp in out.outputs[0].logprobs[0].items()
        }
        p_a[(i, j)] = first_choice_probability(first, *AB)
    wins = {(i, j): p_a[(i, j)] >= p_a[(j, i)] for i, j in itertools.combinations(range(len(pool)), 2)}
    df, expected = pick_table(wins, pool, size=7)
    out, cost = df.llm.topk(
        INSTRUCTION,
        K,
        model=judge_model,
        both_orders=True,
        return_stats=True,
        max_model_len=512,
        kv_cache_memory_bytes=2**24,
    )
    assert out.fruit.tolist() == expected
    assert cost.requests == 2 * cost.counts["comparisons"] and cost.counts["comparisons"] < 21
    print(
        f"topk both_orders: {cost.counts['comparisons']} comparisons ({cost.requests} decodes) in "
        f"{cost.engine_calls} engine calls"
    )
