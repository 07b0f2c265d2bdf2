"""Dataframe generation on Dask vs one in-process ``LLM.generate``, and worker peak memory.

Workload
--------
``--rows`` (default 256) short questions built deterministically from a seeded RNG: 5-40
words drawn from a fixed word list behind a question opener, with an integer ``id``. They
are written as a Parquet dataset of ``--partitions`` (default 8) files in a temporary
directory and read back with ``dd.read_parquet``, so the Dask run is a real
read -> generate -> write pipeline. Every row is rendered with the template
``"Question: {question}\\nAnswer:"`` and decoded greedily (temperature 0) for exactly
``--max-tokens`` (default 16) tokens (``ignore_eos=True``) with the bundled model (or
``--model``) and ``max_model_len=--max-model-len``.

- baseline: one ``LLM.generate`` call over all rendered prompts in this process, after a
  small warm-up call; rows / wall seconds of that call.
- dfllm on Dask: a ``distributed.LocalCluster`` of ``--workers`` worker processes with
  ``--threads`` threads each (default one worker with two threads: on a 2-core machine
  that is the like-for-like comparison with the in-process baseline). Each worker's engine
  is loaded and warmed up first by a 2-row frame through the same accessor and engine
  kwargs (so model load time is excluded), its prefix cache is emptied, and then
  ``dd.read_parquet(...).llm.generate(...).to_parquet(...)`` is timed; rows / wall seconds.
  The output is read back and checked: every input ``id`` exactly once, no ``llm_error``,
  and the fraction of rows whose text equals the baseline's (reported, not asserted:
  batch composition can flip a near-tied greedy token in float arithmetic).
- memory: while the timed write runs, a background thread samples every worker process's
  RSS (``psutil`` on the worker pids, which ``client.run`` reports; every
  ``--sample-interval`` s, default 0.2). This is done for the 1x dataset and for a dataset
  ``--scale`` (default 10) times larger with the same partition size (so ``--scale`` times
  the partitions); each size runs on a fresh cluster so that neither run inherits the
  other's memory. The two peaks and their ratio are reported (``--skip-scale`` skips the
  large run). The first ``--rows`` rows of the large dataset are the 1x rows, so they are
  compared with the baseline too.

Targets (from the issue): Dask rows/s >= 0.95 x baseline rows/s; peak worker RSS at 10x
rows <= 1.3 x the peak at 1x.

Run (from the repository root, on an otherwise idle machine)::

    python benchmarks/bench_dataframe.py                        # 256 rows, then 2560
    python benchmarks/bench_dataframe.py --rows 16 --partitions 4 --max-tokens 4 --scale 2   # quick check
    python benchmarks/bench_dataframe.py --skip-scale --json bench_df.json

Threads: Dask's nanny starts worker processes with ``OMP_NUM_THREADS=1`` (its
``distributed.nanny.pre-spawn-environ`` setting), which torch honours, while this process
uses torch's default (one thread per core); the report shows each side's torch thread
count. ``--torch-threads N`` gives both sides N threads (``torch.set_num_threads`` here,
the workers' ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``/``OPENBLAS_NUM_THREADS``). Run it on
an otherwise idle machine: with another process busy on a core, torch's thread pool is
oversubscribed and multi-threaded runs slow down several-fold.

Memory: worker RSS includes the engine's KV cache only as far as its pages have been
written, so it grows with the KV blocks the engine has ever handed out, not just with the
blocks in use at once.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import os
import platform
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import dask
import dask.dataframe as dd
import pandas as pd
import psutil
import torch

import dfllm  # noqa: F401  (registers the .llm accessors)
from dfllm import LLM, SamplingParams

SEED = 1234
TEMPLATE = "Question: {question}\nAnswer:"
MIN_WORDS, MAX_WORDS = 5, 40
MiB = 2**20

WORDS = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book
eye job word business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body information back
parent face level office door health person art war history party result change morning
reason research teacher force education river garden engine bridge market signal network
window planet forest ocean mountain village library machine theory energy pattern memory
language music picture science season winter summer harvest simple quiet rapid ancient
modern bright careful gentle heavy hidden honest narrow obvious patient private public rare
rough silent strange sudden useful warm wild build carry choose describe explain follow
gather improve measure notice prepare protect reach remember repair share support travel
""".split()

