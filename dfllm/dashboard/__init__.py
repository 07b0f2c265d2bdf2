"""dfllm's page in the Dask dashboard: what every worker's engine and every job is doing, live.

The page is ``<dashboard>/dfllm`` (e.g. ``http://scheduler:8787/dfllm``), served by the
scheduler's own dashboard server like Dask's built-in pages and linked from its navigation
bar; its data is ``<dashboard>/dfllm/data.json``. See ``docs/dashboard.md``.

How it gets installed (any one is enough; repeating it does nothing):

- automatically: the first dfllm partition to run on any worker asks the scheduler to load
  :class:`~dfllm.dashboard.collector.DashboardPlugin` (dfllm must be importable on the
  scheduler, as it is on the workers);
- :func:`install` from a client (``dfllm run`` does this before its job starts);
- ``dask scheduler --preload dfllm.dashboard``: the page is there before any job.

Workers report through Dask's own heartbeats: the plugin installs a ``WorkerPlugin``
(:class:`~dfllm.dashboard.reporting.WorkerReporter`) that adds a ``dfllm`` entry to each
worker's Dask metrics. Submodules: :mod:`~dfllm.worker.progress` (worker-side state and
the hooks the engine cache and driver call), :mod:`~dfllm.dashboard.reporting` (the worker
plugin), :mod:`~dfllm.dashboard.collector` (the scheduler plugin, the JSON endpoint) and
:mod:`~dfllm.dashboard.page` (the Bokeh document). Importing this package imports none of
them.
"""

from __future__ import annotations

import logging
from typing import Any

PAGE = "dfllm"
DATA = "dfllm/data.json"


def install(client: Any) -> str | None:
    """Load the dashboard plugin on ``client``'s scheduler (and so the reporter on its
    workers); the page's URL, or None where the scheduler serves no Bokeh dashboard (the
    JSON endpoint is still there) or cannot load the plugin (logged: e.g. dfllm is not
    installed in the scheduler's environment). The job runs either way."""
    from dfllm.dashboard.collector import DashboardPlugin

    try:
        client.register_plugin(DashboardPlugin())  # idempotent: a second load does nothing
    except Exception as exc:  # the job runs without the page
        logging.getLogger("dfllm").warning("dfllm: the dashboard page is not available: %s", exc)
        return None
    return page_link(client)


def page_link(client: Any) -> str | None:
    """The dfllm page's URL on ``client``'s scheduler if it serves it, else None."""
    from dfllm.dashboard.collector import page_served

    try:
        served = client.run_on_scheduler(page_served)
    except Exception:  # e.g. a scheduler that refuses pickled functions
        return None
    return page_url(client.dashboard_link) if served else None


def page_url(dashboard_link: str | None) -> str | None:
    """The dfllm page's URL from a client's ``dashboard_link`` (``.../status``), or None."""
    if not dashboard_link:
        return None
    base = (
        dashboard_link.rsplit("/", 1)[0]
        if dashboard_link.rstrip("/").endswith("status")
        else dashboard_link.rstrip("/")
    )
    return f"{base}/{PAGE}"


def data_url(dashboard_link: str | None) -> str | None:
    """The page's JSON data endpoint from a client's ``dashboard_link``, or None."""
    page = page_url(dashboard_link)
    return None if page is None else f"{page}/data.json"


async def dask_setup(server: Any) -> None:
    """``--preload dfllm.dashboard``: on ``dask scheduler``, add the plugin (the scheduler
    starts it with its own plugins, so the page is there before any job); on ``dask
    worker``, add the reporter (not needed: the plugin installs it on every worker)."""
    from distributed import Scheduler, Worker

    if isinstance(server, Scheduler):
        from dfllm.dashboard.collector import DashboardPlugin

        server.add_plugin(DashboardPlugin(), idempotent=True)
    elif isinstance(server, Worker):
        from dfllm.dashboard.reporting import WorkerReporter

        if WorkerReporter.name not in server.plugins:
            await server.plugin_add(WorkerReporter(), name=WorkerReporter.name)


async def register(worker: Any) -> None:
    """Ask the scheduler to load :class:`~dfllm.dashboard.collector.DashboardPlugin` (once
    per worker; loading it twice does nothing); if it cannot, this worker reports anyway."""
    from distributed.protocol.pickle import dumps

    from dfllm.dashboard.collector import PLUGIN_NAME as SCHEDULER_PLUGIN
    from dfllm.dashboard.collector import DashboardPlugin
    from dfllm.dashboard.reporting import PLUGIN_NAME, WorkerReporter

    try:
        await worker.scheduler.register_scheduler_plugin(
            plugin=dumps(DashboardPlugin()), name=SCHEDULER_PLUGIN, idempotent=True
        )
    except Exception as exc:  # the job goes on without the page
        logging.getLogger("dfllm").warning("dfllm: the scheduler could not load the dashboard plugin: %s", exc)
        if PLUGIN_NAME not in worker.plugins:  # this worker still reports, for a scheduler-side preload
            await worker.plugin_add(plugin=WorkerReporter(), name=PLUGIN_NAME)


_installing = False


def ensure_installed() -> None:
    """In a Dask worker: once, ask the scheduler to load the dashboard plugin
    (:class:`~dfllm.dashboard.collector.DashboardPlugin`), which adds the page and installs
    :class:`~dfllm.dashboard.reporting.WorkerReporter` on every worker. Best effort: a scheduler that cannot load it
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
    from dfllm.worker.progress import PLUGIN_NAME

    if PLUGIN_NAME in getattr(worker, "plugins", {}):  # already there (preload, client.register_plugin)
        return
    worker.loop.add_callback(register, worker)
