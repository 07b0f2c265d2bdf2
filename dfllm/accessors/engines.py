"""One engine per process and model configuration, reused by every task that runs there.

On a Dask worker the process is the worker, so each worker loads a model once however many
partitions it runs; without a distributed client the calling process holds the engine.
Generation from concurrent tasks of one worker (threads) shares the engine's continuous
batches: each task hands its rows to the engine's driver thread, which steps the engine for
everyone. Pooling calls run one at a time under the engine's lock. A generative engine's
``dfllm_`` metrics join the process's default Prometheus registry, which a Dask worker
serves on ``/metrics``.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import torch
from tqdm.auto import tqdm

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
            if worker_thread_count() is not None:
                _keep_torch_buffers_on_the_heap()
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
        self.finished = 0  # rows whose output is ready
        self.done = False


class EngineDriver:
    """One thread per engine that steps it for every task of the process.

    Tasks hand over their rows and wait; the driver queues whatever has arrived before each
    step, so concurrent partitions share continuous batches. Stepping from one thread also
    keeps one OpenMP thread team busy instead of one per Dask executor thread.
    """

    def __init__(self, llm: LLM, lock: threading.Lock, threads: int | None):
        self.llm, self.lock, self.threads = llm, lock, threads
        self.cv = threading.Condition()
        self.pending: list[Submission] = []
        self.active: list[Submission] = []  # queued in the engine, not yet finished
        threading.Thread(target=self._loop, name="dfllm-engine", daemon=True).start()

    def generate(self, prompts: list[dict], params: list, progress: bool = False) -> list:
        sub = Submission(prompts, params)
        with tqdm(total=len(prompts), desc="llm rows", unit="row", disable=not progress) as bar, self.cv:
            self.pending.append(sub)
            self.cv.notify_all()
            while sub.error is None and not sub.done:  # the driver notifies after every step
                self.cv.wait()
                if sub.finished > bar.n:
                    bar.update(sub.finished - bar.n)
        if sub.error is not None:
            raise sub.error
        with self.lock:
            return [self.llm._done.pop(i) for i in sub.ids]

    def _loop(self) -> None:
        if self.threads:
            _set_threads(self.threads)
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.pending or self.llm.engine.has_unfinished())
                subs, self.pending = self.pending, []
            with self.lock:
                for sub in subs:
                    try:
                        sub.ids = self.llm._add_requests(*self.llm._tokenize(sub.prompts, sub.params, "generate"))
                        self.active.append(sub)
                    except Exception as exc:  # reported to the task that submitted these rows
                        sub.error = exc
                if self.llm.engine.has_unfinished():
                    try:
                        self.llm._step_and_collect()
                    except Exception as exc:  # a failed step must not kill this thread: tasks would wait forever
                        self.llm.engine.scheduler.abort_all()
                        for sub in self.active:
                            sub.error = RuntimeError(f"the engine failed while generating these rows: {exc!r}")
                            for rid in sub.ids:
                                self.llm._done.pop(rid, None)
                for sub in self.active:
                    sub.finished = sum(i in self.llm._done for i in sub.ids)
                    sub.done = sub.error is None and sub.finished == len(sub.ids)
                self.active = [s for s in self.active if not s.done and s.error is None]
            with self.cv:
                self.cv.notify_all()


_drivers: dict[int, EngineDriver] = {}


def generate_shared(llm: LLM, lock: threading.Lock, prompts: list[dict], params: list,
                    progress: bool = False) -> list:
    """``llm.generate`` for one task, batched with whatever other tasks have queued;
    ``progress`` shows a bar over its rows."""
    with _guard:
        if id(llm) not in _drivers:
            _drivers[id(llm)] = EngineDriver(llm, lock, worker_thread_count())
        driver = _drivers[id(llm)]
    return driver.generate(prompts, params, progress)


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
    n = worker_thread_count()
    if n:
        _set_threads(n)


M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 * 2**20


def _keep_torch_buffers_on_the_heap() -> None:
    """Undo, for this process, a side effect of Dask's ``MALLOC_TRIM_THRESHOLD_``.

    Dask starts workers with that glibc setting so they give memory back; but setting it
    also freezes glibc's mmap threshold at 128 KiB, so every activation buffer torch
    allocates is a fresh ``mmap`` whose pages fault in again on each step: the engine ran
    1.5x slower in a worker than in a plain process. Raising the mmap threshold keeps those
    buffers on the heap (freed heap memory above the trim threshold is still returned).
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):  # not glibc
        pass


def worker_thread_count() -> int | None:
    """Threads an engine should use here: ``DFLLM_NUM_THREADS``, or a Dask worker's threads
    capped at the machine's cores; None outside a worker."""
    override = os.environ.get("DFLLM_NUM_THREADS")
    if override:
        return int(override)
    try:
        from distributed import get_worker

        nthreads = get_worker().state.nthreads
    except (ImportError, ValueError, AttributeError):
        return None
    return max(1, min(nthreads, os.cpu_count() or 1))


def _set_threads(n: int) -> None:
    # torch skips the call when n equals its cached count, which another thread may have
    # set; toggling forces OpenMP's per-thread setting for this thread.
    torch.set_num_threads(1 if n != 1 else 2)
    torch.set_num_threads(n)


def load_count() -> int:
    """How many engines this process has created (for tests and diagnostics)."""
    return _loads
