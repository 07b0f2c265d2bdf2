"""The scheduler's side of the dfllm dashboard: :class:`DashboardPlugin`.

A Dask ``SchedulerPlugin`` that, once started on the scheduler,

- installs :class:`~dfllm.dashboard.reporting.WorkerReporter` on every worker, present and
  future (``Scheduler.register_worker_plugin``): each worker's heartbeat then carries its
  dfllm report in the worker's Dask metrics;
- every second reads those reports (``WorkerState.metrics["dfllm"]``) and keeps the
  last minutes of prompt and generated tokens per second, per worker and for the cluster;
- serves the state as JSON at ``<dashboard>/dfllm/data.json`` and, where the scheduler
  runs Dask's Bokeh dashboard, the live page ``<dashboard>/dfllm`` (a Bokeh document served
  by the dashboard's own server, like its built-in pages, and linked from its navigation
  bar). Both are routes of the scheduler's own HTTP server: no extra port or service;
- answers the scheduler's ``/sitemap.json`` (Dask's index of its HTTP routes) with
  :class:`SitemapHandler`, which lists each Bokeh application's pages (Dask's and dfllm's):
  Dask's own handler, with Bokeh >= 3.3, walks their static routes instead and answers 500.

It is started by whichever comes first: ``--preload dfllm.dashboard`` on ``dask
scheduler``, :func:`dfllm.dashboard.install` (``dfllm run`` calls it), or the first dfllm
partition that runs on any worker (which asks the scheduler to load it). Loading it again
does nothing. Bokeh is imported only here, on the scheduler.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import math
import os
import time
from typing import Any

import tornado.routing
from distributed.diagnostics.plugin import SchedulerPlugin
from tornado import web
from tornado.ioloop import PeriodicCallback

from dfllm.dashboard.reporting import WorkerReporter, plain
from dfllm.errors import value_text
from dfllm.worker.progress import METRIC
from dfllm.worker.progress import PLUGIN_NAME as WORKER_PLUGIN

logger = logging.getLogger("dfllm")

PLUGIN_NAME = "dfllm-dashboard"
PAGE = "dfllm"  # the page's path under the dashboard's prefix
DATA = "dfllm/data.json"
SAMPLE_MS = 1000
HISTORY_S = 300  # the time series' span: the last five minutes


def _rate(new: float, old: float, dt: float) -> float:
    """A counter's rate; a counter that went down (an engine reloaded) restarts from 0."""
    if dt <= 0:
        return 0.0
    return _finite_or_zero(max(0.0, new - old) / dt if new >= old else new / dt)


ENGINE_TEXT = ("model", "device", "kind")
ENGINE_NUMBERS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "running",
    "waiting",
    "kv_cache_usage",
    "prompt_tokens",
    "generation_tokens",
    "preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
)
JOB_NUMBERS = ("rows", "errors", "done", "running", "failed", "updated")


def _number(value: Any) -> float | int:
    """A metric as a number: an int or float as :func:`~dfllm.dashboard.reporting.plain` makes
    it, a missing one 0, and anything that is no number (text, a list) NaN: unknown, which
    the JSON and the page show as null, never a made-up 0."""
    if value is None:
        return 0
    value = plain(value)
    if isinstance(value, bool):
        return int(value)
    return value if isinstance(value, (int, float)) else math.nan


def _clean_report(report: dict) -> dict:
    """A worker's report in the shape the page reads, whatever it holds (another dfllm's
    report, a hand-made one): each engine a dict of text and numbers (:func:`_number`), each
    job one of numbers, names and text valid Unicode. Nothing of it can make the page fail."""
    engines = report.get("engines")
    jobs = report.get("jobs")
    process = report.get("process")
    return {
        "time": _number(report.get("time")),
        "process": None if process is None else value_text(process),
        "engines": [_clean_engine(e) for e in (engines if isinstance(engines, (list, tuple)) else ())],
        "batch_last": _number(report.get("batch_last")),
        "batch_mean": _number(report.get("batch_mean")),
        "steps": _number(report.get("steps")),
        "jobs": {
            value_text(name): {k: _number(job.get(k)) if isinstance(job, dict) else math.nan for k in JOB_NUMBERS}
            for name, job in (jobs.items() if isinstance(jobs, dict) else ())
        },
    }


