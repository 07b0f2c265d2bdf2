"""Semantic operators on a small labelled dataset, with the bundled models: each call, its
output and its cost (engine requests, prompt tokens and how many of them the prefix cache
served, generated tokens). Docs: docs/semantic.md.

    python examples/semantic_operators.py
"""

from __future__ import annotations

from typing import Literal

import dask
import dask.dataframe as dd
import pandas as pd

import dfllm
from dfllm.worker.engine_cache import engines

REVIEWS = [
    ("My parcel arrived two weeks late and the box was crushed.", "shipping"),
    ("The courier lost my package; it never arrived.", "shipping"),
    ("Delivery took a month, far too slow.", "shipping"),
    ("The headphones sound great and the bass is deep.", "quality"),
    ("The fabric tore after one wash.", "quality"),
    ("Way too expensive for what you get.", "price"),
    ("Shipping was fast, arrived the next day.", "shipping"),
    ("The battery died after a week.", "quality"),
]


def costs() -> dict[str, dict[str, float]]:
    """Per model in this process: requests, prompt tokens, prompt tokens served by the prefix
    cache, generated tokens so far (the engines' own counters)."""
    names = {
        "dfllm_request_prompt_tokens": "requests",
        "dfllm_prompt_tokens": "prompt tokens",
        "dfllm_prefix_cache_hits": "cached tokens",
        "dfllm_generation_tokens": "generated tokens",
    }
    out: dict[str, dict[str, float]] = {}
    for llm in engines():
        if llm.engine is None:  # an embedding model: no generation counters
            continue
        for m in llm.get_metrics():
            if m.name in names:
                value = m.count if m.name == "dfllm_request_prompt_tokens" else m.value
                out.setdefault(m.labels["model_name"], {})[names[m.name]] = value
    return out


def show(title: str, frame: pd.DataFrame, before: dict) -> dict:
    after = costs()
    print(f"\n== {title}\n{frame.to_string(max_colwidth=48)}")
    for model, figures in after.items():
        spent = {k: int(v - before.get(model, {}).get(k, 0)) for k, v in figures.items()}
        print(f"   cost on {model}: {spent}")
    return after


def main() -> None:
    df = pd.DataFrame({"review": [r for r, _ in REVIEWS], "topic": [t for _, t in REVIEWS]})
    pd.set_option("display.width", 200)
    spent = costs()

    judged = df.llm.judge("{review} complains about delivery")
    spent = show(
        'df.llm.judge("{review} complains about delivery")',
        judged[["review", "topic", "verdict", "verdict_probability"]],
        spent,
    )

    kept = df.llm.filter("{review} complains about delivery")
    spent = show('df.llm.filter("{review} complains about delivery")', kept[["review", "topic"]], spent)

    schema = {"product": str, "sentiment": Literal["positive", "negative"]}
    fields = df.llm.extract("{review}", schema)
    spent = show(
        'df.llm.extract("{review}", {"product": str, "sentiment": Literal[...]})',
        fields[["review", "product", "sentiment", "llm_error"]],
        spent,
    )

    # on Dask: lazy, one task per partition, the same rows and fields
    ddf = dd.from_pandas(df, npartitions=2)
    chained = ddf.llm.filter("{review} complains about delivery").llm.extract("{review}", schema)
    with dask.config.set(scheduler="sync"):
        spent = show("ddf.llm.filter(...).llm.extract(...)  (Dask)", chained.compute()[["review", "sentiment"]], spent)

    # a cascade: an embedding similarity decides the rows it is sure about, the chat model the rest
    many = pd.concat([df] * 5, ignore_index=True)
    cascade = dfllm.Cascade(proxy="embedding", recall_target=0.8, precision_target=0.8, min_sample=12, seed=0)
    result, stats = many.llm.judge("{review} complains about delivery", cascade=cascade, return_stats=True)
    spent = show(
        "many.llm.judge(..., cascade=Cascade(proxy='embedding'))",
        result.groupby("decided_by").size().to_frame("rows"),
        spent,
    )
    print(
        f"   {stats.large_model_rows} of {stats.rows} rows reached the chat model "
        f"({100 * stats.large_model_share:.0f}%); estimated recall {stats.estimated_recall:.2f}, "
        f"precision {stats.estimated_precision:.2f}"
    )
    # --- semantic-2's operators (topk, join, sim_join, dedup, agg) go below ---
    semantic_2(df, spent)


def semantic_2(df: pd.DataFrame, spent: dict) -> dict:
    """topk, join, sim_join, dedup and agg on the same reviews, each with its cost."""
    top, cost = df.llm.topk("{review} is the angriest complaint", 2, return_stats=True)
    spent = show('df.llm.topk("{review} is the angriest complaint", 2)', top[["review", "rank"]], spent)
    print(
        f"   {cost.counts['comparisons']} comparisons in {cost.engine_calls} engine calls (a full sort's "
        f"tournament: {len(df) * (len(df) - 1) // 2})"
    )

    subjects = pd.DataFrame({"subject": ["late or lost delivery", "sound quality", "price"]})
    pairs, cost = df.llm.join(subjects, "{review} is about {subject}", block_k=1, return_stats=True)
    spent = show(
        'df.llm.join(subjects, "{review} is about {subject}", block_k=1)',
        pairs[["review", "subject", "similarity", "llm_error"]],
        spent,
    )
    print(f"   {cost.counts['pairs_judged']} of {cost.counts['cross_product']} pairs judged")

    nearest = df.llm.sim_join(subjects, "review", "subject", 1)
    spent = show(
        'df.llm.sim_join(subjects, "review", "subject", 1)', nearest[["review", "subject", "similarity"]], spent
    )

    dupes = pd.concat(
        [df, pd.DataFrame({"review": ["My parcel arrived two weeks late!"], "topic": ["shipping"]})], ignore_index=True
    )
    clusters, cost = dupes.llm.dedup("review", threshold=0.7, return_stats=True)
    spent = show(
        'df.llm.dedup("review", threshold=0.7)', clusters[["review", "cluster_id", "is_representative"]], spent
    )
    print(f"   {cost.counts['candidate_pairs']} pair above the threshold among {len(dupes)} rows")

    summary, cost = df.llm.agg("Summarise the complaints in {review}", by="topic", max_tokens=32, return_stats=True)
    spent = show('df.llm.agg("Summarise the complaints in {review}", by="topic")', summary, spent)
    print(f"   {cost.counts['summaries']} summaries in {cost.engine_calls} engine calls")
    return spent


if __name__ == "__main__":
    main()