OPENERS = ["Why does", "How can", "What is", "When should", "Where does", "Who can explain why", "Is it true that"]


# ---- workload ----------------------------------------------------------------------------
def make_questions(rows: int, seed: int = SEED) -> pd.DataFrame:
    """``rows`` questions of 5-40 words; the first k rows are the same for any ``rows`` >= k."""
    rng = random.Random(seed)
    questions = []
    for _ in range(rows):
        words = [rng.choice(WORDS) for _ in range(rng.randint(MIN_WORDS, MAX_WORDS))]
        questions.append(f"{rng.choice(OPENERS)} {' '.join(words)}?")
    return pd.DataFrame({"id": range(rows), "question": questions})


def write_dataset(df: pd.DataFrame, path: Path, partitions: int) -> None:
    dd.from_pandas(df, npartitions=partitions, sort=False).to_parquet(str(path), write_index=False)


def render(df: pd.DataFrame) -> list[str]:
    return [TEMPLATE.format(question=q) for q in df["question"]]


def sampling(args) -> dict:
    return {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}


def engine_kwargs(args) -> dict:
    return {"max_model_len": args.max_model_len}


# ---- baseline: one LLM.generate in this process -----------------------------------------
class Baseline:
    """One in-process engine, loaded and warmed once; ``run`` times ``LLM.generate`` over rows."""

    def __init__(self, args):
        self.llm = LLM(args.model, **engine_kwargs(args))
        self.params = SamplingParams(**sampling(args))
        warm = render(make_questions(4, seed=SEED + 1))
        self.llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)

    def run(self, questions: pd.DataFrame) -> dict:
        """Rows/s of one ``LLM.generate`` over the rendered questions (prefix cache emptied first)."""
        self.llm.reset_prefix_cache()
        prompts = render(questions)
        start = time.perf_counter()
        outs = self.llm.generate(prompts, self.params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return {
            "rows": len(prompts),
            "seconds": seconds,
            "rows_s": len(prompts) / seconds,
            "texts": [o.outputs[0].text for o in outs],
            "torch_threads": torch.get_num_threads(),
        }

    def close(self) -> None:
        del self.llm
        gc.collect()


# ---- worker memory ------------------------------------------------------------------------
class RSSSampler:
    """Background thread: the peak RSS of each given process, sampled every ``interval`` s."""

    def __init__(self, pids: dict[str, int], interval: float):
        self.procs = {w: psutil.Process(pid) for w, pid in pids.items()}
        self.peaks = {w: 0 for w in pids}
        self.samples = 0
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        for w, p in self.procs.items():
            try:
                self.peaks[w] = max(self.peaks[w], p.memory_info().rss)
            except psutil.Error:
                pass
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


# ---- dfllm on Dask -------------------------------------------------------------------------
def start_cluster(args):
    from distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=args.workers, threads_per_worker=args.threads, processes=True, dashboard_address=":0"
    )
    client = Client(cluster)
    client.wait_for_workers(args.workers)
    return cluster, client


def _warm_worker(model, sampling_params: dict, kwargs: dict) -> int:
    """On a worker: run a 2-row frame through the accessor, loading and warming the engine."""
    importlib.import_module("dfllm")  # registers .llm on pandas in this worker process

    frame = pd.DataFrame({"question": ["What is a warm-up?", "Why warm up an engine?"]})
    out = frame.llm.generate(TEMPLATE, model=model, sampling_params=sampling_params, **kwargs)
    return int(out["num_generated_tokens"].sum())


