"""A Polars pipeline: lazy scan, an LLM column and an embedding column, then plain Polars.

``.llm`` works on Polars DataFrames, LazyFrames and inside expressions
(``pl.col("review").llm.chat(...)``); the output columns are typed up front, so a lazy
plan knows its schema before any model runs. ``choice=[...]`` constrains decoding to one
of the choices and gives an Enum column.

    python examples/polars_pipeline.py [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import polars as pl

import dfllm  # noqa: F401  (registers .llm on Polars)

REVIEWS = {
    "product": ["kettle", "kettle", "headphones", "headphones", "backpack"],
    "review": [
        "Boils water fast and looks great on the counter.",
        "Stopped working after two weeks, very disappointed.",
        "Amazing sound and the battery lasts all day.",
        "Uncomfortable after an hour and the left ear crackles.",
        "Roomy, sturdy, and the laptop sleeve is padded.",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "reviews.parquet"
        pl.DataFrame(REVIEWS).write_parquet(source)

        plan = (
            pl.scan_parquet(source)
            .llm.chat(
                "Is this review positive or negative?\n\n{review}",
                system="You are a sentiment classifier.",
                choice=["positive", "negative"],
                output_column="sentiment",  # an Enum column
                sampling_params={"temperature": 0.0, "max_tokens": args.max_tokens},
            )
            .with_columns(pl.col("review").llm.embed().alias("embedding"))
        )
        print(plan.collect_schema())  # known before anything runs
        df = plan.collect()

    print(df.select("product", "review", "sentiment", "num_generated_tokens", "llm_error"))
    print(
        df.group_by("product")
        .agg(pl.len().alias("reviews"), pl.col("num_generated_tokens").sum().alias("tokens"))
        .sort("product")
    )
    print("embedding width:", df["embedding"].list.len().unique().to_list())


if __name__ == "__main__":
    main()
