"""Complete unfinished haikus on Dask with build_processor, as in Ray Data LLM's example.

Ray Data LLM's ``build_processor(config, preprocess, postprocess)`` re-expressed on Dask:
each row becomes a chat with a system prompt (temperature 0.3, at most 250 tokens), runs
on the engine held by each Dask worker, and the answers are written to parquet. The output's
columns and types come from running the first rows when the processor is called (pass
``meta=`` to build_processor to give them instead); a row that fails keeps its ``id`` and
``item`` and says why in ``llm_error``, and postprocess is not run on it.

    python examples/haiku_processor.py [--output haikus/] [--max-tokens 250] [--workers 1]
"""

from __future__ import annotations

import argparse
import tempfile

import dask.dataframe as dd
import pandas as pd
from distributed import Client, LocalCluster

import dfllm

UNFINISHED = [
    "An old silent pond / a frog jumps into the pond",
    "Autumn moonlight / a worm digs silently",
    "Over the wintry forest / winds howl in rage",
    "In the cicada's cry / no sign can foretell",
    "The light of a candle / is transferred to another",
    "A world of dew / and within every dewdrop",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=None, help="parquet output folder (default: a temporary folder)")
    parser.add_argument("--max-tokens", type=int, default=250)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()

    # dfllm's config: a failed row is kept, with its error in llm_error (Ray's
    # vLLMEngineProcessorConfig, as Ray, fails the job on it instead)
    config = dfllm.ProcessorConfig(
        model_source=None,  # the bundled SmolLM2-135M-Instruct; or a model directory
        engine_kwargs={"max_model_len": 1024},
        batch_size=16,
        task_type="generate",
        apply_chat_template=True,
    )
    processor = dfllm.build_processor(
        config,
        preprocess=lambda row: dict(
            messages=[
                {"role": "system", "content": "You are a bot that completes unfinished haikus."},
                {"role": "user", "content": row["item"]},
            ],
            sampling_params=dict(temperature=0.3, max_tokens=args.max_tokens, seed=row["id"]),
        ),
        postprocess=lambda row: dict(
            id=row["id"], item=row["item"], answer=row["generated_text"], tokens=row["num_generated_tokens"]
        ),
    )

    ddf = dd.from_pandas(pd.DataFrame({"id": range(len(UNFINISHED)), "item": UNFINISHED}), npartitions=2)
    output = args.output or tempfile.mkdtemp(prefix="haikus-")
    with LocalCluster(n_workers=args.workers, threads_per_worker=2, dashboard_address=":0") as cluster, Client(cluster):
        result = processor(ddf)  # runs the first rows now, for the output's columns
        result.to_parquet(output)  # the rest runs here; one engine per worker
    result = pd.read_parquet(output).sort_values("id")
    for row in result.itertuples():
        print(f"> {row.item}\n{row.answer.strip()}\n({row.tokens} tokens)\n")
    print(f"{len(result)} haikus written to {output}")


if __name__ == "__main__":
    main()
