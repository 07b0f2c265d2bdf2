"""One engine per process and model configuration, reused by every task that runs there.

On a Dask worker the process is the worker, so each worker loads a model once however many
partitions it runs; without a distributed client the calling process holds the engine.
Generation from concurrent tasks of one worker (threads) shares the engine's continuous
batches: each task hands its rows to the process's driver thread, which steps the engine
for everyone. A generative engine's ``dfllm_`` metrics join the process's default
Prometheus registry, which a Dask worker serves on ``/metrics``.

A failure stays with the task that causes it. If a step raises, the driver drops the
engine's batch and re-runs each task's unfinished rows from scratch, one task at a time
(rows already finished keep their outputs): the task whose rows fail on their own gets the
error, and the others the outputs they would have had. Rows for which the model produces
non-finite logits are not a failed step: they end with ``finish_reason="error"`` and the
rest of the batch goes on. For tests and diagnostics, :func:`load_count` counts the engines
this process built and :func:`partitions_per_step` how many tasks shared each step.

All torch work of the accessors runs on that one driver thread: building engines, stepping
them, and pooling calls (``embed``, ``score``, ``classify``). With OpenMP, every thread
that runs a parallel region keeps its own team of worker threads; once there are more of
those than cores, libgomp stops spinning between regions and each small op pays a futex
wake-up (a decode step ran 30-40% slower in a Dask worker whose engine was built on one
task thread and stepped on another). One thread, one team.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import os
import sys
import threading
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from dfllm.accessors.prometheus import expose
from dfllm.llm import LLM

_engines: dict[tuple, tuple[LLM, threading.Lock]] = {}
_guard = threading.Lock()
_loads = 0
STEP_RECORD = 100_000  # steps whose task count is kept (the most recent)
_step_tasks: collections.deque[int] = collections.deque(maxlen=STEP_RECORD)


def engine_key(model, engine_kwargs: dict) -> tuple:
    return (None if model is None else str(model), tuple(sorted(engine_kwargs.items())))


def get_engine(model, engine_kwargs: dict) -> tuple[LLM, threading.Lock]:
    """The process's engine for ``(model, engine_kwargs)`` and its lock, created on first use
    (on the driver thread)."""
    global _loads
    key = engine_key(model, engine_kwargs)
    with _guard:
        if key not in _engines:
            if worker_thread_count() is not None:
                _keep_torch_buffers_on_the_heap()
                _stop_dask_profiler()
            llm = driver().call(lambda: LLM(model, **engine_kwargs))
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


class EngineQueue:
    """One engine's rows: handed over and not yet queued, and queued but not finished."""

    def __init__(self, llm: LLM, lock: threading.Lock):
        self.llm, self.lock = llm, lock
        self.pending: list[Submission] = []
        self.active: list[Submission] = []
        self.owner: dict[str, Submission] = {}  # request id -> the active submission it belongs to

    def busy(self) -> bool:
        return bool(self.pending) or self.llm.engine.has_unfinished()


class Driver:
    """The thread that runs all of the process's accessor torch work.

    Tasks hand over rows (``generate``) or whole calls (``call``) and wait; before each step
    the driver runs the calls that arrived and queues the rows, so concurrent partitions
    share continuous batches.
    """

    def __init__(self, threads: int | None):
        self.threads = threads
        self.cv = threading.Condition()
        self.calls: list[tuple[Callable, concurrent.futures.Future]] = []
        self.queues: dict[int, EngineQueue] = {}
        threading.Thread(target=self._loop, name="dfllm-engine", daemon=True).start()

    def call(self, fn: Callable):
        """``fn()`` run on the driver thread; its result, or its exception raised here."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.cv:
            self.calls.append((fn, future))
            self.cv.notify_all()
        return future.result()

    def generate(self, llm: LLM, lock: threading.Lock, prompts: list[dict], params: list,
                 progress: bool = False) -> list:
        sub = Submission(prompts, params)
        with tqdm(total=len(prompts), desc="llm rows", unit="row", disable=not progress) as bar, self.cv:
            queue = self.queues.setdefault(id(llm), EngineQueue(llm, lock))
            queue.pending.append(sub)
            self.cv.notify_all()
            while sub.error is None and not sub.done:  # the driver notifies after every step
                self.cv.wait()
                if sub.finished > bar.n:
                    bar.update(sub.finished - bar.n)
        if sub.error is not None:
            raise sub.error
        with lock:
            return [llm._done.pop(i) for i in sub.ids]

    def _loop(self) -> None:
        if self.threads:
            _set_threads(self.threads)
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.calls or any(q.busy() for q in self.queues.values()))
                calls, self.calls = self.calls, []
                work = [(q, q.pending) for q in self.queues.values() if q.busy()]
                for q, _ in work:
                    q.pending = []
            for fn, future in calls:
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)
            for queue, subs in work:
                _step(queue, subs)
            with self.cv:
                self.cv.notify_all()


def _step(queue: EngineQueue, subs: list[Submission]) -> None:
    """Queue newly handed-over rows and run one step of ``queue``'s engine."""
    llm = queue.llm
    with queue.lock:
        for sub in subs:
            try:
                sub.ids = llm._add_requests(*llm._tokenize(sub.prompts, sub.params, "generate"))
            except Exception as exc:  # reported to the task that submitted these rows
                sub.error = exc
                continue
            queue.active.append(sub)
            queue.owner.update(dict.fromkeys(sub.ids, sub))
        if llm.engine.has_unfinished():
            try:
                llm._step_and_collect()
                _step_tasks.append(len({queue.owner[r] for r in llm.engine.last_step_requests if r in queue.owner}))
            except Exception as exc:  # a failed step must not kill this thread: tasks would wait forever
                _isolate(queue, exc)
        for sub in queue.active:
            sub.finished = sum(i in llm._done for i in sub.ids)
            sub.done = sub.error is None and sub.finished == len(sub.ids)
            if sub.done or sub.error is not None:
                for rid in sub.ids:
                    queue.owner.pop(rid, None)
        queue.active = [s for s in queue.active if not s.done and s.error is None]


