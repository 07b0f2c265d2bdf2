"""A job's shared prefixes across a cluster: prefix-aware placement on vs off (issue #51).

Workload
--------
``--docs`` (24) documents of about ``--doc-words`` (300, about 400 tokens) words drawn
from a seeded word list, each asked ``--questions`` (4) questions; the rows in *question
order* (every document's first question, then every second question...), so that each
partition of ``--partitions`` (8) holds one question about many documents and each
document's rows sit in several partitions. Each prompt is a short instruction, the
document, the question. Greedy decoding of ``--max-tokens`` (16) tokens per row
(``ignore_eos``), the bundled SmolLM2 (or ``--model``).

Both modes run ``dd.from_pandas(...).llm.generate("prompt", ...)`` on one ``LocalCluster``
of ``--workers`` (2) worker processes with ``--threads`` (4) threads each, one engine per
worker (warmed first; timings exclude model loading; the prefix caches are cleared before
each run):

- off (``dfllm.prefix-placement: False``): Dask places partitions as it likes; each engine
  computes the documents of the partitions it got;
- on (the default): each row goes to its prefix group's engine.

Reported per mode (median over ``--repeats`` alternating rounds): rows/s, prompt tokens
computed across the cluster (the engines' prefix-cache queries minus hits) against the
ideal (each distinct block-aligned prefix once in the job, each prompt's tail once:
``ideal / computed``, 1.0 is perfect), and each engine's work (prompt plus generated tokens
it ran) against the mean. Outputs of both modes are compared row by row with one engine's
(``--single``: the same job on one pandas frame in this process). A second job without
shared prefixes (``--docs x --questions`` distinct texts) reports the engines' work spread
with placement on.

Run (idle machine)::

    python benchmarks/bench_prefix_cluster.py                    # 2 workers, the issue's shape
    python benchmarks/bench_prefix_cluster.py --workers 4
    python benchmarks/bench_prefix_cluster.py --docs 6 --questions 2 --doc-words 80 --repeats 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import dask
import dask.dataframe as dd
import pandas as pd
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))

from bench_prefix import ASKS, WORDS, ideal_prompt_tokens  # noqa: E402

import dfllm  # noqa: E402,F401  (registers the .llm accessors)
from dfllm.accessors.partitions import llm_origin  # noqa: E402
from dfllm.accessors.prefix_placement import directory_report  # noqa: E402
from dfllm.models.bundled import resolve_model  # noqa: E402


def make_rows(args) -> pd.DataFrame:
    rng = random.Random(args.seed)
    instruction = "Answer the question about the document using only what it says."
    docs = [" ".join(rng.choice(WORDS) for _ in range(args.doc_words)) for _ in range(args.docs)]
    asks = rng.sample(ASKS, args.questions)
    prompts = [
        f"{instruction}\n\nDocument {d}:\n{doc}\n\nQuestion: {ask}\nAnswer:"
        for ask in asks  # question order
        for d, doc in enumerate(docs)
    ]
    return pd.DataFrame({"id": range(len(prompts)), "prompt": prompts})


def unshared_rows(args) -> pd.DataFrame:
    rng = random.Random(args.seed + 1)
    n = args.docs * args.questions
    texts = [f"Item {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(20, 120))) for i in range(n)]
    return pd.DataFrame({"id": range(n), "prompt": texts})


def engine_kwargs(args) -> dict:
    return dict(max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_bytes)


def counters(client, model, kw) -> dict:
    """Per worker: prompt tokens computed (prefix-cache queries minus hits) and work
    (prompt tokens of finished prefills plus generated tokens)."""

    def read(model=model, kw=kw):
        from dfllm.worker import engine_cache

        engine = engine_cache.get_engine(model, kw).llm_engine
        stats = engine.stats()
        m = engine.metrics
        work = m.prompt_tokens._value.get() + m.generation_tokens._value.get()
        return {
            "computed": stats.prefix_cache_queries - stats.prefix_cache_hits,
            "work": work,
            "preemptions": stats.num_preemptions,
        }

    return client.run(read)


def clear(client, model, kw) -> None:
    def reset(model=model, kw=kw):
        from dfllm.worker import engine_cache

        engine_cache.get_engine(model, kw).reset_prefix_cache()

    client.run(reset)


def run_mode(client, frame: pd.DataFrame, args, on: bool) -> dict:
    kw = engine_kwargs(args)
    sp = {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    clear(client, args.model, kw)
    before = counters(client, args.model, kw)
    with dask.config.set({"dfllm.prefix-placement": on}):
        job = dd.from_pandas(frame, npartitions=args.partitions, sort=False).llm.generate(
            "prompt", sampling_params=sp, model=args.model, **kw
        )
    start = time.perf_counter()
    out = job.compute()
    seconds = time.perf_counter() - start
    after = counters(client, args.model, kw)
    report = directory_report(client, llm_origin(job)[1].placement) if on else None
    assert out["id"].tolist() == list(range(len(frame))), "rows lost, duplicated or out of order"
    assert out["llm_error"].isna().all(), out["llm_error"].dropna().head()
    work = [after[w]["work"] - before[w]["work"] for w in sorted(after)]
    mean = sum(work) / len(work)
    return {
        "seconds": seconds,
        "rows_s": len(frame) / seconds,
        "computed": sum(after[w]["computed"] - before[w]["computed"] for w in after),
        "work": work,
        "work_spread": max(abs(w - mean) for w in work) / mean,
        "preemptions": sum(after[w]["preemptions"] - before[w]["preemptions"] for w in after),
        "placed": None
        if report is None
        else f"{report['partitions']}/{args.partitions} partitions routed, "
        f"{report['split_rows']} rows split off their group",
        "texts": list(out["generated_text"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--doc-words", type=int, default=300)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=51)
    ap.add_argument("--no-single", action="store_true", help="skip the one-engine reference run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from distributed import Client, LocalCluster

    from dfllm import LLM

    frame = make_rows(args)
    tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
    token_lists = [tok(p)["input_ids"] for p in frame["prompt"]]
    probe = LLM(args.model, max_model_len=args.max_model_len, kv_cache_memory_bytes=2**26)
    block_size, block_bytes = probe.llm_engine.cfg.block_size, probe.llm_engine.runner.block_bytes
    del probe
    args.kv_bytes = -(-args.kv_tokens // block_size) * block_bytes
    ideal = ideal_prompt_tokens(token_lists, block_size)
    total = sum(map(len, token_lists))
    print(
        f"{len(frame)} rows ({args.docs} documents x {args.questions} questions, question order), {total} prompt "
        f"tokens, ideal {ideal} computed; {args.partitions} partitions; {args.workers} workers x {args.threads} "
        f"threads; {args.max_tokens} greedy tokens per row",
        flush=True,
    )
    single = None
    if not args.no_single:
        sp = {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}
        single = list(
            frame.llm.generate("prompt", sampling_params=sp, model=args.model, **engine_kwargs(args))["generated_text"]
        )
        from dfllm.worker.engine_cache import release_engines

        release_engines()
    cluster = LocalCluster(
        n_workers=args.workers, threads_per_worker=args.threads, processes=True, dashboard_address=":0"
    )
    client = Client(cluster)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        warm = frame.head(2 * args.workers)
        with dask.config.set({"dfllm.prefix-placement": False}):
            dd.from_pandas(warm, npartitions=2 * args.workers).llm.generate(
                "prompt", sampling_params={"max_tokens": 2}, model=args.model, **engine_kwargs(args)
            ).compute()
        for r in range(args.repeats):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                res = run_mode(client, frame, args, mode == "on")
                runs[mode].append(res)
                print(
                    f"  round {r + 1} {mode:>3}: {res['rows_s']:.2f} rows/s, {res['computed']} prompt tokens "
                    f"computed ({ideal / res['computed']:.2f} of ideal), engine work {res['work']} "
                    f"(spread {100 * res['work_spread']:.1f}%), {res['preemptions']} preemptions"
                    + (f"; {res['placed']}" if res["placed"] else ""),
                    flush=True,
                )
        unshared = run_mode(client, unshared_rows(args), args, True)
    finally:
        client.close()
        cluster.close()
    med = {
        m: {k: statistics.median(r[k] for r in runs[m]) for k in ("rows_s", "computed", "seconds", "work_spread")}
        for m in runs
    }
    same = sum(a == b for a, b in zip(runs["off"][0]["texts"], runs["on"][0]["texts"]))
    same_single = None if single is None else sum(a == b for a, b in zip(single, runs["on"][0]["texts"]))
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.machine(),
        "workers": args.workers,
        "rows": len(frame),
        "prompt_tokens": total,
        "ideal_computed": ideal,
        "off": med["off"],
        "on": med["on"],
        "rows_s_ratio": med["on"]["rows_s"] / med["off"]["rows_s"],
        "ideal_over_computed_on": ideal / med["on"]["computed"],
        "ideal_over_computed_off": ideal / med["off"]["computed"],
        "same_outputs_on_off": f"{same}/{len(frame)}",
        "same_outputs_one_engine": None if same_single is None else f"{same_single}/{len(frame)}",
        "unshared_work": unshared["work"],
        "unshared_work_spread": unshared["work_spread"],
    }
    print(
        f"\noff (Dask's placement): {med['off']['rows_s']:.2f} rows/s, {med['off']['computed']:.0f} prompt tokens "
        f"computed ({report['ideal_over_computed_off']:.2f} of ideal), work spread "
        f"{100 * med['off']['work_spread']:.1f}%"
    )
    print(
        f"on  (prefix placement): {med['on']['rows_s']:.2f} rows/s, {med['on']['computed']:.0f} prompt tokens "
        f"computed ({report['ideal_over_computed_on']:.2f} of ideal), work spread "
        f"{100 * med['on']['work_spread']:.1f}%"
    )
    print(
        f"ratio on/off: {report['rows_s_ratio']:.2f}x rows/s; outputs equal on/off {report['same_outputs_on_off']}, "
        f"on vs one engine {report['same_outputs_one_engine']}; job without shared prefixes: engine work "
        f"{unshared['work']} (spread {100 * unshared['work_spread']:.1f}% of the mean)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