def _worker_state() -> dict:
    """On a worker: pid, torch threads, and a freshly emptied prefix cache on every engine."""
    import torch as _torch

    from dfllm.worker import engine_cache

    for llm in engine_cache.engines():  # idle: the workers run no task now
        if llm.engine is not None:
            llm.reset_prefix_cache()
    return {"pid": os.getpid(), "torch_threads": _torch.get_num_threads(), "engines": engine_cache.load_count()}


def warm_up_workers(client, args) -> dict:
    """Load and warm every worker's engine (pinned per worker); the workers' state afterwards."""
    warm = dict(sampling(args), max_tokens=min(4, args.max_tokens))
    futures = [
        client.submit(
            _warm_worker, args.model, warm, engine_kwargs(args), workers=[w], allow_other_workers=False, pure=False
        )
        for w in client.scheduler_info()["workers"]
    ]
    client.gather(futures)
    return client.run(_worker_state)


def run_dask(client, in_path: Path, out_path: Path, pids: dict[str, int], args) -> dict:
    """Seconds of read_parquet -> .llm.generate -> to_parquet, and the workers' peak RSS."""
    with RSSSampler(pids, args.sample_interval) as sampler:
        start = time.perf_counter()
        ddf = dd.read_parquet(str(in_path))
        ddf.llm.generate(TEMPLATE, model=args.model, sampling_params=sampling(args), **engine_kwargs(args)).to_parquet(
            str(out_path), write_index=False
        )
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_rss": sampler.peaks, "samples": sampler.samples, "partitions": ddf.npartitions}


def check_output(out_path: Path, rows: int, max_tokens: int, baseline_texts: list[str]) -> dict:
    """Every input id exactly once, no row errors, and the greedy match with the baseline."""
    out = pd.read_parquet(out_path).sort_values("id")
    ids = out["id"].tolist()
    every_row_once = ids == list(range(rows))
    errors = int(out["llm_error"].notna().sum())
    full_length = bool((out["num_generated_tokens"] == max_tokens).all())
    texts = out["generated_text"].tolist()
    compared = min(len(baseline_texts), len(texts)) if every_row_once else 0
    same = sum(a == b for a, b in zip(texts[:compared], baseline_texts[:compared]))
    return {
        "every_row_once": every_row_once,
        "rows_out": len(ids),
        "row_errors": errors,
        "full_length": full_length,
        "match": same / compared if compared else float("nan"),
        "compared": compared,
    }


