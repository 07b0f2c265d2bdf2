"""The calibration run, on a worker: a sample of the job's requests timed on the real
engine (prefill throughput, a decode step's cost, how much of ``max_tokens`` rows generate)."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import uuid
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from dfllm.jobs.dry_run.requests import RequestSource
from dfllm.jobs.dry_run.survey import generation_limit, generative_engine, source_requests

if TYPE_CHECKING:
    from dfllm.engine.input_processor import EngineRequest
    from dfllm.engine.llm_engine import LLMEngine


DEFAULT_SAMPLE_ROWS = 16
DEFAULT_CALIBRATION_SECONDS = 30.0


@dataclasses.dataclass
class Calibration:
    """The calibration run's measurements, on one worker's engine.

    ``step_seconds`` and ``row_step_seconds``: a decode step takes ``step_seconds +
    row_step_seconds x rows in its batch`` (fitted over the run's steps);
    ``prefill_token_seconds``: each prompt token computed adds that; ``generated_share``:
    the sample's generated tokens over its ``max_tokens`` (a row still running when the time
    ran out counts as generating halfway from what it had to its ``max_tokens``),
    ``longest_share`` the largest of a row's (1 if any was stopped); ``censored``: rows
    stopped by the time limit."""

    rows: int
    prompt_tokens: int
    computed_prompt_tokens: int
    generated_tokens: int
    max_tokens: int
    seconds: float
    prefill_seconds: float
    step_seconds: float
    row_step_seconds: float
    prefill_token_seconds: float
    generated_share: float
    longest_share: float
    censored: int
    worker: str = ""


def calibrate(frames: list[pd.DataFrame], source: RequestSource, sample_rows: int, seconds: float) -> Calibration:
    """Run up to ``sample_rows`` distinct accepted requests of ``frames`` (spread over them)
    through this worker's engine, timed (see :class:`Calibration`)."""
    from dfllm.worker.driver import driver
    from dfllm.worker.engine_cache import lease

    with lease(source.model, dict(source.engine_kwargs)) as entry:
        engine = generative_engine(entry.llm)
        requests: list[EngineRequest] = []
        for df in frames:
            requests += source_requests(source, df, engine, entry.lock)[0] if len(df) else []
        sample = spread_evenly(_distinct(requests), sample_rows)
        cfg = entry.llm.config
        cal = driver().call(
            lambda: measure(engine, entry.lock, sample, seconds, cfg.max_model_len, cfg.max_num_batched_tokens)
        )
    cal.worker = _worker_address()
    return cal


def _worker_address() -> str:
    try:
        from distributed import get_worker

        return str(get_worker().address)
    except (ImportError, ValueError):
        return "this process"


def _distinct(requests: list[EngineRequest]) -> list[EngineRequest]:
    seen: set = set()
    out = []
    for r in requests:
        key = (tuple(r.prompt_token_ids), repr(r.params))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def spread_evenly(items: list, n: int) -> list:
    """``n`` of ``items`` evenly spaced (all if there are no more)."""
    if len(items) <= n:
        return list(items)
    return [items[int(k * len(items) / n)] for k in range(n)]


def _run(
    engine: LLMEngine,
    lock: threading.Lock,
    requests: list[EngineRequest],
    deadline: float | None,
    steps: list[tuple[float, int]] | None = None,
) -> tuple[dict[int, int], list[int]]:
    """Add ``requests`` and step the engine until they finish (or ``deadline``, then abort
    the rest). Returns each finished request's generated token count by its position in
    ``requests``, and the positions of those aborted; ``steps`` gets ``(seconds, batch)`` of
    every pure decode step (no prompt waiting, not the first step)."""
    run = uuid.uuid4().hex[:12]
    ids = [f"dfllm-dry-run-{run}-{k}" for k in range(len(requests))]
    with lock:
        for rid, r in zip(ids, requests):
            engine.add_request(rid, r)
    done: dict[int, int] = {}
    first = True
    while True:
        with lock:
            if not engine.has_unfinished_requests():
                break
            if deadline is not None and time.perf_counter() > deadline:
                engine.abort_request([rid for k, rid in enumerate(ids) if k not in done])
                break
            before = engine.stats()
            t = time.perf_counter()
            outputs = engine.step()
            dt = time.perf_counter() - t
        if steps is not None and not first and before.num_waiting == 0 and before.num_running:
            steps.append((dt, before.num_running))
        first = False
        for out in outputs:
            done[int(out.request_id.rsplit("-", 1)[1])] = len(out.outputs[0].token_ids)
    return done, [k for k in range(len(requests)) if k not in done]


