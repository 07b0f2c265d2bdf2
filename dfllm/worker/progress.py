"""What a Dask worker tells the dfllm dashboard page: its engines and the jobs it runs.

Everything here runs in the worker process. Three small sources feed one report:

- :mod:`dfllm.worker.engine_cache` calls :func:`partition_started` and
  :func:`partition_ended` around each partition that holds an engine (a dfllm task's
  partition with rows): partitions in flight, done and failed, per job;
- :mod:`dfllm.worker.driver` calls :func:`record_step` after each engine step: the
  batch size of recent steps;
- :class:`~dfllm.dashboard.reporting.WorkerReporter`, a Dask ``WorkerPlugin``, hands each
  finished dfllm task's result in the worker's memory to :func:`task_finished`: its rows
  and rows with ``llm_error`` (a partition frame, or :func:`dfllm.write_parquet`'s record
  of the part it wrote).

:func:`worker_report` puts these and what the registered engine sources report (the
engine cache's engines and their ``dfllm_`` metrics) into one plain dict, which the plugin
adds to the worker's Dask metrics (``worker.metrics["dfllm"]``): the worker's own heartbeat
carries it to the scheduler, where :class:`dfllm.dashboard.collector.DashboardPlugin` reads
it. No port, no service. This module imports nothing beyond the standard library: the worker
writes to it, the dashboard reads it, and neither reaches into the other.

A job is one graph layer of dfllm tasks (see :func:`job_of`): ``llm-generate-<token>``
for ``ddf.llm.generate(...)``, ``llm-write-generate-<run>`` for one ``write_parquet``.
"""

from __future__ import annotations

import collections
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

METRIC = "dfllm"  # the key of the report in a worker's Dask metrics
PLUGIN_NAME = "dfllm-dashboard-reporter"
BATCH_WINDOW_S = 10.0  # recent steps: those of the last 10 s
MAX_JOBS = 50  # jobs a worker remembers (the most recently active)
MAX_KEYS = 10_000  # dfllm tasks whose results are awaited

_WRITE_KEY = re.compile(r"^(llm-write-[a-z_]+)-\d+-([0-9a-f]+)$")  # write_parquet: llm-write-<kind>-<i>-<run>
_INDEXED_KEY = re.compile(r"^(.*)-\d+$")


def job_of(key: Any) -> str:
    """The job (graph layer) a task key belongs to: a tuple key's name, or a string key
    without its partition number (``llm-write-generate-3-ab12cd34`` -> ``llm-write-generate-ab12cd34``)."""
    if isinstance(key, tuple) and key:
        return str(key[0])
    text = str(key)
    m = _WRITE_KEY.match(text)
    if m:
        return f"{m.group(1)}-{m.group(2)}"
    if "-placed-" in text:  # placement's own task per partition (llm-<kind>-placed-<uuid>)
        return text.split("-placed-")[0] + "-placed"
    m = _INDEXED_KEY.match(text)
    return m.group(1) if m else text


class JobProgress:
    """One job's partitions and rows as seen by this worker."""

    __slots__ = ("running", "done", "failed", "rows", "errors", "updated")

    def __init__(self) -> None:
        self.running = self.done = self.failed = self.rows = self.errors = 0
        self.updated = time.time()

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


_lock = threading.Lock()
_jobs: collections.OrderedDict[str, JobProgress] = collections.OrderedDict()  # least recently active first
_keys: dict[Any, str] = {}  # task key -> job, for dfllm tasks whose result is not counted yet
_steps: collections.deque[tuple[float, int]] = collections.deque(maxlen=10_000)  # (time, batch size)
_PROCESS = f"{socket.gethostname()}:{os.getpid()}"  # workers of one process (processes=False) share its state


def _job(name: str) -> JobProgress:
    """``name``'s progress (holding ``_lock``), created if need be, now the most recent."""
    job = _jobs.get(name)
    if job is None:
        job = _jobs[name] = JobProgress()
        while len(_jobs) > MAX_JOBS:
            _jobs.popitem(last=False)
    _jobs.move_to_end(name)
    job.updated = time.time()
    return job


def current_task_key() -> Any:
    """The key of the Dask task this thread runs, or None (not in a Dask worker's task)."""
    worker_module = sys.modules.get("distributed.worker")  # never imported: not a worker
    if worker_module is None:
        return None
    return getattr(worker_module.thread_state, "key", None)


def partition_started() -> Any:
    """Called as a task starts using an engine: its partition is in flight. Returns the
    task key (None outside a Dask worker's task, where nothing is recorded) for
    :func:`partition_ended`."""
    key = current_task_key()
    if key is None:
        return None
    with _lock:
        _job(job_of(key)).running += 1
        _keys[key] = job_of(key)
        while len(_keys) > MAX_KEYS:  # results never seen (no reporter on this worker): forget the oldest
            del _keys[next(iter(_keys))]
    return key


def partition_ended(key: Any, failed: bool) -> None:
    """Called as the task of :func:`partition_started` stops using its engine."""
    if key is None:
        return
    with _lock:
        job = _job(job_of(key))
        job.running = max(0, job.running - 1)
        if failed:
            job.failed += 1
            _keys.pop(key, None)
        else:
            job.done += 1


def record_step(batch_size: int) -> None:
    """Called after each engine step of this process: how many sequences it computed."""
    _steps.append((time.time(), batch_size))


def tracked(key: Any) -> bool:
    """Whether ``key`` is a dfllm task of this worker whose rows are not counted yet."""
    return key in _keys


def task_dropped(key: Any) -> None:
    """A tracked task ended without a result in memory (an error, or released)."""
    with _lock:
        _keys.pop(key, None)


def task_finished(key: Any, result: Any) -> None:
    """A dfllm task's result is in memory: count its rows and rows with ``llm_error``
    (a frame with that column, or a record with ``rows`` and ``errors``)."""
    with _lock:
        name = _keys.pop(key, None)
        if name is None:
            return
        rows, errors = _count(result)
        job = _job(name)
        job.rows += rows
        job.errors += errors


def _count(result: Any) -> tuple[int, int]:
    if isinstance(result, dict) and "rows" in result and "errors" in result:
        return int(result["rows"]), int(result["errors"])
    columns = getattr(result, "columns", None)
    if columns is not None and "llm_error" in columns:
        try:
            return len(result), int(result["llm_error"].notna().sum())
        except Exception:  # a frame type without notna: rows only
            return len(result), 0
    return 0, 0


# ---- the report ---------------------------------------------------------------------------------------
_engine_sources: list[Callable[[], list[dict]]] = []


def add_engine_source(source: Callable[[], list[dict]]) -> None:
    """Register a function returning a report per engine this process holds (the engine cache
    registers :func:`dfllm.worker.engine_cache.engine_reports`), read by :func:`worker_report`."""
    if source not in _engine_sources:
        _engine_sources.append(source)


def worker_report(worker: Any = None) -> dict:
    """This process's engines, recent step batch sizes and jobs, as plain data (what the
    heartbeat carries as ``metrics["dfllm"]``)."""
    now = time.time()
    recent = [b for t, b in list(_steps) if now - t <= BATCH_WINDOW_S]
    with _lock:
        jobs = {name: job.as_dict() for name, job in _jobs.items()}
    engines = [info for source in _engine_sources for info in source()]
    return {
        "time": now,
        "process": _PROCESS,
        "engines": engines,
        "batch_last": recent[-1] if recent else 0,
        "batch_mean": sum(recent) / len(recent) if recent else 0.0,
        "steps": len(recent),
        "jobs": jobs,
    }