def _clean_engine(engine: Any) -> dict:
    if not isinstance(engine, dict):  # shown as an engine whose model is what was reported
        return {"model": value_text(engine), "device": "?", "kind": "?", **dict.fromkeys(ENGINE_NUMBERS, math.nan)}
    out: dict[str, Any] = {k: value_text(engine.get(k, "?")) for k in ENGINE_TEXT}
    out.update({k: _number(engine.get(k)) for k in ENGINE_NUMBERS})
    return out


def _finite_or_zero(value: float) -> float:
    return value if math.isfinite(value) else 0.0


class WorkerView:
    """What the scheduler knows of one worker's dfllm state: its last report and rates."""

    def __init__(self) -> None:
        self.report: dict = {}
        self.last: tuple[float, float, float] | None = None  # (report time, prompt tokens, generated tokens)
        self.prompt_tps = 0.0
        self.generation_tps = 0.0

    def update(self, report: dict) -> None:
        self.report = report = _clean_report(report)
        t = _finite_or_zero(float(report["time"]))
        prompt = _finite_or_zero(float(sum(e["prompt_tokens"] for e in report["engines"])))
        generated = _finite_or_zero(float(sum(e["generation_tokens"] for e in report["engines"])))
        if self.last is not None and t > self.last[0]:
            dt = t - self.last[0]
            self.prompt_tps = _rate(prompt, self.last[1], dt)
            self.generation_tps = _rate(generated, self.last[2], dt)
        elif self.last is not None and t < self.last[0]:  # the worker restarted
            self.prompt_tps = self.generation_tps = 0.0
        if self.last is None or t != self.last[0]:
            self.last = (t, prompt, generated)