def measure(
    engine: LLMEngine,
    lock: threading.Lock,
    sample: list[EngineRequest],
    seconds: float,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> Calibration:
    """Time ``sample`` on ``engine`` (on the thread that steps it): its prompts alone, then
    the rows as the job would run them, then one row alone if the batch sizes seen do not
    tell a decode step's fixed cost from its cost per row; all in about ``seconds`` (rows
    still running then are stopped)."""
    if not sample:
        return Calibration(0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0)
    start = time.perf_counter()
    with lock:
        engine.reset_prefix_cache()
        hits = engine.stats().prefix_cache_hits
    prompt_tokens = sum(len(r.prompt_token_ids) for r in sample)
    one = [dataclasses.replace(r, params=dataclasses.replace(r.params, max_tokens=1, min_tokens=0)) for r in sample]
    t = time.perf_counter()
    _run(engine, lock, one, None)
    prefill = time.perf_counter() - t
    with lock:
        computed = max(1, prompt_tokens - (engine.stats().prefix_cache_hits - hits))
    steps: list[tuple[float, int]] = []
    done, aborted = _run(engine, lock, sample, start + 0.85 * seconds, steps)
    reached = len(steps) + 1  # tokens a row still running at the time limit had generated, at least
    batches = {b for _, b in steps}
    if len(batches) < 2 or max(batches) < 2 * min(batches):  # one row alone: the fixed cost of a step
        short = min(sample, key=lambda r: len(r.prompt_token_ids))
        alone = dataclasses.replace(
            short, params=dataclasses.replace(short.params, max_tokens=6, min_tokens=6, ignore_eos=True)
        )
        typical = float(np.median([t for t, _ in steps])) if steps else 0.0
        _run(
            engine, lock, [alone], time.perf_counter() + max(start + seconds - time.perf_counter(), 3 * typical), steps
        )
    fixed, per_row = fit_steps(steps)
    prefill_steps = max(1, math.ceil(computed / max(1, max_num_batched_tokens)))
    per_token = max(0.0, prefill - prefill_steps * (fixed + per_row * len(sample))) / computed
    limits = [generation_limit(r, max_model_len) for r in sample]
    # a row stopped by the time limit: halfway between what it had generated and its max_tokens
    expected = sum(done.values()) + sum((min(reached, limits[k]) + limits[k]) / 2 for k in aborted)
    share = min(1.0, expected / sum(limits)) if sum(limits) else 1.0
    by_row = [n / limits[k] for k, n in done.items() if limits[k]]
    longest = 1.0 if aborted or not by_row else min(1.0, max(by_row))
    return Calibration(
        len(sample),
        prompt_tokens,
        computed,
        sum(done.values()),
        sum(limits),
        time.perf_counter() - start,
        prefill,
        fixed,
        per_row,
        per_token,
        share,
        longest,
        len(aborted),
    )


def fit_steps(steps: list[tuple[float, int]]) -> tuple[float, float]:
    """``(fixed, per_row)`` seconds of a decode step of ``rows``: a least-squares line through
    the steps' ``(seconds, rows)``, neither part negative."""
    if not steps:
        return 0.0, 0.0
    t = np.array([s for s, _ in steps], dtype=float)
    n = np.array([b for _, b in steps], dtype=float)
    if len(set(n.tolist())) < 2:
        return float(np.median(t)), 0.0
    per_row, fixed = np.polyfit(n, t, 1)
    if per_row < 0:
        return float(np.median(t)), 0.0
    if fixed < 0:
        return 0.0, float(np.median(t / n))
    return float(fixed), float(per_row)
