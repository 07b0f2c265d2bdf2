"""The worker's side of the dfllm dashboard: :class:`WorkerReporter`, a Dask ``WorkerPlugin``.

It adds :func:`dfllm.worker.progress.worker_report` to the worker's Dask metrics
(``worker.metrics["dfllm"]``), which the worker's own heartbeat carries to the scheduler,
and counts the rows of the dfllm tasks that finish on the worker. The scheduler's
:class:`~dfllm.dashboard.collector.DashboardPlugin` installs it on every worker.
"""

from __future__ import annotations

from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from dfllm.worker.progress import METRIC, PLUGIN_NAME, task_dropped, task_finished, tracked, worker_report


class WorkerReporter(WorkerPlugin):
    """Adds :func:`~dfllm.worker.progress.worker_report` to the worker's Dask metrics (sent with every heartbeat)
    and counts the rows of the dfllm tasks that finish on it."""

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        self.worker = worker
        worker.metrics[METRIC] = worker_report

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