class DashboardPlugin(SchedulerPlugin):
    """The dfllm page of the scheduler's dashboard, its JSON endpoint and the state behind them."""

    name = PLUGIN_NAME
    idempotent = True  # registering it again (every worker asks) does nothing

    def __init__(self) -> None:
        self.scheduler: Any = None
        self.views: dict[str, WorkerView] = {}
        self.series: collections.deque[dict] = collections.deque(maxlen=HISTORY_S * 1000 // SAMPLE_MS)
        self.prefix = ""
        self.page = False  # whether the Bokeh page is served

    # pickled to be sent to the scheduler: only the class travels, never a started plugin's state
    def __getstate__(self) -> dict:
        return {"version": 1}

    def __setstate__(self, state: dict) -> None:
        DashboardPlugin.__init__(self)

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def start(self, scheduler: Any) -> None:
        """Add the routes, the page and the sampler, and install the workers' reporter.
        Nothing here awaits: two workers asking at once cannot both start one."""
        if getattr(scheduler, "_dfllm_dashboard", None) is not None:  # another instance already serves
            return
        scheduler._dfllm_dashboard = self
        self.scheduler = scheduler
        app = getattr(scheduler, "http_application", None)
        if app is not None:
            bokeh_app = _dask_bokeh_app(app)
            self.prefix = bokeh_app.prefix.rstrip("/") if bokeh_app is not None else ""
            app.add_handlers(r".*", [(f"{self.prefix}/{DATA}", DataHandler, {"plugin": self})])
            _serve_sitemap(app)
            if bokeh_app is not None:
                try:
                    self._add_page(scheduler, app)
                except Exception:  # the JSON endpoint still serves
                    logger.exception("dfllm: could not add the dashboard page")
        pc = PeriodicCallback(self.sample, SAMPLE_MS)
        scheduler.periodic_callbacks[PLUGIN_NAME] = pc  # stopped with the scheduler's own
        pc.start()
        if WORKER_PLUGIN not in scheduler.worker_plugins:
            from distributed.protocol.pickle import dumps

            plugin = dumps(WorkerReporter())
            scheduler.loop.add_callback(scheduler.register_worker_plugin, None, plugin, WORKER_PLUGIN, idempotent=True)

    def _add_page(self, scheduler: Any, app: Any) -> None:
        """Serve the Bokeh page beside the dashboard's own: a second Bokeh server application
        of the same HTTP server (Dask's routing asks each in turn), with Dask's template
        variables, and the page added to the navigation bar they share."""
        from distributed.dashboard.core import BokehApplication
        from distributed.dashboard.scheduler import template_variables
        from tornado.ioloop import IOLoop

        from dfllm.dashboard.page import dfllm_doc

        variables = template_variables(scheduler)  # memoized: the dict the built-in pages render
        bokeh = BokehApplication(
            {f"/{PAGE}": functools.partial(dfllm_doc, self)},
            scheduler,
            prefix=self.prefix,
            template_variables=variables,
        )
        app.add_application(bokeh)
        bokeh.initialize(IOLoop.current())
        bokeh.start()
        if PAGE not in variables["pages"]:
            pages = variables["pages"]
            pages.insert(pages.index("info") if "info" in pages else len(pages), PAGE)
        self.page = True

    # ---- state --------------------------------------------------------------------------------------
    def sample(self) -> None:
        """Read every worker's latest report and append one point to the time series."""
        now = time.time()
        workers = self.scheduler.workers
        for addr in list(self.views):
            if addr not in workers:
                del self.views[addr]
        for addr, ws in workers.items():
            report = (ws.metrics or {}).get(METRIC)
            if isinstance(report, dict):
                self.views.setdefault(addr, WorkerView()).update(report)
        unique = _one_per_process(self.views.values())
        point = {
            "time": now,
            "prompt_tps": sum(v.prompt_tps for v in unique),
            "generation_tps": sum(v.generation_tps for v in unique),
            "workers": {a: [v.prompt_tps, v.generation_tps] for a, v in self.views.items()},
        }
        self.series.append(point)

    def data(self) -> dict:
        """The page's data: every worker and the cluster, jobs, and the tokens/s time series."""
        workers, seen = [], set()
        for addr, ws in sorted(self.scheduler.workers.items()):
            view = self.views.get(addr)
            row = _worker_row(addr, ws, view)
            process = view.report.get("process") if view is not None else None
            row["shares_process"] = process is not None and process in seen  # counted once in the cluster row
            seen.add(process)
            workers.append(row)
        return {
            "time": time.time(),
            "page": f"{self.prefix}/{PAGE}" if self.page else None,
            "workers": workers,
            "cluster": _cluster_row([w for w in workers if not w["shares_process"]], len(workers)),
            "jobs": self.jobs(),
            "series": self.time_series(),
        }

    def jobs(self) -> list[dict]:
        """Each job's rows, rows with ``llm_error`` and partitions, summed over the workers."""
        totals: dict[str, dict] = {}
        for view in _one_per_process(self.views.values()):
            for name, job in view.report.get("jobs", {}).items():
                t = totals.setdefault(
                    name,
                    {
                        "job": name,
                        "rows": 0,
                        "errors": 0,
                        "partitions_done": 0,
                        "partitions_running": 0,
                        "partitions_failed": 0,
                        "workers": 0,
                        "updated": 0.0,
                    },
                )
                t["rows"] += job.get("rows", 0)
                t["errors"] += job.get("errors", 0)
                t["partitions_done"] += job.get("done", 0)
                t["partitions_running"] += job.get("running", 0)
                t["partitions_failed"] += job.get("failed", 0)
                t["workers"] += 1
                t["updated"] = max(t["updated"], _finite_or_zero(job.get("updated", 0.0)))
        return sorted(totals.values(), key=lambda j: -j["updated"])

    def time_series(self) -> dict:
        """Seconds relative to now, and tokens/s for the cluster and per worker."""
        points = list(self.series)
        now = time.time()
        addrs = sorted({a for p in points for a in p["workers"]})
        per_worker = {
            a: {
                "prompt_tps": [p["workers"].get(a, [0.0, 0.0])[0] for p in points],
                "generation_tps": [p["workers"].get(a, [0.0, 0.0])[1] for p in points],
            }
            for a in addrs
        }
        return {
            "time": [p["time"] for p in points],
            "seconds_ago": [p["time"] - now for p in points],
            "prompt_tps": [p["prompt_tps"] for p in points],
            "generation_tps": [p["generation_tps"] for p in points],
            "workers": per_worker,
        }


def page_served(dask_scheduler: Any) -> bool:
    """Whether this scheduler serves the dfllm page (``client.run_on_scheduler(page_served)``)."""
    plugin = getattr(dask_scheduler, "_dfllm_dashboard", None)
    return bool(plugin is not None and plugin.page)


def _dask_bokeh_app(app: Any) -> Any:
    """The scheduler's Bokeh dashboard application, or None (no dashboard)."""
    try:
        from bokeh.server.tornado import BokehTornado
    except ImportError:
        return None
    return next((a for a in app.applications if isinstance(a, BokehTornado)), None)


def _worker_row(addr: str, ws: Any, view: WorkerView | None) -> dict:
    report = view.report if view is not None else {}
    engines = report.get("engines", [])
    gen = [e for e in engines if e.get("kind") == "generate"]
    queries = sum(e.get("prefix_cache_queries", 0) for e in gen)
    hits = sum(e.get("prefix_cache_hits", 0) for e in gen)
    return {
        "worker": addr,
        "name": value_text(ws.name),
        "reporting": view is not None,
        "models": [e["model"] for e in engines],
        "devices": sorted({e["device"] for e in engines}),
        "tensor_parallel_size": _max(e["tensor_parallel_size"] for e in engines),
        "pipeline_parallel_size": _max(e["pipeline_parallel_size"] for e in engines),
        "engines": engines,
        "running": sum(e.get("running", 0) for e in gen),
        "waiting": sum(e.get("waiting", 0) for e in gen),
        "batch_last": report.get("batch_last", 0),
        "batch_mean": report.get("batch_mean", 0.0),
        "prompt_tokens": sum(e.get("prompt_tokens", 0) for e in gen),
        "generation_tokens": sum(e.get("generation_tokens", 0) for e in gen),
        "prompt_tps": view.prompt_tps if view else 0.0,
        "generation_tps": view.generation_tps if view else 0.0,
        "kv_cache_usage": _max(e["kv_cache_usage"] for e in gen),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "preemptions": sum(e.get("preemptions", 0) for e in gen),
    }


def _max(values: Any) -> float | int:
    """The largest of ``values`` (0 if none); NaN (unknown) if any is."""
    values = list(values)
    if any(isinstance(v, float) and math.isnan(v) for v in values):
        return math.nan
    return max(values, default=0)


def _one_per_process(views: Any) -> list[WorkerView]:
    """One view per worker process: the workers of an in-process cluster share one state."""
    seen: set = set()
    out = []
    for view in views:
        process = view.report.get("process")
        if process is None or process not in seen:
            out.append(view)
        seen.add(process)
    return out


def _cluster_row(workers: list[dict], total: int) -> dict:
    """The cluster's totals over ``workers`` (one per process) of ``total`` workers."""
    queries = sum(w["prefix_cache_queries"] for w in workers)
    hits = sum(w["prefix_cache_hits"] for w in workers)
    busy = [w for w in workers if w["engines"]]
    return {
        "workers": total,
        "workers_with_engines": len(busy),
        "models": sorted({m for w in workers for m in w["models"]}),
        "devices": sorted({d for w in workers for d in w["devices"]}),
        **{
            k: sum(w[k] for w in workers)
            for k in (
                "running",
                "waiting",
                "batch_last",
                "prompt_tokens",
                "generation_tokens",
                "prompt_tps",
                "generation_tps",
                "preemptions",
            )
        },
        "kv_cache_usage": sum(w["kv_cache_usage"] for w in busy) / len(busy) if busy else 0.0,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
    }


class DataHandler(web.RequestHandler):
    """``GET <dashboard>/dfllm/data.json``: :meth:`DashboardPlugin.data` as JSON."""

    def initialize(self, plugin: DashboardPlugin) -> None:
        self.plugin = plugin

    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        # NaN and infinities (no JSON) as null, strings valid Unicode
        self.write(json.dumps(plain(self.plugin.data(), finite=True), allow_nan=False))


# ---- /sitemap.json --------------------------------------------------------------------------------------
class SitemapHandler(web.RequestHandler):
    """``GET /sitemap.json``: every path the scheduler's HTTP server routes, as Dask's
    ``DirectoryHandler`` lists them (a Bokeh application's pages, each other application's
    routes, and the files of its static folders), but telling a Bokeh application by its
    class, not by ``"bokeh"`` in its ``repr`` (Dask's ``DaskBokehTornado``, with Bokeh >= 3.3,
    has no ``"bokeh"`` there, so Dask walked its routes and failed on the static route of
    Bokeh's, which has no ``path``), and with the Bokeh prefix on its pages."""

    def get(self) -> None:
        bokeh: Any = ()  # the Bokeh application class(es)
        try:
            from bokeh.server.tornado import BokehTornado

            bokeh = (BokehTornado,)
        except ImportError:  # no Bokeh: no Bokeh applications
            pass
        out: set[str] = set()
        routers: set = set()
        for app in [*getattr(self.application, "applications", ()), self.application]:
            if isinstance(app, bokeh):
                out.update(app.prefix.rstrip("/") + path for path in app.app_paths)
            else:
                _routes(app.default_router, routers, out)
                _routes(app.wildcard_router, routers, out)
        self.set_header("Content-Type", "application/json")
        self.write({"paths": sorted(out)})


def _routes(router: Any, routers: set, out: set) -> None:
    """The paths ``router`` (and the routers it delegates to) serves, into ``out``: a
    pattern for each handler, each file for a static folder."""
    if router in routers:
        return
    routers.add(router)
    for rule in [*router.named_rules.values(), *router.rules]:
        if isinstance(rule.matcher, tornado.routing.PathMatches):
            pattern = rule.matcher.regex.pattern
            folder = (rule.target_kwargs or {}).get("path")
            if isinstance(rule.target, type) and issubclass(rule.target, web.StaticFileHandler) and folder:
                prefix = pattern.rstrip("$").removesuffix("(.*)").rstrip("/")
                for d, _, files in os.walk(folder):
                    for name in files:
                        out.add(prefix + "/" + os.path.relpath(os.path.join(d, name), folder).replace(os.sep, "/"))
            else:  # a handler, or a static route without a folder of its own: its pattern
                out.add(pattern.rstrip("$"))
        if isinstance(rule.target, tornado.routing.RuleRouter):
            _routes(rule.target, routers, out)


def _serve_sitemap(app: Any) -> None:
    """Route the scheduler's ``/sitemap.json`` to :class:`SitemapHandler`: each rule of
    ``app`` whose handler is Dask's ``DirectoryHandler`` gets ours instead (its place, and
    so its precedence, unchanged)."""
    try:
        from distributed.http.routing import DirectoryHandler
    except ImportError:  # a distributed without it: nothing to replace
        return

    def replace(router: Any, seen: set) -> None:
        if router in seen:
            return
        seen.add(router)
        for rule in [*router.named_rules.values(), *router.rules]:
            if isinstance(rule.target, type) and issubclass(rule.target, DirectoryHandler):
                rule.target = SitemapHandler
            elif isinstance(rule.target, tornado.routing.RuleRouter):
                replace(rule.target, seen)

    seen: set = set()
    replace(app.default_router, seen)
    replace(app.wildcard_router, seen)
