"""The process's engines: one per model configuration, reused by every task that runs here.

On a Dask worker the process is the worker, so each worker loads a model once however many
partitions it runs; without a distributed client the calling process holds the engines.
Engines are built and shut down on the driver thread (:mod:`dfllm.worker.driver`). A
generative engine's ``dfllm_`` metrics join the process's default Prometheus registry,
which a Dask worker serves on ``/metrics``, for as long as the engine is held.

Lifecycle. A task holds its engine while it runs (:func:`lease`); an engine no running task
holds is idle.

- At most ``DFLLM_MAX_ENGINES`` (default 2) engine configurations are kept per process.
  When a task asks for a new one and the bound is reached, the least recently used idle
  engines are shut down and dropped first (their metrics leave the registry). An engine in
  use is never dropped: if every engine is in use the bound is exceeded until they are
  idle again, with a logged warning.
- :func:`release_engines` (``dfllm.release_engines``) shuts down and drops every idle
  engine now, e.g. ``client.run(dfllm.release_engines)`` on every Dask worker between jobs;
  engines in use are left to their tasks. A later task loads its engine again.

Each lease in a Dask task also tells the dashboard (:mod:`dfllm.worker.progress`) that
its partition is in flight, then done or failed.

For tests and diagnostics, :func:`load_count` counts the engines this process built and
:func:`engines` lists those it holds.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from dfllm.llm import LLM
from dfllm.worker import progress
from dfllm.worker.driver import driver
from dfllm.worker.prometheus import expose, unexpose

logger = logging.getLogger("dfllm")

DEFAULT_MAX_ENGINES = 2


class CachedEngine:
    """An engine of the cache: the LLM, the lock that serialises its tokenizer and steps,
    and how many running tasks hold it."""

    def __init__(self, key: tuple, llm: LLM):
        self.key, self.llm = key, llm
        self.lock = threading.Lock()
        self.users = 0


_engines: collections.OrderedDict[tuple, CachedEngine] = collections.OrderedDict()  # least recently used first
_guard = threading.Lock()  # never taken while holding an engine's lock
_loads = 0


def engine_key(model, engine_kwargs: dict) -> tuple:
    """The cache key of a model configuration."""
    # values may be dicts (hf_overrides, structured_outputs_config): keyed by their repr
    return (None if model is None else str(model), tuple(sorted((k, repr(v)) for k, v in engine_kwargs.items())))


def max_engines() -> int:
    """``DFLLM_MAX_ENGINES``: engine configurations a process keeps (default 2)."""
    raw = os.environ.get("DFLLM_MAX_ENGINES", "").strip()
    if not raw:
        return DEFAULT_MAX_ENGINES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"DFLLM_MAX_ENGINES must be a positive integer, got {raw!r}")
    return value


@contextlib.contextmanager
def lease(model, engine_kwargs: dict) -> Iterator[CachedEngine]:
    """The process's engine for ``(model, engine_kwargs)``, loaded on first use, in use
    (never shut down) until the block ends."""
    global _loads
    key = engine_key(model, engine_kwargs)
    task = progress.partition_started()  # the dashboard's partitions in flight (a no-op outside Dask tasks)
    failed = True
    try:
        with _guard:
            entry = _engines.get(key)
            if entry is None:
                _make_room()
                llm = driver().call(lambda: LLM(model, **engine_kwargs))
                if llm.engine is not None:
                    expose(llm.engine.metrics.registry)
                entry = _engines[key] = CachedEngine(key, llm)
                _loads += 1
            _engines.move_to_end(key)
            entry.users += 1
        try:
            yield entry
            failed = False
        finally:
            with _guard:
                entry.users -= 1
    finally:
        progress.partition_ended(task, failed)


def get_engine(model, engine_kwargs: dict) -> LLM:
    """The process's engine for ``(model, engine_kwargs)``, loaded if need be, not held
    (for tests and diagnostics: it may be dropped once idle)."""
    with lease(model, engine_kwargs) as entry:
        return entry.llm


def release_engines() -> int:
    """Shut down and drop every idle engine of this process; how many were dropped.

    An engine in use by a running task is not touched (freeing it under a running step
    would break that task): it stays until the task ends and a later call, or the
    ``DFLLM_MAX_ENGINES`` bound, drops it. A later task loads its engine again. On a Dask
    cluster: ``client.run(dfllm.release_engines)`` releases the engines of every worker.
    """
    with _guard:
        idle = [key for key, entry in _engines.items() if entry.users == 0]
        _drop(idle)
    return len(idle)


def _make_room() -> None:
    """Before loading one more engine (holding ``_guard``): drop the least recently used
    idle engines beyond ``DFLLM_MAX_ENGINES - 1``."""
    limit = max_engines()
    excess = len(_engines) + 1 - limit
    if excess <= 0:
        return
    _drop([key for key, entry in _engines.items() if entry.users == 0][:excess])
    if len(_engines) + 1 > limit:
        logger.warning(
            "loading engine %d of this process although DFLLM_MAX_ENGINES=%d: the others are in use",
            len(_engines) + 1,
            limit,
        )


def _drop(keys: list[tuple]) -> None:
    """Forget the engines of ``keys`` and shut them down on the driver thread (holding ``_guard``)."""
    llms = [_engines.pop(key).llm for key in keys]
    if llms:
        driver().call(lambda: _shut_down(llms))


def _shut_down(llms: list[LLM]) -> None:
    """Shut ``llms`` down and free their memory (emptying the list: nothing keeps them)."""
    while llms:
        llm = llms.pop()
        if llm.engine is not None:
            unexpose(llm.engine.metrics.registry)
        llm.shutdown()
        del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engines() -> list[LLM]:
    """The engines this process holds, least recently used first (for diagnostics)."""
    with _guard:
        return [entry.llm for entry in _engines.values()]


def engines_now() -> list[LLM]:
    """The engines this process holds, read without waiting for an engine being loaded (the
    dashboard's reports run on a Dask worker's event loop, which must not block)."""
    for _ in range(3):
        try:
            return [entry.llm for entry in list(_engines.values())]
        except RuntimeError:  # changed while being read: read again
            continue
    return []


def load_count() -> int:
    """How many engines this process has created (for tests and diagnostics)."""
    return _loads


def engine_reports() -> list[dict]:
    """Each engine this process holds: its model, device, parallel sizes and metrics (what
    the dashboard shows; registered with :func:`dfllm.worker.progress.add_engine_source`)."""
    from dfllm.engine.metrics import Counter, Gauge, snapshot

    out = []
    for llm in engines_now():
        cfg = llm.config
        info: dict[str, Any] = {
            "model": cfg.model_path.name,
            "device": str(cfg.device),
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "pipeline_parallel_size": cfg.pipeline_parallel_size,
            "kind": "generate" if llm.engine is not None else "pooling",
        }
        if llm.engine is not None:
            values = {m.name: m.value for m in snapshot(llm.engine.metrics.registry) if isinstance(m, Counter | Gauge)}
            for field, name in (
                ("running", "dfllm_num_requests_running"),
                ("waiting", "dfllm_num_requests_waiting"),
                ("kv_cache_usage", "dfllm_kv_cache_usage_perc"),
                ("prompt_tokens", "dfllm_prompt_tokens"),
                ("generation_tokens", "dfllm_generation_tokens"),
                ("preemptions", "dfllm_num_preemptions"),
                ("prefix_cache_queries", "dfllm_prefix_cache_queries"),
                ("prefix_cache_hits", "dfllm_prefix_cache_hits"),
            ):
                value = values.get(name, 0)
                info[field] = float(value) if field == "kv_cache_usage" else int(value)
        out.append(info)
    return out


progress.add_engine_source(engine_reports)
