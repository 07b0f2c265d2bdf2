"""A rerun over 50% overlapping rows, with and without the response cache (``cache=``), on Dask.

Workload
--------
``--rows`` (128) distinct short questions, job A over rows ``0..rows-1``, job B over rows
``rows/2..3*rows/2-1``: half of B's rows were in A. Greedy decoding of ``--max-tokens`` (16)
tokens (``ignore_eos``: every row generates them all), the bundled SmolLM2 (or ``--model``),
``--partitions`` (8) partitions per job, on one ``LocalCluster`` worker process with
``--threads`` (2) threads. The engine is loaded and warmed first; timings exclude loading.

Per round (``--repeats``, median reported), each job is ``dd.from_pandas(...).llm.generate(
...).compute()``:

- A and B without a cache (what a rerun costs today);
- A with a new, empty cache (the cost of storing every row), then B with it.

Engine requests are read from the worker's engine (its finished-request count), cache hits
from the worker's :func:`dfllm.tasks.response_cache.counts`. B's outputs with the cache
are compared row by row with B's without.

Run (idle machine)::

    python benchmarks/bench_cache.py                              # ~3 min on 2 cores
    python benchmarks/bench_cache.py --rows 16 --max-tokens 4 --repeats 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

import dask.dataframe as dd
import pandas as pd
import torch

import dfllm  # noqa: F401  (registers the .llm accessors)

TOPICS = [
    "rivers",
    "bridges",
    "forests",
    "planets",
    "markets",
    "engines",
    "gardens",
    "libraries",
    "oceans",
    "mountains",
    "villages",
    "languages",
    "seasons",
    "signals",
    "windows",
    "machines",
]
OUTPUTS = ["generated_text", "num_input_tokens", "num_generated_tokens", "finish_reason", "llm_error"]


def questions(ids) -> pd.DataFrame:
    return pd.DataFrame(
        {"id": list(ids), "q": [f"Question {i}: name one fact about {TOPICS[i % len(TOPICS)]}." for i in ids]}
    )


def engine_requests() -> int:
    """Requests the worker's engines finished."""
    from dfllm.worker.engine_cache import engines_now

    return sum(
        m.count
        for llm in engines_now()
        if llm.engine is not None
        for m in llm.get_metrics()
        if m.name == "dfllm_request_generation_tokens"
    )


def cache_hits() -> int:
    from dfllm.tasks.response_cache import counts

    return counts()["hits"]


def job(client, df: pd.DataFrame, args, cache: str | None) -> dict:
    """Run one job; its seconds, rows/s, engine requests and cache hits, and its output."""
    ddf = dd.from_pandas(df, npartitions=args.partitions)
    requests, hits = sum(client.run(engine_requests).values()), sum(client.run(cache_hits).values())
    start = time.perf_counter()
    out = ddf.llm.generate(
        "{q}",
        model=args.model,
        cache=cache,
        engine_columns="from_cache",
        sampling_params={"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True},
        max_model_len=args.max_model_len,
    ).compute()
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "rows_per_s": len(df) / seconds,
        "engine_requests": sum(client.run(engine_requests).values()) - requests,
        "cache_hits": sum(client.run(cache_hits).values()) - hits,
        "output": out.set_index("id").sort_index(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--model", default=None, help="model directory or bundled alias (default: the bundled SmolLM2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    from distributed import Client, LocalCluster

    half = args.rows // 2
    a, b = questions(range(args.rows)), questions(range(half, half + args.rows))
    rounds = []
    root = tempfile.mkdtemp(prefix="dfllm-bench-cache-")
    cluster = LocalCluster(n_workers=1, threads_per_worker=args.threads, processes=True, dashboard_address=None)
    with cluster, Client(cluster) as client:
        job(client, questions(range(10_000, 10_004)), args, None)  # load and warm the engine
        for r in range(args.repeats):
            cache = os.path.join(root, f"round-{r}")
            plain_a, plain_b = job(client, a, args, None), job(client, b, args, None)
            cached_a, cached_b = job(client, a, args, cache), job(client, b, args, cache)
            same = plain_b["output"][OUTPUTS].equals(cached_b["output"][OUTPUTS])
            overlap = cached_b["output"]["from_cache"]
            rounds.append(
                {
                    "plain_a": plain_a,
                    "plain_b": plain_b,
                    "cached_a": cached_a,
                    "cached_b": cached_b,
                    "same_outputs": same,
                    "from_cache_rows": int(overlap.sum()),
                }
            )
            print(
                f"round {r}: rerun B without cache {plain_b['rows_per_s']:.2f} rows/s "
                f"({plain_b['engine_requests']} engine requests); with cache {cached_b['rows_per_s']:.2f} rows/s "
                f"({cached_b['engine_requests']} engine requests, {cached_b['cache_hits']} hits); first run A "
                f"storing {cached_a['rows_per_s']:.2f} vs {plain_a['rows_per_s']:.2f} rows/s; same outputs: {same}",
                flush=True,
            )
    shutil.rmtree(root, ignore_errors=True)

    def median(mode: str, field: str) -> float:
        return statistics.median(r[mode][field] for r in rounds)

    result = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "model": args.model or "smollm2-135m-instruct",
        "rows": args.rows,
        "overlap_rows": args.rows - half,
        "max_tokens": args.max_tokens,
        "partitions": args.partitions,
        "threads": args.threads,
        "repeats": args.repeats,
        "rerun_rows_per_s_without_cache": median("plain_b", "rows_per_s"),
        "rerun_rows_per_s_with_cache": median("cached_b", "rows_per_s"),
        "rerun_engine_requests_without_cache": median("plain_b", "engine_requests"),
        "rerun_engine_requests_with_cache": median("cached_b", "engine_requests"),
        "engine_requests_saved": median("plain_b", "engine_requests") - median("cached_b", "engine_requests"),
        "first_run_rows_per_s_without_cache": median("plain_a", "rows_per_s"),
        "first_run_rows_per_s_storing": median("cached_a", "rows_per_s"),
        "same_outputs": all(r["same_outputs"] for r in rounds),
        "from_cache_rows": [r["from_cache_rows"] for r in rounds],
    }
    result["rerun_speedup"] = result["rerun_rows_per_s_with_cache"] / result["rerun_rows_per_s_without_cache"]
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if not result["same_outputs"]:
        raise SystemExit("the rerun with the cache gave other outputs than without it")


if __name__ == "__main__":
    main()
