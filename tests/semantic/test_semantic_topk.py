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

import dask
import dask.dataframe as dd
import pandas as pd
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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


# --- hostile rows: each is its own error, never the ranking's ---------------------------------------------------
#: values the comparator's prompt cannot hold: each such row comes out once, unranked, with its error naming
#: the column (and no comparison is ever blamed on the row it meets, the pivot included)
INVALID = ["", "   ", "\ud800", "fig \udfff", b"\xff\xfe", b"", ["x"], {"a": 1}, None, float("nan"), pd.NA]
#: odd but valid values (text, numbers, UTF-8 bytes): ranked like any other row
ODD = [2**70, -(2**70), "\ufeffBOM-prefixed melon", b"valid bytes", 1.5, True]
#: a Polars binary column: its invalid values, and the valid ones are the fruits' UTF-8 bytes
INVALID_BINARY = [b"", b"\xff", b"\xc3(", b"  ", None]
HOSTILE_PROPERTY = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@st.composite
def hostile_tables(draw):
    """``(kind, values, bad positions, k, options)``: fruits (and odd values) with invalid ones among them, one
    of them at the middle (the first pivot) when drawn so."""
    kind = draw(st.sampled_from(["pandas", "dask", "polars"]))
    good = draw(st.lists(st.sampled_from(POOL), min_size=2, max_size=6, unique=True))
    if kind == "polars":
        good = [g.encode() for g in good]
        bad = draw(st.lists(st.sampled_from(INVALID_BINARY), min_size=1, max_size=3))
    else:
        good += draw(st.lists(st.sampled_from(ODD), max_size=2))
        bad = draw(st.lists(st.sampled_from(INVALID), min_size=1, max_size=3))
    n = len(good) + len(bad)
    positions = draw(st.lists(st.integers(0, n - 1), min_size=len(bad), max_size=len(bad), unique=True))
    if draw(st.booleans()) and n // 2 not in positions:
        positions[0] = n // 2  # the quickselect's first pivot
    values, it_good, it_bad = [], iter(good), iter(bad)
    for i in range(n):
        values.append(next(it_bad) if i in positions else next(it_good))
    k = draw(st.integers(1, len(good) + 1))
    options = {"method": draw(st.sampled_from(["quick", "heap"])), "both_orders": draw(st.booleans())}
    return kind, values, sorted(positions), k, options


def run_topk(kind: str, df: pd.DataFrame, *args, **kwargs) -> pd.DataFrame:
    """``topk`` on ``df`` as a pandas, Dask (two partitions, Dask's string conversion off: the values stay
    as they are) or Polars frame, the result as pandas."""
    if kind == "polars":
        frame = pl.from_pandas(df)
        assert frame.schema["fruit"] == pl.Binary
        return frame.llm.topk(*args, **kwargs).to_pandas()
    if kind == "dask":
        with dask.config.set({"dataframe.convert-string": False}):
            return dd.from_pandas(df, npartitions=2).llm.topk(*args, **kwargs).compute()
    return df.llm.topk(*args, **kwargs)


@HOSTILE_PROPERTY
@given(hostile_tables())
def test_topk_hostile_rows_are_their_own_errors(judge_model, case):
    """Every row whose value the prompt cannot hold (empty or blank text, a lone surrogate, invalid UTF-8,
    a list, a dict, a null), wherever it is (the pivot too), on pandas, Dask and Polars, either method, one
    order or both: it comes out once
    with a null rank and its error naming the user's column; every other row is ranked (1..k, no error)."""
    kind, values, bad, k, options = case
    df = pd.DataFrame({"id": range(len(values)), "fruit": pd.Series(values, dtype=object)})
    out = run_topk(kind, df, INSTRUCTION, k, model=judge_model, **options)
    ids = out["id"].tolist()
    assert len(ids) == len(set(ids))  # no row twice
    n_good = len(values) - len(bad)
    assert len(out) == min(k, n_good) + len(bad)  # the top k of the good rows, then every bad row
    ranked, unranked = out[out["rank"].notna()], out[out["rank"].isna()]
    assert sorted(unranked["id"]) == bad
    assert ranked["rank"].tolist() == list(range(1, min(k, n_good) + 1)) and ranked.llm_error.isna().all()
    for msg in unranked.llm_error:
        assert not pd.isna(msg) and "column 'fruit'" in msg and "__" not in msg, msg


@pytest.fixture(scope="module")
def short_engine():
    """A context too short for the long row below: its comparisons fail in the engine, not before."""
    return {"max_model_len": 256, "kv_cache_memory_bytes": 2**24}


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    st.lists(st.sampled_from(POOL), min_size=3, max_size=6, unique=True),
    st.integers(0, 6),
    st.sampled_from(["quick", "heap"]),
    st.integers(1, 7),
)
def test_topk_failed_comparison_blames_the_row_that_fails(judge_model, short_engine, fruits, at, method, k):
    """A row whose every comparison fails in the engine (its prompt is past max_model_len), the first pivot
    or the heap's first comparison included, gets the error; the rows it met are ranked."""
    at = min(at, len(fruits))
    values = fruits[:at] + ["pear " * 300] + fruits[at:]
    df = pd.DataFrame({"id": range(len(values)), "fruit": pd.Series(values, dtype=object)})
    out = df.llm.topk(INSTRUCTION, k, model=judge_model, method=method, **short_engine)
    ranked, unranked = out[out["rank"].notna()], out[out["rank"].isna()]
    assert unranked["id"].tolist() == [at] and "max_model_len" in unranked.llm_error.iloc[0]
    assert ranked["rank"].tolist() == list(range(1, min(k, len(fruits)) + 1)) and ranked.llm_error.isna().all()


def test_topk_hostile_row_with_on_error_raise(judge_model):
    """``on_error="raise"``: a row the prompt cannot hold raises, naming its index and the column."""
    df = pd.DataFrame({"fruit": pd.Series(["apple", "\ud800", "plum"], index=[10, 11, 12], dtype=object)})
    with pytest.raises(ValueError, match=r"the row of index 11: column 'fruit' is not valid Unicode"):
        df.llm.topk(INSTRUCTION, 2, model=judge_model, on_error="raise")


@pytest.mark.parametrize("kind", ["pandas", "dask", "polars"])
def test_topk_refuses_rank_column_llm_error(judge_model, table, kind):
    """The rank column cannot be the error column (the ranks would be overwritten): refused at call time."""
    df, _ = table
    frame = {"pandas": df, "dask": dd.from_pandas(df, npartitions=2), "polars": pl.from_pandas(df)}[kind]
    with pytest.raises(ValueError, match="cannot be named 'llm_error'"):
        frame.llm.topk(INSTRUCTION, 2, model=judge_model, rank_column="llm_error")
