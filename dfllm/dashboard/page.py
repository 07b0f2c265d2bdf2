"""The dfllm page of the Dask dashboard: a Bokeh document built like Dask's own pages.

One document per browser session, refreshed every second from
:meth:`dfllm.dashboard.collector.DashboardPlugin.data` (in the scheduler's process, no HTTP
round trip): a summary line, the workers table (one row per worker and one for the
cluster), tokens per second over the last minutes (cluster and per worker), KV-cache use
per worker, and the jobs table. It uses Dask's page template, theme and navigation bar.
"""

from __future__ import annotations

import html
import math
from typing import Any, Protocol, cast

from bokeh.layouts import column, row
from bokeh.models import ColumnDataSource, DataRange1d, FactorRange, HoverTool, Range1d
from bokeh.models.widgets.markups import Div
from bokeh.models.widgets.tables import DataTable, NumberFormatter, TableColumn
from bokeh.palettes import Category10
from bokeh.plotting import figure
from distributed.dashboard.components.scheduler import BOKEH_THEME, env

from dfllm.dashboard.reporting import plain

REFRESH_MS = 1000
PLOT_HEIGHT = 240
WORKER_COLUMNS = (
    "worker",
    "models",
    "device",
    "tp",
    "pp",
    "running",
    "waiting",
    "batch",
    "prompt_tps",
    "generation_tps",
    "generation_tokens",
    "kv_pct",
    "prefix_hit_pct",
    "preemptions",
)
JOB_COLUMNS = ("job", "rows", "errors", "partitions_done", "partitions_running", "partitions_failed", "workers")


def _view(data: dict) -> dict:
    """``data`` as the page shows it: :func:`~dfllm.dashboard.reporting.plain` with NaN and
    infinities as None (an empty cell, a gap in a plot), and ints past JavaScript's exact
    range (2**53) as floats, as the browser would read them anyway."""
    return cast(dict, _js_numbers(plain(data, finite=True)))


