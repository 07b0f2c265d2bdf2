"""The worker's side of the dfllm dashboard: :class:`WorkerReporter`, a Dask ``WorkerPlugin``.

It adds :func:`dfllm.worker.progress.worker_report` to the worker's Dask metrics
(``worker.metrics["dfllm"]``), which the worker's own heartbeat carries to the scheduler,
and counts the rows of the dfllm tasks that finish on the worker. The scheduler's
:class:`~dfllm.dashboard.collector.DashboardPlugin` installs it on every worker.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from dfllm.worker.progress import METRIC, PLUGIN_NAME, task_dropped, task_finished, tracked, worker_report

logger = logging.getLogger("dfllm")


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
        if start != "executing" or not tracked(key):
            return
        if finish == "memory":
            task_finished(key, self.worker.data[key] if key in self.worker.data else None)
        elif finish in ("error", "released", "forgotten"):
            task_dropped(key)


async def register(worker: Any) -> None:
    """Ask the scheduler to load :class:`~dfllm.dashboard.collector.DashboardPlugin` (once
    per worker; loading it twice does nothing); if it cannot, this worker reports anyway."""
    from distributed.protocol.pickle import dumps

    from dfllm.dashboard.collector import PLUGIN_NAME as SCHEDULER_PLUGIN
    from dfllm.dashboard.collector import DashboardPlugin

    try:
        await worker.scheduler.register_scheduler_plugin(plugin=dumps(DashboardPlugin()), name=SCHEDULER_PLUGIN,
                                                         idempotent=True)
    except Exception as exc:  # the job goes on without the page
        logger.warning("dfllm: the scheduler could not load the dashboard plugin: %s", exc)
        if PLUGIN_NAME not in worker.plugins:  # this worker still reports, for a scheduler-side preload
            await worker.plugin_add(plugin=WorkerReporter(), name=PLUGIN_NAME)


_installing = False


def ensure_installed() -> None:
    """In a Dask worker: once, ask the scheduler to load the dashboard plugin
    (:class:`~dfllm.dashboard.collector.DashboardPlugin`), which adds the page and installs
    :class:`WorkerReporter` on every worker. Best effort: a scheduler that cannot load it
    (dfllm not installed there, pickled plugins refused) is logged and the job goes on.
    Called as a ``.llm`` partition starts on a worker (:func:`dfllm.accessors.placement.run_placed`)."""
    global _installing
    if _installing:
        return
    _installing = True
    try:
        from distributed import get_worker

        worker = get_worker()
    except Exception:  # not in a worker
        return
    if PLUGIN_NAME in getattr(worker, "plugins", {}):  # already there (preload, client.register_plugin)
        return
    worker.loop.add_callback(register, worker)
