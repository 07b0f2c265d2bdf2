"""One engine per process and model configuration, reused by every task that runs there.

On a Dask worker the process is the worker, so each worker loads a model once however many
partitions it runs; without a distributed client the calling process holds the engine.
Calls into one engine are serialised by its lock (the engine is not thread-safe). A
generative engine's ``dfllm_`` metrics join the process's default Prometheus registry, which
a Dask worker serves on ``/metrics``.
"""

from __future__ import annotations

import threading

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
        if key not in _engines:
            llm = LLM(model, **engine_kwargs)
            if llm.engine is not None:
                expose(llm.engine.metrics.registry)
            _engines[key] = (llm, threading.Lock())
            _loads += 1
        return _engines[key]


def load_count() -> int:
    """How many engines this process has created (for tests and diagnostics)."""
    return _loads