def _js_numbers(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _js_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_js_numbers(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53:
        return float(value)
    return value


def _worker_table_data(data: dict) -> dict[str, list]:
    rows = [dict(w, worker=w["worker"]) for w in data["workers"]] + [dict(data["cluster"], worker="cluster (all)")]
    out: dict[str, list] = {c: [] for c in WORKER_COLUMNS}
    for w in rows:
        out["worker"].append(w["worker"])
        out["models"].append(", ".join(w.get("models", ())) or "-")
        out["device"].append(", ".join(w.get("devices", ())) or "-")
        out["tp"].append(w.get("tensor_parallel_size", ""))
        out["pp"].append(w.get("pipeline_parallel_size", ""))
        out["running"].append(w["running"])
        out["waiting"].append(w["waiting"])
        out["batch"].append(w["batch_last"])
        out["prompt_tps"].append(w["prompt_tps"])
        out["generation_tps"].append(w["generation_tps"])
        out["generation_tokens"].append(w["generation_tokens"])
        out["kv_pct"].append(_percent(w["kv_cache_usage"]))
        out["prefix_hit_pct"].append(_percent(w["prefix_cache_hit_rate"]))
        out["preemptions"].append(w["preemptions"])
    return out


def _jobs_data(data: dict) -> dict[str, list]:
    return {c: [j["job"] if c == "job" else j[c] for j in data["jobs"]] for c in JOB_COLUMNS}


def _series_data(data: dict) -> tuple[dict, dict]:
    s = data["series"]
    cluster = {"t": s["seconds_ago"], "prompt_tps": s["prompt_tps"], "generation_tps": s["generation_tps"]}
    palette = Category10[10]
    addrs = sorted(s["workers"])
    per_worker = {
        "xs": [s["seconds_ago"]] * len(addrs),
        "ys": [s["workers"][a]["generation_tps"] for a in addrs],
        "worker": addrs,
        "color": [palette[i % 10] for i in range(len(addrs))],
    }
    return cluster, per_worker


def _kv_data(data: dict) -> dict[str, list]:
    workers = data["workers"]
    return {
        "worker": _short_names([w["worker"] for w in workers]),
        "kv_pct": [_percent(w["kv_cache_usage"]) for w in workers],
    }


def _short_names(addresses: list[str]) -> list[str]:
    """Each worker's address without its protocol (the KV plot's categories), unless that
    makes two the same (``tcp://h:1``, ``tls://h:1``): a category range must not repeat one."""
    short = [a.split("://")[-1] for a in addresses]
    return short if len(set(short)) == len(short) else list(addresses)


def _percent(fraction: float | None) -> float | None:
    if fraction is None:
        return None
    pct = 100 * fraction
    return pct if math.isfinite(pct) else None


def _fmt(value: Any, spec: str = "") -> str:
    """A number of the summary line as text; "?" where it is unknown (None)."""
    return "?" if value is None else format(value, spec)


def _summary(data: dict) -> str:
    """The summary line, HTML (a ``Div``'s text is its HTML): every name in it escaped, so a
    model folder called ``<img onerror=...>`` is shown, not run."""
    c = data["cluster"]
    in_flight = [j["partitions_running"] for j in data["jobs"]]
    running = None if None in in_flight else sum(in_flight)
    models = html.escape(", ".join(c["models"])) or "none loaded yet"
    return (
        f"<b>dfllm</b> &mdash; {_fmt(c['workers'])} worker(s), {_fmt(c['workers_with_engines'])} with an engine; "
        f"models: {models}; "
        f"{_fmt(c['generation_tps'], '.1f')} generated tokens/s, {_fmt(c['prompt_tps'], '.1f')} prompt tokens/s; "
        f"{_fmt(c['running'])} running, {_fmt(c['waiting'])} waiting; {_fmt(running)} partition(s) in flight"
    )


class PageData(Protocol):
    """What the page reads: the scheduler plugin's :meth:`~dfllm.dashboard.collector.DashboardPlugin.data`."""

    def data(self) -> dict: ...


def dfllm_doc(plugin: PageData, scheduler: Any, extra: dict, doc: Any) -> None:
    """Build one browser session's document (called by Bokeh's server as Dask's pages are)."""
    data = _view(plugin.data())
    int_fmt = NumberFormatter(format="0,0", nan_format="?", null_format="?")
    rate_fmt = NumberFormatter(format="0,0.0", nan_format="?", null_format="?")
    summary = Div(
        text=_summary(data),
        sizing_mode="stretch_width",
        name="dfllm-summary",
        styles={"font-size": "14px", "margin": "6px 0"},
    )

    workers_source = ColumnDataSource(_worker_table_data(data), name="dfllm-workers")
    titles = {
        "worker": "worker",
        "models": "model(s)",
        "device": "device",
        "tp": "TP",
        "pp": "PP",
        "running": "running",
        "waiting": "waiting",
        "batch": "batch",
        "prompt_tps": "prompt tok/s",
        "generation_tps": "gen tok/s",
        "generation_tokens": "gen tokens",
        "kv_pct": "KV cache %",
        "prefix_hit_pct": "prefix hit %",
        "preemptions": "preemptions",
    }
    formats = {
        "running": int_fmt,
        "waiting": int_fmt,
        "batch": int_fmt,
        "preemptions": int_fmt,
        "prompt_tps": rate_fmt,
        "generation_tps": rate_fmt,
        "kv_pct": rate_fmt,
        "prefix_hit_pct": rate_fmt,
        "generation_tokens": int_fmt,
    }
    widths = {"worker": 200, "models": 200, "device": 70, "tp": 35, "pp": 35}
    workers_table = DataTable(
        source=workers_source,
        index_position=None,
        height=30 + 26 * max(3, len(data["workers"]) + 1),
        sizing_mode="stretch_width",
        name="dfllm-workers-table",
        columns=[
            TableColumn(field=c, title=titles[c], width=widths.get(c, 80), **_formatter(formats, c))
            for c in WORKER_COLUMNS
        ],
    )

    cluster, per_worker = _series_data(data)
    cluster_source = ColumnDataSource(cluster, name="dfllm-tokens")
    worker_lines = ColumnDataSource(per_worker, name="dfllm-worker-tokens")
    tokens = figure(
        title="Tokens per second (cluster)",
        height=PLOT_HEIGHT,
        sizing_mode="stretch_width",
        x_axis_label="seconds ago",
        tools="",
        toolbar_location=None,
        name="dfllm-tokens-plot",
    )
    tokens.line("t", "generation_tps", source=cluster_source, color="#1f77b4", line_width=2, legend_label="generated")
    tokens.line("t", "prompt_tps", source=cluster_source, color="#ff7f0e", line_width=2, legend_label="prompt")
    tokens.legend.location = "top_left"
    cast(DataRange1d, tokens.y_range).start = 0
    per = figure(
        title="Generated tokens per second, per worker",
        height=PLOT_HEIGHT,
        sizing_mode="stretch_width",
        x_range=tokens.x_range,
        x_axis_label="seconds ago",
        tools="",
        toolbar_location=None,
        name="dfllm-worker-tokens-plot",
    )
    per.multi_line("xs", "ys", source=worker_lines, color="color", line_width=2, legend_field="worker")
    per.legend.location = "top_left"
    per.add_tools(HoverTool(tooltips=[("worker", "@worker")]))
    cast(DataRange1d, per.y_range).start = 0

    kv_data = _kv_data(data)
    kv_source = ColumnDataSource(kv_data, name="dfllm-kv")
    kv_workers = FactorRange(factors=kv_data["worker"])
    kv = figure(
        title="KV cache use (% of blocks)",
        height=PLOT_HEIGHT,
        width=340,
        x_range=Range1d(start=0, end=100),
        y_range=kv_workers,
        tools="",
        toolbar_location=None,
        name="dfllm-kv-plot",
    )
    kv.hbar(y="worker", right="kv_pct", height=0.6, source=kv_source, color="#2ca02c")
    kv.add_tools(HoverTool(tooltips=[("worker", "@worker"), ("KV cache", "@kv_pct{0.0} %")]))

    jobs_source = ColumnDataSource(_jobs_data(data), name="dfllm-jobs")
    job_titles = {
        "job": "job",
        "rows": "rows done",
        "errors": "rows with llm_error",
        "partitions_done": "partitions done",
        "partitions_running": "in flight",
        "partitions_failed": "failed",
        "workers": "workers",
    }
    jobs_table = DataTable(
        source=jobs_source,
        index_position=None,
        height=150,
        sizing_mode="stretch_width",
        name="dfllm-jobs-table",
        columns=[
            TableColumn(
                field=c,
                title=job_titles[c],
                width=300 if c == "job" else 90,
                **_formatter({k: int_fmt for k in JOB_COLUMNS if k != "job"}, c),
            )
            for c in JOB_COLUMNS
        ],
    )

    def update() -> None:
        new = _view(plugin.data())
        summary.text = _summary(new)
        workers_source.data = _worker_table_data(new)
        cluster_data, worker_data = _series_data(new)
        cluster_source.data = cluster_data
        worker_lines.data = worker_data
        kv_data = _kv_data(new)
        if list(kv_workers.factors) != kv_data["worker"]:
            kv_workers.factors = kv_data["worker"]
        kv_source.data = kv_data
        jobs_source.data = _jobs_data(new)

    doc.add_periodic_callback(update, REFRESH_MS)
    doc.title = "Dask: dfllm"
    doc.add_root(
        column(
            summary,
            workers_table,
            row(tokens, per, kv, sizing_mode="stretch_width"),
            jobs_table,
            sizing_mode="stretch_width",
        )
    )
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


def _formatter(formats: dict[str, NumberFormatter], column: str) -> dict[str, Any]:
    """``TableColumn``'s ``formatter`` argument for ``column``, if it has one."""
    return {"formatter": formats[column]} if column in formats else {}
