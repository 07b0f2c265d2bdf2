"""The worker's side of the dfllm dashboard: :class:`WorkerReporter`, a Dask ``WorkerPlugin``.

It adds :func:`report` (:func:`dfllm.worker.progress.worker_report` as plain data) to the
worker's Dask metrics (``worker.metrics["dfllm"]``), which the worker's own heartbeat carries
to the scheduler, and counts the rows of the dfllm tasks that finish on the worker. The
scheduler's :class:`~dfllm.dashboard.collector.DashboardPlugin` installs it on every worker.

The heartbeat is msgpack: a string with a lone surrogate (a model folder whose name is not
valid UTF-8, a task key built from such text) or an int past 64 bits makes it fail, and Dask
closes a worker whose heartbeat fails, with every task on it. :func:`plain` makes the report
something msgpack always encodes, so the page can never take the job down.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from dfllm.errors import printable, value_text
from dfllm.worker.progress import METRIC, PLUGIN_NAME, task_dropped, task_finished, tracked, worker_report

MAX_DEPTH = 16  # nesting kept; anything deeper is its text


def plain(value: Any, finite: bool = False, _depth: int = 0) -> Any:
    """``value`` as data msgpack and JSON always encode: valid-Unicode strings (a lone
    surrogate written as its escape, :func:`~dfllm.errors.printable`), dicts with
    string keys, lists, bools, None, ints within 64 bits (a larger one as a float, ±inf past
    a float's range) and floats; anything else its text (:func:`~dfllm.errors.value_text`).
    With ``finite``, a NaN or infinite float is None (JSON has neither)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, numbers.Integral):
        try:
            v = int(value)
        except Exception:  # noqa: BLE001  (an Integral whose int() raises)
            return value_text(value)
        if -(2**63) <= v < 2**64:
            return v
        try:
            f = float(v)
        except OverflowError:
            f = math.inf if v > 0 else -math.inf
        return None if finite and not math.isfinite(f) else f
    if isinstance(value, numbers.Real):
        try:
            f = float(value)
        except Exception:  # noqa: BLE001
            return value_text(value)
        return None if finite and not math.isfinite(f) else f
    if _depth < MAX_DEPTH:
        if isinstance(value, dict):
            return {
                (printable(k) if isinstance(k, str) else value_text(k)): plain(v, finite, _depth + 1)
                for k, v in value.items()
            }
        if isinstance(value, (list, tuple, set, frozenset)):
            return [plain(v, finite, _depth + 1) for v in value]
    return value_text(value)


def report(worker: Any = None) -> dict:
    """This worker's dfllm report (:func:`~dfllm.worker.progress.worker_report`) as :func:`plain`
    data: what the heartbeat carries as ``metrics["dfllm"]``."""
    return plain(worker_report(worker))


class WorkerReporter(WorkerPlugin):
    """Adds :func:`report` to the worker's Dask metrics (sent with every heartbeat)
    and counts the rows of the dfllm tasks that finish on it."""

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        self.worker = worker
        worker.metrics[METRIC] = report

    def teardown(self, worker: Any) -> None:
        worker.metrics.pop(METRIC, None)

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        # a task that seceded while waiting on its engine (dfllm.worker.driver) finishes from
        # "long-running"
        if start not in ("executing", "long-running") or not tracked(key):
            return
        if finish == "memory":
            task_finished(key, self.worker.data[key] if key in self.worker.data else None)
        elif finish in ("error", "released", "forgotten"):
            task_dropped(key)