def _isolate(queue: EngineQueue, exc: Exception) -> None:
    """After a step that raised: drop the engine's batch and re-run each task's unfinished
    rows from scratch, one task at a time (rows already finished keep their outputs). A task
    whose rows fail again on their own gets the error; the others complete."""
    llm = queue.llm
    _, failures = llm._recover(exc, [sub.ids for sub in queue.active])
    for g, (failure, _) in failures.items():
        sub = queue.active[g]
        sub.error = RuntimeError(f"the engine failed while generating these rows: {failure!r}")
        for rid in sub.ids:
            llm._done.pop(rid, None)


_driver: Driver | None = None
_driver_guard = threading.Lock()


def driver() -> Driver:
    """The process's driver thread, started on first use."""
    global _driver
    with _driver_guard:
        if _driver is None:
            _driver = Driver(worker_thread_count())
        return _driver


def generate_shared(llm: LLM, lock: threading.Lock, prompts: list[dict], params: list,
                    progress: bool = False) -> list:
    """``llm.generate`` for one task, batched with whatever other tasks have queued;
    ``progress`` shows a bar over its rows."""
    return driver().generate(llm, lock, prompts, params, progress)


class OnDriver:
    """``llm`` as pooling tasks see it: its methods run on the driver thread."""

    def __init__(self, llm: LLM):
        self._llm = llm

    def __getattr__(self, name: str):
        attr = getattr(self._llm, name)
        if not callable(attr):
            return attr
        return lambda *args, **kwargs: driver().call(lambda: attr(*args, **kwargs))


M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 * 2**20
TRIM_THRESHOLD_BYTES = 256 * 2**20


def _keep_torch_buffers_on_the_heap() -> None:
    """Undo, for this process, a side effect of Dask's ``MALLOC_TRIM_THRESHOLD_``.

    Dask starts workers with that glibc setting so they give memory back; but setting it
    also freezes glibc's mmap threshold at 128 KiB, so every activation buffer torch
    allocates is a fresh ``mmap`` whose pages fault in again on each step: the engine ran
    1.5x slower in a worker than in a plain process. Raising the mmap threshold keeps those
    buffers on the heap; raising the trim threshold (to 256 MiB) stops the heap's top from
    being handed back and faulted in again after every step (another ~10%). Free heap
    beyond 256 MiB is still returned, and the engine's memory stays flat across a job.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    except (OSError, AttributeError):  # not glibc
        pass


def _stop_dask_profiler() -> None:
    """Stop the Dask worker's statistical profiler in a process that hosts an engine.

    Every 10 ms it walks the stacks of the threads running tasks, under the GIL; here those
    threads only wait for the engine's driver thread, which loses the GIL to it between
    torch calls (4-8% of throughput measured). ``DFLLM_KEEP_DASK_PROFILER=1`` keeps it.
    """
    if os.environ.get("DFLLM_KEEP_DASK_PROFILER"):
        return
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):
        return
    for name in ("profile", "profile-cycle"):
        callback = worker.periodic_callbacks.pop(name, None)
        if callback is not None:
            worker.loop.add_callback(callback.stop)  # periodic callbacks belong to the event loop


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


def partitions_per_step() -> list[int]:
    """For each generation step the driver ran in this process (the last 100,000), how many
    tasks (partitions) had rows in its batch; for tests and diagnostics."""
    return list(_step_tasks)
