"""Rows that share documents: prefix-aware admission and deduplication off vs on, on Dask.

Workload (issue #20's shape)
----------------------------
``--docs`` (48) documents of about ``--doc-words`` (300, about 400 tokens) words drawn
from a seeded word list, ``--questions`` (6) questions per document, each prompt a shared
instruction of about 200 tokens, then the document, then the question. ``--dup-frac``
(10%) of the rows are added again as exact duplicates; all rows are shuffled and split
into ``--partitions`` (8) partitions. Greedy decoding of ``--max-tokens`` (32) tokens per
answer (``ignore_eos``), the bundled SmolLM2 (or ``--model``), and a KV cache of
``--kv-tokens`` (8192) tokens: smaller than all the documents together.

Both modes run ``dd.from_pandas(...).llm.generate("prompt", ...)`` on one
``LocalCluster`` worker process with ``--threads`` (8) threads, so that all partitions
share the worker's engine at once (the engine, not the threads, does the work):

- off: ``prefix_aware_scheduling=False, deduplicate_requests=False``; vLLM's behaviour
  (prefix caching on, first come, first served).
- on: dfllm's defaults: longest cached prefix first, identical greedy rows computed once.

Each mode's engine is loaded and warmed first; timings exclude model loading. Modes
alternate for ``--repeats`` rounds (median reported). Prompt tokens computed are read
from the worker's engine: prefix-cache queries minus hits (tokens the model actually ran
as prompt tokens, recomputation after preemption included); the ideal is each distinct
block-aligned prefix once plus each distinct prompt's tail (a duplicate: nothing). Outputs
of the two modes are compared row by row.

Run (idle machine)::

    python benchmarks/bench_prefix.py                     # the issue's shape, ~10 min on 2 cores
    python benchmarks/bench_prefix.py --docs 8 --questions 3 --doc-words 120 --max-tokens 8 --repeats 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import time

import dask.dataframe as dd
import pandas as pd
import torch
from transformers import AutoTokenizer

import dfllm  # noqa: F401  (registers the .llm accessors)
from dfllm.models.bundled import resolve_model

WORDS = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book
eye job word business issue side kind head house service friend father power hour game line
river garden engine bridge market signal network window planet forest ocean mountain village
library machine theory energy pattern memory language music picture science season winter
""".split()
ASKS = [
    "Summarise the document in one sentence.",
    "Which place is mentioned first?",
    "Name three things the document talks about.",
    "Is the document about a person?",
    "What is the main topic?",
    "Give the document a short title.",
    "Which word appears most often?",
    "Does the document mention water?",
]


def make_rows(args) -> tuple[pd.DataFrame, str]:
    rng = random.Random(args.seed)
    instruction = (
        "You are a careful reader. Answer the question about the document below using only what "
        "the document says. " + " ".join(rng.choice(WORDS) for _ in range(150))
    )
    docs = [" ".join(rng.choice(WORDS) for _ in range(args.doc_words)) for _ in range(args.docs)]
    prompts = [
        f"{instruction}\n\nDocument {d}:\n{doc}\n\nQuestion: {ask}\nAnswer:"
        for d, doc in enumerate(docs)
        for ask in rng.sample(ASKS, args.questions)
    ]
    prompts += rng.sample(prompts, round(args.dup_frac * len(prompts)))
    rng.shuffle(prompts)
    return pd.DataFrame({"id": range(len(prompts)), "prompt": prompts}), instruction


def ideal_prompt_tokens(token_lists: list[list[int]], block_size: int) -> int:
    """Each distinct block-aligned prefix once, each distinct prompt's tail once; duplicates free."""
    blocks: set[tuple] = set()
    total = 0
    for ids in {tuple(t) for t in token_lists}:
        full = (len(ids) - 1) // block_size
        for i in range(1, full + 1):
            blocks.add(ids[: i * block_size])
        total += len(ids) - full * block_size
    return total + len(blocks) * block_size


def engine_kwargs(args, on: bool) -> dict:
    return dict(
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_bytes,
        prefix_aware_scheduling=on,
        deduplicate_requests=on,
    )


def reset_prefix_cache(model, kw) -> None:
    from dfllm.worker import engine_cache

    engine_cache.get_engine(model, kw).reset_prefix_cache()


