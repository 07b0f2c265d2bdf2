"""Embeddings and similarity search over a Dask dataframe, with the bundled all-MiniLM-L6-v2.

Embeds a small corpus with ``ddf.llm.embed`` (a ``list<float32>`` column), embeds the
queries, ranks documents by cosine similarity, then re-scores the top hits pairwise with
``.llm.score``.

    python examples/semantic_search.py ["your query" ...]
"""

from __future__ import annotations

import sys

import dask.dataframe as dd
import numpy as np
import pandas as pd

import dfllm  # noqa: F401  (registers .llm)

DOCS = [
    "Parquet is a columnar storage format that compresses well and supports predicate pushdown.",
    "Dask splits a large dataframe into partitions and schedules work across a cluster.",
    "The Eiffel Tower was completed in 1889 for the World's Fair in Paris.",
    "A paged KV cache stores attention keys and values in fixed-size blocks.",
    "Sourdough bread rises thanks to wild yeast and lactic acid bacteria.",
    "Polars is a dataframe library with a lazy query engine written in Rust.",
    "Mount Everest is the highest mountain above sea level.",
    "Continuous batching adds new requests to a running batch at every decoding step.",
]


def main(queries: list[str]) -> None:
    docs = dd.from_pandas(pd.DataFrame({"doc_id": range(len(DOCS)), "text": DOCS}), npartitions=2)
    corpus = docs.llm.embed("text").compute()  # Dask's local scheduler: one engine in this process
    matrix = np.array(corpus["embedding"].tolist())  # rows are unit vectors (normalized embeddings)

    found = pd.DataFrame({"query": queries}).llm.embed("query")
    for query, emb in zip(found["query"], found["embedding"]):
        sims = matrix @ np.asarray(emb)
        top = np.argsort(-sims)[:3]
        hits = pd.DataFrame({"query": query, "text": corpus["text"].iloc[top].tolist(), "cosine": sims[top]})
        hits = hits.llm.score("query", "text")  # pairwise score (cosine for a bi-encoder)
        print(f"\n{query}")
        for row in hits.itertuples():
            print(f"  {row.cosine:.3f}  {row.score:.3f}  {row.text}")


if __name__ == "__main__":
    main(
        sys.argv[1:]
        or [
            "How do I store dataframes on disk efficiently?",
            "tallest peak in the world",
            "how does an LLM server batch requests",
        ]
    )