def measure_size(
    questions: pd.DataFrame,
    partitions: int,
    workdir: Path,
    tag: str,
    args,
    baseline: Baseline | None = None,
    repeats: int = 1,
    reference: list[str] | None = None,
) -> dict:
    """One dataset size on a fresh cluster: warm up, time the write ``repeats`` times (each
    right after a baseline run when ``baseline`` is given, so both see the same machine
    state), check the output, shut down. Seconds are medians; the ratio is the median of
    the per-repeat ratios."""
    in_path = workdir / f"in-{tag}"
    write_dataset(questions, in_path, partitions)
    cluster, client = start_cluster(args)
    bases, timings = [], []
    try:
        state = warm_up_workers(client, args)
        pids = {w: s["pid"] for w, s in state.items()}
        idle_rss = {w: psutil.Process(pid).memory_info().rss for w, pid in pids.items()}
        for r in range(repeats):
            if baseline is not None:
                bases.append(baseline.run(questions))
                print(f"  baseline {r + 1}/{repeats}: {bases[-1]['rows_s']:.2f} rows/s", flush=True)
            client.run(_worker_state)  # empty the workers' prefix caches, as the baseline's
            timings.append(run_dask(client, in_path, workdir / f"out-{tag}-{r}", pids, args))
            print(f"  dask {tag} {r + 1}/{repeats}: {len(questions) / timings[-1]['seconds']:.2f} rows/s", flush=True)
    finally:
        client.close()
        cluster.close()
    texts = bases[0]["texts"] if bases else (reference or [])
    check = check_output(workdir / f"out-{tag}-0", len(questions), args.max_tokens, texts)
    rows = len(questions)
    seconds = statistics.median(t["seconds"] for t in timings)
    peaks = {w: max(t["peak_rss"][w] for t in timings) for w in pids}
    out = {
        "tag": tag,
        "rows": rows,
        "seconds": seconds,
        "rows_s": rows / seconds,
        "repeats": repeats,
        "rows_s_runs": [rows / t["seconds"] for t in timings],
        "peak_rss": peaks,
        "samples": sum(t["samples"] for t in timings),
        "partitions": timings[0]["partitions"],
        "peak_rss_max": max(peaks.values()),
        "idle_rss_max": max(idle_rss.values()),
        "worker_torch_threads": sorted({s["torch_threads"] for s in state.values()}),
        "engine_loads": sorted(s["engines"] for s in state.values()),
        **check,
    }
    if bases:
        base_seconds = statistics.median(b["seconds"] for b in bases)
        out["baseline"] = {
            "rows": rows,
            "seconds": base_seconds,
            "rows_s": rows / base_seconds,
            "rows_s_runs": [b["rows_s"] for b in bases],
            "torch_threads": bases[0]["torch_threads"],
        }
        out["ratio"] = statistics.median(b["seconds"] / t["seconds"] for b, t in zip(bases, timings))
        out["texts"] = texts
    return out


# ---- report --------------------------------------------------------------------------------
def print_report(base: dict, runs: list[dict], meta: dict) -> None:
    one = runs[0]
    print()
    print(
        f"{'run':<22}{'rows':>7}{'parts':>7}{'seconds':>10}{'rows/s':>10}{'peak RSS MiB':>14}"
        f"{'torch thr':>11}{'match':>8}"
    )
    print(
        f"{'LLM.generate (1 proc)':<22}{base['rows']:>7}{'-':>7}{base['seconds']:>10.2f}{base['rows_s']:>10.2f}"
        f"{'-':>14}{base['torch_threads']:>11}{'-':>8}"
    )
    for r in runs:
        threads = ",".join(map(str, r["worker_torch_threads"]))
        print(
            f"{'dask ' + r['tag']:<22}{r['rows']:>7}{r['partitions']:>7}{r['seconds']:>10.2f}{r['rows_s']:>10.2f}"
            f"{r['peak_rss_max'] / MiB:>14.0f}{threads:>11}{r['match']:>8.3f}"
        )
    print()
    print(
        f"throughput dask/baseline (1x): {one['ratio']:.2f}  (median of {one['repeats']} alternating pairs; "
        f"runs dask {', '.join(f'{x:.2f}' for x in one['rows_s_runs'])}, baseline "
        f"{', '.join(f'{x:.2f}' for x in base['rows_s_runs'])} rows/s; target >= 0.95)"
    )
    if one["worker_torch_threads"] != [base["torch_threads"]]:
        print(
            f"note: torch threads differ: baseline {base['torch_threads']}, workers "
            f"{one['worker_torch_threads']} (see --torch-threads)"
        )
    if len(runs) > 1:
        big = runs[1]
        print(
            f"peak worker RSS: 1x {one['peak_rss_max'] / MiB:.0f} MiB, "
            f"{big['tag']} {big['peak_rss_max'] / MiB:.0f} MiB, "
            f"ratio {big['peak_rss_max'] / one['peak_rss_max']:.3f}  (target <= 1.3)"
        )
    for r in runs:
        print(
            f"dask {r['tag']}: every row once {r['every_row_once']} ({r['rows_out']} rows out), row errors "
            f"{r['row_errors']}, all {meta['max_tokens']} tokens {r['full_length']}, greedy match with baseline "
            f"{r['match']:.3f} of {r['compared']} rows; RSS before the write {r['idle_rss_max'] / MiB:.0f} MiB, "
            f"{r['samples']} RSS samples"
        )
    print(
        f"date {meta['date']}, CPUs {meta['cpu_count']}, torch {meta['torch']}, dask {meta['dask']}, "
        f"{meta['workers']} worker(s) x {meta['threads']} thread(s), {meta['machine']}"
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--model", default=None, help="model directory or bundled alias (default: bundled SmolLM2)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="threads per worker")
    p.add_argument("--scale", type=int, default=10, help="the memory run uses this many times the rows and partitions")
    p.add_argument("--skip-scale", action="store_true", help="skip the large memory run")
    p.add_argument("--sample-interval", type=float, default=0.2, help="seconds between RSS samples")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads for the baseline and each worker (default: torch's default here, "
        "Dask's OMP_NUM_THREADS=1 on workers)",
    )
    p.add_argument("--repeats", type=int, default=3, help="alternating baseline/Dask pairs for the 1x size")
    p.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    args = p.parse_args()
    if args.rows < args.partitions or args.partitions < 1:
        p.error("need --rows >= --partitions >= 1")
    return args


