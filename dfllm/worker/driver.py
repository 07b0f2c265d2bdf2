"""The thread that runs all of a process's accessor torch work, and steps engines for
every task at once.

Building engines, stepping them, and pooling calls (``embed``, ``score``, ``classify``)
all run on this one thread. With OpenMP, every thread that runs a parallel region keeps
its own team of worker threads; once there are more of those than cores, libgomp stops
spinning between regions and each small op pays a futex wake-up (a decode step ran 30-40%
slower in a Dask worker whose engine was built on one task thread and stepped on
another). One thread, one team. Its start tunes a Dask worker's process once (see
:mod:`dfllm.worker.tuning`).

Generation from concurrent tasks of one process (a Dask worker's threads) shares an
engine's continuous batches: a task turns its rows into checked requests (the engine's
``InputProcessor``, holding the engine's lock) and hands them over with
:meth:`Driver.generate`; before each step the driver queues what arrived, under request
ids of its own, with the task's :class:`Submission` as their group, and steps every engine
that has work, using only the engine's public API.

A failure stays with the task that causes it. If a step raises, the engine re-runs each
group's unfinished requests from scratch on its own (rows already finished keep their
outputs); the task whose rows fail on their own gets ``RuntimeError("the engine failed
while generating these rows: ...")``, the others the outputs they would have had. Rows for
which the model produces non-finite logits are not a failed step: they end with
``finish_reason="error"`` and the rest of the batch goes on. For tests and diagnostics,
:func:`partitions_per_step` says how many tasks shared each step and
:func:`partitions_held_per_step` how many the engine held; each step's batch size also goes to
the dashboard (:func:`dfllm.worker.progress.record_step`).

In a Dask worker, a task that leaves its engine short of a full batch leaves the worker's
thread pool while it waits (see ``_secede``), so that the worker starts more partitions than
it has threads while their rows fit in a batch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from dfllm.engine.input_processor import EngineRequest
from dfllm.engine.llm_engine import LLMEngine
from dfllm.outputs import RequestOutput
from dfllm.worker import progress
from dfllm.worker.tuning import tune_worker_process, worker_thread_count

STEP_RECORD = 100_000  # steps whose task count is kept (the most recent)
_step_tasks: collections.deque[int] = collections.deque(maxlen=STEP_RECORD)
_step_held: collections.deque[int] = collections.deque(maxlen=STEP_RECORD)
_request_ids = itertools.count()  # the driver's request ids, unique in the process


class Submission:
    """The requests one task handed over for one engine, and their outputs as they finish;
    the requests' group in the engine."""

    def __init__(self, requests: list[EngineRequest]):
        self.requests = requests
        self.ids: list[str] = []  # set when they are queued
        self.outputs: dict[str, RequestOutput] = {}
        self.error: BaseException | None = None
        self.done = False


class EngineQueue:
    """One engine's submissions: handed over and not yet queued, and queued but not finished."""

    def __init__(self, engine: LLMEngine, lock: threading.Lock):
        self.engine, self.lock = engine, lock
        self.pending: list[Submission] = []
        self.active: list[Submission] = []
        self.owner: dict[str, Submission] = {}  # request id -> the active submission it belongs to

    def busy(self) -> bool:
        return bool(self.pending or self.active)

    def rows_in_flight(self) -> int:
        """Requests handed over and not finished (read while the driver may be stepping: a
        close count, which is all the tasks' admission needs)."""
        return sum(len(s.requests) for s in self.pending) + sum(len(s.ids) - len(s.outputs) for s in self.active)


