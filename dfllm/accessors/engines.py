"""One engine per process and model configuration, reused by every task that runs there.

On a Dask worker the process is the worker, so each worker loads a model once however many
partitions it runs; without a distributed client the calling process holds the engine.
Generation from concurrent tasks of one worker (threads) shares the engine's continuous
batches: each task queues its rows, then the tasks take turns stepping the engine, one step
at a time under the engine's lock, until their own rows are done. Pooling calls run one at
a time under the same lock. A
generative engine's ``dfllm_`` metrics join the process's default Prometheus registry, which
a Dask worker serves on ``/metrics``.
"""

from __future__ import annotations

import os
import threading

import torch

from dfllm.accessors.prometheus import expose
from dfllm.llm import LLM

_engines: dict[tuple, tuple[LLM, threading.Lock]] = {}
_guard = threading.Lock()
_loads = 0


def engine_key(model, engine_kwargs: dict) -> tuple:
    return (None if model is None else str(model), tuple(sorted(engine_kwargs.items())))


def get_engine(model, engine_kwargs: dict) -> tuple[LLM, threading.Lock]:
    """The process's engine for ``(model, engine_kwargs)`` and its lock, created on first use."""
    global _loads
    key = engine_key(model, engine_kwargs)
    with _guard:
        use_worker_threads()
        if key not in _engines:
            llm = LLM(model, **engine_kwargs)
            if llm.engine is not None:
                expose(llm.engine.metrics.registry)
            _engines[key] = (llm, threading.Lock())
            _loads += 1
        return _engines[key]


class Submission:
    """Rows one task handed to a shared engine; ``ids`` is set once they are queued."""

    def __init__(self, prompts: list[dict], params: list):
        self.prompts, self.params = prompts, params
        self.ids: list[str] | None = None
        self.error: Exception | None = None


_pending: dict[int, list[Submission]] = {}
_pending_lock = threading.Lock()


def generate_shared(llm: LLM, lock: threading.Lock, prompts: list[dict], params: list) -> list:
    """``llm.generate`` for one task, batched with whatever other tasks have queued.

    The rows are handed over without waiting for a running step; whichever task steps next
    queues them, so every task's rows join the next step.
    """
    sub = Submission(prompts, params)
    with _pending_lock:
        _pending.setdefault(id(llm), []).append(sub)
    while True:
        with lock:
            _queue_pending(llm)
            if sub.error is not None:
                raise sub.error
            if all(i in llm._done for i in sub.ids):
                return [llm._done.pop(i) for i in sub.ids]
            llm._step_and_collect()


def _queue_pending(llm: LLM) -> None:
    """Add every handed-over submission to the engine (the caller holds the engine's lock)."""
    with _pending_lock:
        subs, _pending[id(llm)] = _pending.get(id(llm), []), []
    for sub in subs:
        try:
            sub.ids = llm._add_requests(*llm._tokenize(sub.prompts, sub.params, "generate"))
        except Exception as exc:  # reported to the task that submitted these rows
            sub.error = exc


def use_worker_threads() -> None:
    """On a Dask worker, let torch use all of the worker's threads, in the calling thread.

    With OpenMP the thread count is a per-thread setting, and Dask runs tasks on its own
    executor threads, so every task sets it before computing.

    Dask starts workers with ``OMP_NUM_THREADS=1`` so that parallel tasks do not
    oversubscribe the cores; but a worker's LLM tasks take turns on one engine, so the
    engine should use every core the worker was given (capped at the machine's cores: a
    worker may be given more threads than cores so that more partitions feed its engine
    at once). ``DFLLM_NUM_THREADS`` overrides.
    """
    override = os.environ.get("DFLLM_NUM_THREADS")
    if override:
        _set_threads(int(override))
        return
    try:
        from distributed import get_worker

        nthreads = get_worker().state.nthreads
    except (ImportError, ValueError, AttributeError):
        return
    _set_threads(max(1, min(nthreads, os.cpu_count() or 1)))


def _set_threads(n: int) -> None:
    # torch skips the call when n equals its cached count, which another thread may have
    # set; toggling forces OpenMP's per-thread setting for this thread.
    torch.set_num_threads(1 if n != 1 else 2)
    torch.set_num_threads(n)


def load_count() -> int:
    """How many engines this process has created (for tests and diagnostics)."""
    return _loads