def main() -> None:
    args = parse_args()
    if args.torch_threads is not None:
        n = args.torch_threads
        torch.set_num_threads(n)
        dask.config.set(
            {
                "distributed.nanny.pre-spawn-environ": {
                    **dask.config.get("distributed.nanny.pre-spawn-environ", {}),
                    "OMP_NUM_THREADS": n,
                    "MKL_NUM_THREADS": n,
                    "OPENBLAS_NUM_THREADS": n,
                }
            }
        )
    scale = 1 if args.skip_scale else args.scale
    questions = make_questions(args.rows * scale)
    small = questions.iloc[: args.rows].reset_index(drop=True)
    words = small["question"].str.split().str.len()
    print(
        f"workload: {args.rows} rows in {args.partitions} partitions ({words.min()}-{words.max()} words, "
        f"median {int(words.median())}), {args.max_tokens} tokens each, greedy"
        + ("" if args.skip_scale else f"; memory run: {len(questions)} rows in {args.partitions * scale} partitions")
    )

    baseline = Baseline(args)
    runs = []
    with tempfile.TemporaryDirectory(prefix="dfllm-bench-df-") as tmp:
        runs.append(measure_size(small, args.partitions, Path(tmp), "1x", args, baseline, args.repeats))
        baseline.close()
        base = runs[0]["baseline"]
        r = runs[0]
        print(
            f"1x: baseline {base['rows_s']:.2f} rows/s, dask {r['rows_s']:.2f} rows/s (medians of {args.repeats}), "
            f"ratio {r['ratio']:.2f}; peak worker RSS {r['peak_rss_max'] / MiB:.0f} MiB",
            flush=True,
        )
        if not args.skip_scale:
            runs.append(
                measure_size(
                    questions, args.partitions * scale, Path(tmp), f"{scale}x", args, reference=runs[0]["texts"]
                )
            )
            r = runs[-1]
            print(
                f"dask {r['tag']}: {r['seconds']:.2f}s, {r['rows_s']:.2f} rows/s, "
                f"peak worker RSS {r['peak_rss_max'] / MiB:.0f} MiB",
                flush=True,
            )

    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "dask": dask.__version__,
        "workers": args.workers,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "machine": platform.processor() or platform.machine(),
    }
    print_report(base, runs, meta)

    if args.json:
        one = runs[0]
        figures = {
            "args": vars(args),
            "meta": meta,
            "baseline": base,
            "dask": [{k: v for k, v in r.items() if k != "texts"} for r in runs],
            "throughput_ratio": one["ratio"],
            "peak_rss_ratio": runs[1]["peak_rss_max"] / one["peak_rss_max"] if len(runs) > 1 else None,
        }
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