class Driver:
    """The thread that runs all of the process's accessor torch work.

    Tasks hand over requests (:meth:`generate`) or whole calls (:meth:`call`) and wait;
    before each step the driver runs the calls that arrived and queues the requests, so
    concurrent partitions share continuous batches.
    """

    def __init__(self, threads: int | None):
        self.threads = threads
        self.cv = threading.Condition()
        self.calls: list[tuple[Callable, concurrent.futures.Future]] = []
        self.queues: dict[int, EngineQueue] = {}  # id(engine) -> its queue, while it has work
        self.thread = threading.Thread(target=self._loop, name="dfllm-engine", daemon=True)
        self.thread.start()

    def call(self, fn: Callable):
        """``fn()`` run on the driver thread; its result, or its exception raised here."""
        if threading.current_thread() is self.thread:
            return fn()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.cv:
            self.calls.append((fn, future))
            self.cv.notify_all()
        return future.result()

    def generate(
        self, engine: LLMEngine, lock: threading.Lock, requests: list[EngineRequest], progress: bool = False
    ) -> list[RequestOutput]:
        """The outputs of ``requests`` (checked by ``engine``'s input processor), in order,
        generated in the batches of every task using ``engine``; ``progress`` shows a bar."""
        sub = Submission(requests)
        with tqdm(total=len(requests), desc="llm rows", unit="row", disable=not progress) as bar:
            with self.cv:
                queue = self.queues.setdefault(id(engine), EngineQueue(engine, lock))
                queue.pending.append(sub)
                in_flight = queue.rows_in_flight()
                self.cv.notify_all()
            seceded = in_flight < engine.cfg.max_num_seqs and _secede()
            try:
                with self.cv:
                    while sub.error is None and not sub.done:  # the driver notifies after every step
                        self.cv.wait()
                        if len(sub.outputs) > bar.n:
                            bar.update(len(sub.outputs) - bar.n)
            finally:
                if seceded:
                    _rejoin()
        if sub.error is not None:
            raise sub.error
        return [sub.outputs[i] for i in sub.ids]

    def waiting(self, engine: LLMEngine) -> int:
        """How many tasks have handed over requests for ``engine`` that are not queued yet
        (for tests that line tasks up)."""
        with self.cv:
            queue = self.queues.get(id(engine))
            return len(queue.pending) if queue is not None else 0

    def _loop(self) -> None:
        if self.threads:
            _set_threads(self.threads)
        while True:
            self._round()

    def _round(self) -> None:
        """Wait for work; run the calls that arrived, then one step of every engine with
        work. (Its own frame: nothing of a round outlives it, so an idle engine that a call
        shuts down is referenced here no more.)"""
        with self.cv:
            self.cv.wait_for(lambda: self.calls or any(q.busy() for q in self.queues.values()))
            self.queues = {k: q for k, q in self.queues.items() if q.busy()}  # forget idle engines
            calls, self.calls = self.calls, []
            work = [(q, q.pending) for q in self.queues.values()]
            for q, subs in work:
                # handed-over submissions become active here, under the lock their tasks read
                # rows_in_flight under: a task handing rows over while the step below queues
                # them counts them (it missed them in between, seceded while the engine was
                # full, and the worker then started one partition more than it has threads)
                q.pending = []
                for sub in subs:
                    sub.ids = [f"df-{next(_request_ids)}" for _ in sub.requests]
                q.active.extend(subs)
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
    """Queue newly handed-over requests and run one step of ``queue``'s engine; settle
    every submission that is done or failed."""
    engine = queue.engine
    with queue.lock:
        for sub in subs:  # already in queue.active, with their request ids (Driver._round)
            try:
                for rid, request in zip(sub.ids, sub.requests):
                    engine.add_request(rid, request, group=sub)
            except Exception as exc:  # reported to the task that handed these over
                engine.abort_request(sub.ids)
                sub.error = exc
                continue
            sub.requests = []  # the engine holds them now
            queue.owner.update(dict.fromkeys(sub.ids, sub))
        outputs: list[RequestOutput] = []
        if engine.has_unfinished_requests():
            try:
                outputs = engine.step()
                _step_tasks.append(sum(sub in engine.last_step_groups for sub in queue.active))
                _step_held.append(len(queue.active))
                progress.record_step(engine.stats().num_running + len(outputs))  # the step's batch, roughly
            except Exception as exc:  # not the model (the engine recovers from that): no task may wait forever
                for sub in queue.active:
                    if sub.error is None:  # one that failed to queue keeps its own error
                        sub.error = exc
        for out in outputs:
            owner = queue.owner.pop(out.request_id, None)
            if owner is not None:
                owner.outputs[out.request_id] = out
        idle = not engine.has_unfinished_requests()
        for sub in queue.active:
            failure = engine.take_failure(sub)
            if failure is not None and sub.error is None:
                sub.error = RuntimeError(f"the engine failed while generating these rows: {failure!r}")
            sub.done = sub.error is None and len(sub.outputs) == len(sub.ids)
            if not sub.done and sub.error is None and idle:  # a bug, not a hang
                sub.error = RuntimeError(
                    f"requests {sorted(set(sub.ids) - sub.outputs.keys())[:5]} were lost by the engine"
                )
            if sub.error is not None:
                engine.abort_request([rid for rid in sub.ids if rid not in sub.outputs])
                sub.outputs.clear()
            if sub.done or sub.error is not None:
                for rid in sub.ids:
                    queue.owner.pop(rid, None)
        queue.active = [s for s in queue.active if not s.done and s.error is None]


# A Dask task that hands rows over leaves its worker's thread pool while it waits (Dask's
# secede/rejoin) if the engine then holds fewer than max_num_seqs rows, so that the worker
# starts its next partition, whose rows join the same continuous batches. Once the engine
# holds a full batch, tasks wait in their threads and the worker starts no more partitions
# than it has threads (backpressure: at most max_num_seqs rows plus a partition per thread
# in the engine). Without it a worker of 2 threads kept 2 partitions in the engine, and 8
# partitions of 32 rows ran 4 rounds of part-empty decode steps.


def _secede() -> bool:
    """Leave the Dask worker's thread pool if this thread runs a Dask task (True: rejoin later)."""
    try:
        from distributed import get_worker, secede, threadpoolexecutor
        from distributed.worker import thread_state

        get_worker()
    except (ImportError, ValueError):
        return False
    if getattr(thread_state, "key", None) is None:  # a thread of the worker, but no task's
        return False
    if not getattr(threadpoolexecutor.thread_state, "proceed", False):  # not in the pool (seceded already)
        return False
    secede()
    return True


def _rejoin() -> None:
    from distributed import rejoin

    rejoin()


_driver: Driver | None = None
_driver_guard = threading.Lock()


def driver() -> Driver:
    """The process's driver thread, started on first use (in a Dask worker, after tuning
    the worker's process once: :func:`~dfllm.worker.tuning.tune_worker_process`)."""
    global _driver
    with _driver_guard:
        if _driver is None:
            threads = worker_thread_count()
            if threads is not None:
                tune_worker_process()
            _driver = Driver(threads)
        return _driver


def _set_threads(n: int) -> None:
    # torch skips the call when n equals its cached count, which another thread may have
    # set; toggling forces OpenMP's per-thread setting for this thread.
    torch.set_num_threads(1 if n != 1 else 2)
    torch.set_num_threads(n)


def partitions_per_step() -> list[int]:
    """For each generation step the driver ran in this process (the last 100,000), how many
    tasks (partitions) had rows in its batch; for tests and diagnostics."""
    return list(_step_tasks)


def partitions_held_per_step() -> list[int]:
    """For each generation step the driver ran in this process (the last 100,000), how many
    tasks (partitions) had unfinished rows in the engine, in its batch or waiting; for tests
    and diagnostics."""
    return list(_step_held)