def worker_counts(client, model, kw) -> dict:
    def read(model=model, kw=kw):
        from dfllm.worker import engine_cache

        llm = engine_cache.get_engine(model, kw)
        stats = llm.llm_engine.stats()
        return {
            "computed": stats.prefix_cache_queries - stats.prefix_cache_hits,
            "deduplicated": int(llm.llm_engine.metrics.deduplicated._value.get()),
            "preemptions": stats.num_preemptions,
        }

    return next(iter(client.run(read).values()))


def run_mode(client, frame: pd.DataFrame, args, on: bool) -> dict:
    kw = engine_kwargs(args, on)
    sp = {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    warm = dd.from_pandas(frame.head(2), npartitions=1)
    warm.llm.generate("prompt", sampling_params={**sp, "max_tokens": 2}, model=args.model, **kw).compute()
    client.run(reset_prefix_cache, args.model, kw)
    before = worker_counts(client, args.model, kw)
    ddf = dd.from_pandas(frame, npartitions=args.partitions, sort=False)
    start = time.perf_counter()
    out = ddf.llm.generate("prompt", sampling_params=sp, model=args.model, **kw).compute()
    seconds = time.perf_counter() - start
    after = worker_counts(client, args.model, kw)
    assert sorted(out["id"]) == list(range(len(frame))), "rows lost or duplicated"
    assert out["llm_error"].isna().all(), out["llm_error"].dropna().head()
    out = out.sort_values("id")
    return {
        "seconds": seconds,
        "rows_s": len(frame) / seconds,
        "computed": after["computed"] - before["computed"],
        "deduplicated": after["deduplicated"] - before["deduplicated"],
        "preemptions": after["preemptions"] - before["preemptions"],
        "texts": list(out["generated_text"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--docs", type=int, default=48)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--doc-words", type=int, default=300)
    ap.add_argument("--dup-frac", type=float, default=0.10)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from distributed import Client, LocalCluster

    from dfllm import LLM

    frame, _ = make_rows(args)
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    token_lists = [tok(p)["input_ids"] for p in frame["prompt"]]
    probe = LLM(args.model, max_model_len=args.max_model_len, kv_cache_memory_bytes=2**28)
    block_size, block_bytes = probe.llm_engine.cfg.block_size, probe.llm_engine.runner.block_bytes
    del probe
    args.kv_bytes = -(-args.kv_tokens // block_size) * block_bytes
    ideal = ideal_prompt_tokens(token_lists, block_size)
    total = sum(map(len, token_lists))
    print(
        f"{len(frame)} rows ({args.docs} documents x {args.questions} questions + duplicates), "
        f"{total} prompt tokens, ideal {ideal} computed; KV cache {args.kv_tokens} tokens; "
        f"{args.partitions} partitions; {args.max_tokens} greedy tokens per row"
    )
    cluster = LocalCluster(n_workers=1, threads_per_worker=args.threads, processes=True, dashboard_address=":0")
    client = Client(cluster)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        for r in range(args.repeats):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                res = run_mode(client, frame, args, mode == "on")
                runs[mode].append(res)
                print(
                    f"  round {r + 1} {mode:>3}: {res['rows_s']:.2f} rows/s, {res['computed']} prompt tokens "
                    f"computed, {res['deduplicated']} rows deduplicated, {res['preemptions']} preemptions"
                )
    finally:
        client.close()
        cluster.close()
    med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in ("rows_s", "computed", "seconds")} for m in runs}
    same = sum(a == b for a, b in zip(runs["off"][0]["texts"], runs["on"][0]["texts"]))
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "rows": len(frame),
        "prompt_tokens": total,
        "ideal_computed": ideal,
        "off": med["off"],
        "on": med["on"],
        "rows_s_ratio": med["on"]["rows_s"] / med["off"]["rows_s"],
        "computed_vs_ideal_on": med["on"]["computed"] / ideal,
        "computed_vs_ideal_off": med["off"]["computed"] / ideal,
        "same_outputs": f"{same}/{len(frame)}",
    }
    print(
        f"\noff (vLLM-like FIFO, no dedupe): {med['off']['rows_s']:.2f} rows/s, {med['off']['computed']:.0f} "
        f"prompt tokens computed ({report['computed_vs_ideal_off']:.2f}x ideal)"
    )
    print(
        f"on  (prefix-aware + dedupe):     {med['on']['rows_s']:.2f} rows/s, {med['on']['computed']:.0f} "
        f"prompt tokens computed ({report['computed_vs_ideal_on']:.2f}x ideal)"
    )
    print(f"ratio on/off: {report['rows_s_ratio']:.2f}x rows/s; outputs equal on {report['same_outputs']} rows")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
