"""dfllm's page in the Dask dashboard, on real clusters with real jobs.

- A ``LocalCluster`` of two worker processes with Dask's dashboard: a plain Dask job
  (``ddf.llm.generate(...)``) installs the page by itself; while it runs the data endpoint
  reports both workers generating, and at the end the job's rows and rows with
  ``llm_error``. Headless Chromium (Debian's ``chromium``) renders the page during a job.
- ``dask scheduler --preload dfllm.dashboard`` and two ``dask worker`` processes: the page is
  there before any job, ``dfllm run --scheduler`` prints its URL, and the endpoint follows
  the job.

``DFLLM_DASHBOARD_SCREENSHOT=docs/dashboard.png`` makes the browser test save the page
(1200x800) there.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import dask.dataframe as dd
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import free_port

pytestmark = pytest.mark.timeout(300)

SAMPLING = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
ENGINE = {"max_model_len": 256, "kv_cache_memory_bytes": 2**22}


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def get_text(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def get_status(url: str) -> int:
    """The HTTP status of ``GET url`` (its body read, whatever it is); for a WebSocket
    route (a plain GET answers 400, asking for the upgrade), 101 if the handshake succeeds."""
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        if e.code != 400 or b"WebSocket" not in e.read():
            return e.code

    async def handshake() -> int:
        from tornado.websocket import websocket_connect

        conn = await websocket_connect("ws" + url.removeprefix("http"), connect_timeout=30)
        conn.close()
        return 101

    return asyncio.run(handshake())


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25):
    """``predicate()``'s first truthy value within ``timeout`` s (exceptions count as falsy)."""
    end, last = time.monotonic() + timeout, None
    while time.monotonic() < end:
        try:
            value = predicate()
        except Exception as exc:  # e.g. the endpoint is not there yet
            value, last = None, exc
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last error: {last!r})")


def frame(n: int, bad_every: int) -> pd.DataFrame:
    """``n`` questions; every ``bad_every``-th is null, a bad row that gets an ``llm_error``."""
    return pd.DataFrame(
        {"id": range(n), "q": [None if i % bad_every == 0 else f"question {i}: why?" for i in range(n)]}
    )


def both_generating(data: dict) -> bool:
    return len(data["workers"]) == 2 and all(w["generation_tokens"] > 0 for w in data["workers"])


@pytest.fixture(scope="module")
def cluster():
    """Two worker processes (two threads each) and a scheduler serving Dask's dashboard."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=2,
            processes=True,
            dashboard_address="127.0.0.1:0",
            silence_logs=logging.ERROR,
            env={"DFLLM_NUM_THREADS": "1"},
        ) as c,
        Client(c) as client,
    ):
        yield client


def base_url(client) -> str:
    from dfllm.dashboard import page_url

    return page_url(client.dashboard_link)


@pytest.mark.slow
def test_a_plain_dask_job_installs_the_page_and_reports_every_worker(cluster, tiny_llama):
    client = cluster
    df = frame(48, bad_every=8)  # rows 0, 8, ... 40: 6 bad rows
    ddf = dd.from_pandas(df, npartitions=12)
    future = client.compute(ddf.llm.generate("Q: {q}", model=str(tiny_llama), sampling_params=SAMPLING, **ENGINE))
    page = base_url(client)
    # no client-side call: the first partition on a worker asks the scheduler to load the page
    live = wait_for(
        lambda: (d := get_json(page + "/data.json")) and both_generating(d) and d,
        120,
        "both workers to report generated tokens",
    )
    assert {w["worker"] for w in live["workers"]} == set(client.scheduler_info()["workers"])
    for w in live["workers"]:
        assert w["models"] == [tiny_llama.name] and w["devices"] == ["cpu"]
        assert w["tensor_parallel_size"] == 1 and w["pipeline_parallel_size"] == 1
    out = future.result()
    bad = int(out["llm_error"].notna().sum())
    assert bad == 6

    def finished():
        jobs = [j for j in get_json(page + "/data.json")["jobs"] if j["rows"] == len(df)]
        return jobs[0] if jobs and jobs[0]["partitions_running"] == 0 else None

    job = wait_for(finished, 30, "the job's rows to be counted")
    assert job["errors"] == bad
    assert job["partitions_done"] == 12 and job["partitions_failed"] == 0 and job["workers"] == 2
    data = get_json(page + "/data.json")
    assert data["cluster"]["generation_tokens"] >= SAMPLING["max_tokens"] * (len(df) - bad)
    assert data["cluster"]["prompt_tokens"] > 0 and data["cluster"]["prefix_cache_queries"] > 0
    assert max(data["series"]["generation_tps"]) > 0
    assert data["page"] == "/dfllm"
    # the Bokeh page is served by the dashboard's server, and its navigation links to it
    status, html = get_text(page)
    assert status == 200 and "Bokeh" in html and 'href="dfllm"' in html
    status, html = get_text(page.rsplit("/", 1)[0] + "/status")
    assert status == 200 and 'href="dfllm"' in html


@pytest.fixture
def fresh_cluster():
    """A cluster of its own: Dask's task-group pages (``/groups``) fail on a scheduler that
    still holds dependents of forgotten task groups (Dask's own bookkeeping, whatever the
    tasks), which the module's shared cluster may, depending on the tests before."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            processes=True,
            dashboard_address="127.0.0.1:0",
            silence_logs=logging.ERROR,
        ) as c,
        Client(c) as client,
    ):
        yield client


@pytest.mark.slow
def test_every_route_of_the_schedulers_sitemap_answers_with_the_page_installed(fresh_cluster):
    """Dask's ``/sitemap.json`` lists the scheduler's routes, dfllm's page and data among
    them, and each (but patterns with placeholders) answers 200 (101, the handshake, for a
    WebSocket): Dask's own walker answered 500 on the Bokeh applications' static routes."""
    from dfllm.dashboard import install

    client = fresh_cluster
    assert client.submit(sum, [1, 2]).result() == 3  # a plain Dask task first
    page = install(client)  # as dfllm run does
    assert page == base_url(client)
    root = page.rsplit("/", 1)[0]
    status, text = get_text(root + "/sitemap.json")
    assert status == 200, "GET /sitemap.json failed"
    paths = json.loads(text)["paths"]
    assert {"/dfllm", "/dfllm/data.json", "/status", "/sitemap.json", "/health"} <= set(paths), paths
    walked = [p for p in paths if not re.search(r"[()\[\]*+?|\\]", p)]
    assert len(walked) > 20, paths
    answers = {p: get_status(root + p) for p in walked}
    assert {p: s for p, s in answers.items() if s != 200} == {"/eventstream": 101}


def test_job_names_group_a_jobs_partitions():
    from dfllm.dashboard import data_url, page_url
    from dfllm.worker.progress import job_of

    assert job_of(("llm-generate-0a1b2c", 7)) == "llm-generate-0a1b2c"
    assert job_of("llm-write-chat-12-ab12cd34") == "llm-write-chat-ab12cd34"
    assert job_of("llm-generate-placed-0123456789ab") == "llm-generate-placed"
    assert page_url("http://h:8787/status") == "http://h:8787/dfllm"
    assert page_url("http://h:8787/prefix/status") == "http://h:8787/prefix/dfllm"
    assert data_url("http://h:8787/status") == "http://h:8787/dfllm/data.json"
    assert page_url(None) is None


# ---- a real browser ------------------------------------------------------------------------------------
def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


PAGE_STATE = """(() => {
  const cells = [], canvases = [];
  const walk = (n) => {
    if (n.shadowRoot) walk(n.shadowRoot);
    for (const c of n.children || []) walk(c);
    if (n.classList && n.classList.contains('slick-cell')) cells.push(n.textContent);
    if (n.tagName === 'CANVAS' && n.width > 0 && n.height > 0) canvases.push(n.width);
  };
  walk(document.documentElement);
  const doc = window.Bokeh && Bokeh.documents && Bokeh.documents[0];
  const col = (name, key) => {
    const src = doc && doc.get_model_by_name(name);
    if (!src) return null;
    const d = src.data;
    return Array.from(d instanceof Map ? d.get(key) : d[key]);
  };
  return JSON.stringify({cells, canvases: canvases.length, title: document.title,
                         generated: col('dfllm-tokens', 'generation_tps'), workers: col('dfllm-workers', 'worker')});
})()"""


class DevTools:
    """A headless Chromium page driven over the DevTools protocol (tornado's websocket)."""

    def __init__(self, ws_url: str):
        self.ws_url, self.ids = ws_url, 0

    async def __aenter__(self):
        from tornado.websocket import websocket_connect

        self.conn = await websocket_connect(self.ws_url, max_message_size=64 * 2**20)
        return self

    async def __aexit__(self, *exc):
        self.conn.close()

    async def call(self, method: str, **params) -> dict:
        self.ids += 1
        self.conn.write_message(json.dumps({"id": self.ids, "method": method, "params": params}))
        while True:
            msg = json.loads(await self.conn.read_message())
            if msg.get("id") == self.ids:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")


async def watch_page(ws_url: str, workers: set[str], timeout: float, screenshot: str | None) -> dict:
    """The page's state once its table shows every worker and its tokens/s plot has data."""
    async with DevTools(ws_url) as tab:
        await tab.call("Emulation.setDeviceMetricsOverride", width=1200, height=800, deviceScaleFactor=1, mobile=False)
        end, state = time.monotonic() + timeout, None
        while time.monotonic() < end:
            raw = await tab.evaluate(PAGE_STATE)
            state = json.loads(raw) if raw else None
            if (
                state
                and workers <= set(state["cells"])
                and state["canvases"]
                and sum(1 for v in state["generated"] or () if v > 0) >= 3
            ):
                break
            await asyncio.sleep(0.5)
        if screenshot:
            shot = await tab.call("Page.captureScreenshot", format="png")
            Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
        return state or {}


@pytest.mark.slow
def test_chromium_renders_the_page_during_a_job(cluster, tiny_llama, tmp_path):
    binary = chromium()
    if binary is None:
        pytest.skip("no Chromium: .ci/run installs Debian's chromium package with apt-get, which failed here")
    client = cluster
    page = base_url(client)
    ddf = dd.from_pandas(frame(48, bad_every=10), npartitions=12)
    future = client.compute(
        ddf.llm.generate("Q: {q}", model=str(tiny_llama), sampling_params={**SAMPLING, "max_tokens": 96}, **ENGINE)
    )
    wait_for(lambda: both_generating(get_json(page + "/data.json")), 120, "the job to start")
    port = free_port()
    profile = tempfile.mkdtemp(dir=tmp_path)
    log = tmp_path / "chromium.log"
    with open(log, "w") as log_file:
        browser = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--hide-scrollbars",
                f"--remote-debugging-port={port}",
                "--remote-allow-origins=*",
                f"--user-data-dir={profile}",
                "--window-size=1200,800",
                page,
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )

    def page_target():
        if browser.poll() is not None:
            raise AssertionError(f"Chromium exited with {browser.returncode}: {log.read_text()[-2000:]}")
        return [
            t
            for t in get_json(f"http://127.0.0.1:{port}/json/list")
            if t.get("type") == "page" and "/dfllm" in t.get("url", "")
        ]

    try:
        try:
            targets = wait_for(page_target, 60, "Chromium's DevTools endpoint")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{log.read_text()[-2000:]}") from None
        workers = set(client.scheduler_info()["workers"])
        state = asyncio.run(
            watch_page(targets[0]["webSocketDebuggerUrl"], workers, 60, os.environ.get("DFLLM_DASHBOARD_SCREENSHOT"))
        )
    finally:
        browser.terminate()
        try:
            browser.wait(timeout=20)
        except subprocess.TimeoutExpired:
            browser.kill()
    assert state.get("title") == "Dask: dfllm"
    assert workers <= set(state["cells"]), state["cells"]  # each worker's row in the rendered table
    assert "cluster (all)" in state["cells"] and tiny_llama.name in state["cells"]
    assert state["canvases"] > 0 and max(state["generated"]) > 0  # the tokens/s plot has data
    future.result()


# ---- dask scheduler --preload dfllm.dashboard, dask worker, dfllm run --scheduler ----------------------
@pytest.fixture
def preloaded_cluster():
    """``dask scheduler --preload dfllm.dashboard`` with a dashboard, and two ``dask worker``s."""
    from distributed import Client

    port, http = free_port(), free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "DFLLM_NUM_THREADS": "1"}
    dask = [sys.executable, "-m", "dask"]
    procs = [
        subprocess.Popen(
            dask
            + [
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dashboard-address",
                f"127.0.0.1:{http}",
                "--preload",
                "dfllm.dashboard",
            ],
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    procs += [
        subprocess.Popen(
            dask
            + ["worker", address, "--nthreads", "2", "--no-dashboard", "--memory-limit", "0", "--host", "127.0.0.1"],
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(2)
    ]
    try:
        with Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
            yield address, f"http://127.0.0.1:{http}", client
    finally:
        import signal

        for p in reversed(procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.slow
def test_dfllm_run_on_a_command_line_cluster_prints_the_page(preloaded_cluster, tiny_llama, tmp_path):
    address, dashboard, client = preloaded_cluster
    page = f"{dashboard}/dfllm"
    assert get_text(page)[0] == 200  # the preload serves the page before any job
    assert get_text(f"{dashboard}/sitemap.json")[0] == 200  # and Dask's route index lists it
    src = tmp_path / "in.parquet"
    df = frame(40, bad_every=5)  # 8 bad rows
    df.to_parquet(src)
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dfllm.jobs.cli",
            "run",
            str(src),
            str(tmp_path / "out"),
            "--prompt",
            "Q: {q}",
            "--model",
            str(tiny_llama),
            "--max-tokens",
            "48",
            "--max-model-len",
            "256",
            "--npartitions",
            "8",
            "--scheduler",
            address,
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        live = wait_for(
            lambda: (d := get_json(page + "/data.json")) and both_generating(d) and d,
            180,
            "both workers to report generated tokens",
        )
        assert any(j["job"].startswith("llm-write-generate-") for j in live["jobs"])
        stdout, stderr = run.communicate(timeout=180)
    finally:
        run.kill()
    assert run.returncode == 0, stderr[-3000:]
    assert f"dashboard {dashboard}/status; dfllm page {page}" in stderr
    errors = int(re.search(r"rows:\s+40 \((\d+) with llm_error\)", stdout).group(1))
    assert errors == 8 == int(pd.read_parquet(tmp_path / "out")["llm_error"].notna().sum())

    def finished():
        jobs = [j for j in get_json(page + "/data.json")["jobs"] if j["job"].startswith("llm-write-generate-")]
        return jobs[0] if jobs and jobs[0]["rows"] == len(df) else None

    job = wait_for(finished, 30, "the job's rows to be counted")
    assert job["errors"] == errors and job["partitions_done"] == 8 and job["partitions_running"] == 0


# ---- hostile reports: names, text and numbers the page must show, never run or fail on ------------------
XSS = '<img src=x onerror="window.__dfllm_xss=1">'
HOSTILE_TEXT = [
    XSS,
    "</script><script>window.__dfllm_xss=1</script>",
    "\ud800 lone",
    "a & b \"'</textarea>",
    "\ufeffbom",
]


def hostile_engine(model: str, **numbers) -> dict:
    info = {
        "model": model,
        "device": "cpu",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "kind": "generate",
        "running": 1,
        "waiting": 0,
        "kv_cache_usage": 0.5,
        "prompt_tokens": 10,
        "generation_tokens": 20,
        "preemptions": 0,
        "prefix_cache_queries": 4,
        "prefix_cache_hits": 2,
    }
    return {**info, **numbers}


def scheduler_with(reports: dict[str, object]):
    """A scheduler's worker table (Dask's own ``WorkerState``s) whose workers last reported ``reports``."""
    from types import SimpleNamespace

    from distributed.core import Status
    from distributed.scheduler import WorkerState

    workers = {}
    for i, (addr, rep) in enumerate(reports.items()):
        ws = WorkerState(
            address=addr,
            status=Status.running,
            pid=i,
            name=f"w{i}\udcff<b>",
            memory_limit=0,
            local_directory="/tmp",
            nanny=None,
            server_id=str(i),
        )
        ws.metrics = {"dfllm": rep}
        workers[addr] = ws
    return SimpleNamespace(workers=workers)


def page_of(plugin):
    """The dfllm page's Bokeh document for ``plugin``, serialised as Bokeh's server sends it."""
    from bokeh.core.json_encoder import serialize_json
    from bokeh.document import Document

    from dfllm.dashboard.page import dfllm_doc

    doc = Document()
    dfllm_doc(plugin, None, {}, doc)
    text = serialize_json(doc.to_json())
    text.encode("utf-8")  # what the websocket sends: valid UTF-8
    return doc, text


def summary_tags(doc) -> list[str]:
    summary = doc.get_model_by_name("dfllm-summary").text
    return re.findall(r"<\s*/?\s*([a-zA-Z]+)", summary)


def numbers_json(data) -> str:
    """The JSON endpoint's body for ``data`` (as :class:`DataHandler` writes it)."""
    from dfllm.dashboard.collector import DataHandler

    class Capture(DataHandler):
        def __init__(self, plugin):
            self.plugin, self.body, self.headers = plugin, [], {}

        def set_header(self, k, v):
            self.headers[k] = v

        def write(self, chunk):
            self.body.append(chunk)

    handler = Capture(type("P", (), {"data": lambda self: data})())
    handler.get()
    return "".join(handler.body)


def test_hostile_names_and_numbers_are_shown_escaped_never_run():
    from dfllm.dashboard.collector import DashboardPlugin

    report = {
        "time": 1.0,
        "process": "p",
        "engines": [
            hostile_engine(t, running=2**70, waiting=float("nan"), kv_cache_usage=float("inf")) for t in HOSTILE_TEXT
        ],
        "batch_last": 2**80,
        "batch_mean": float("-inf"),
        "jobs": {
            t: {"rows": 3, "errors": 1, "done": 1, "running": 0, "failed": 0, "updated": 1.0} for t in HOSTILE_TEXT
        },
    }
    plugin = DashboardPlugin()
    plugin.scheduler = scheduler_with({"tcp://127.0.0.1:1": report})
    plugin.sample()
    body = numbers_json(plugin.data())
    data = json.loads(body, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))  # no NaN/Infinity
    body.encode("utf-8")
    (w,) = data["workers"]
    assert w["models"] == [XSS, HOSTILE_TEXT[1], "\\ud800 lone", HOSTILE_TEXT[3], "\ufeffbom"]
    assert w["name"] == "w0\\udcff<b>"
    assert w["waiting"] is None and w["kv_cache_usage"] is None  # unknown, not a made-up number
    assert w["running"] == pytest.approx(len(HOSTILE_TEXT) * 2.0**70)
    assert {j["job"] for j in data["jobs"]} == {XSS, HOSTILE_TEXT[1], "\\ud800 lone", HOSTILE_TEXT[3], "\ufeffbom"}
    doc, text = page_of(plugin)
    assert summary_tags(doc) == ["b", "b"]  # only the page's own <b>dfllm</b>: every name is text
    summary = doc.get_model_by_name("dfllm-summary").text
    assert html_unescape(summary).count(XSS) == 1 and "</script>" not in summary
    assert doc.get_model_by_name("dfllm-jobs").data["job"][0] in data["jobs"][0]["job"]


def html_unescape(text: str) -> str:
    import html

    return html.unescape(text)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**200), max_value=2**200) | st.sampled_from([2**64, -(2**63) - 1, 2**3000, -(2**3000)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(alphabet=st.characters(codec=None, categories=None), max_size=12),
    st.binary(max_size=6),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
engine_reports = st.one_of(
    values,
    st.fixed_dictionaries(
        {},
        optional={
            k: values
            for k in (
                "model",
                "device",
                "kind",
                "running",
                "waiting",
                "kv_cache_usage",
                "prompt_tokens",
                "generation_tokens",
                "tensor_parallel_size",
                "pipeline_parallel_size",
                "prefix_cache_queries",
                "prefix_cache_hits",
                "preemptions",
            )
        },
    ).map(lambda d: {"kind": "generate", **d}),
)
reports = st.fixed_dictionaries(
    {},
    optional={
        "time": values,
        "process": values,
        "engines": st.lists(engine_reports, max_size=3) | values,
        "batch_last": values,
        "batch_mean": values,
        "jobs": st.dictionaries(
            st.text(max_size=6),
            st.dictionaries(
                st.sampled_from(["rows", "errors", "done", "running", "failed", "updated"]), values, max_size=6
            )
            | values,
            max_size=3,
        )
        | values,
    },
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=reports, second=reports)
def test_any_report_is_shown_and_never_fails_the_page_or_the_endpoint(first, second):
    """Whatever two workers report (twice, so rates are computed), the collector samples it,
    the endpoint answers strict JSON of valid Unicode and the page renders with no markup of
    the reports' own."""
    from dfllm.dashboard.collector import DashboardPlugin

    plugin = DashboardPlugin()
    plugin.scheduler = scheduler_with({"tcp://127.0.0.1:1": first, "tls://127.0.0.1:1": second})
    plugin.sample()
    plugin.scheduler.workers["tcp://127.0.0.1:1"].metrics["dfllm"] = second
    plugin.sample()
    body = numbers_json(plugin.data())
    body.encode("utf-8")
    json.loads(body, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    doc, _ = page_of(plugin)
    assert summary_tags(doc) == ["b", "b"]
    kv = doc.get_model_by_name("dfllm-kv").data["worker"]
    assert len(set(kv)) == len(kv) == 2  # the KV plot's categories never repeat


def test_the_heartbeat_report_is_plain_data_msgpack_encodes():
    """A model folder named with bytes that are not UTF-8 (a lone surrogate in Python) or a
    counter past 64 bits made the worker's heartbeat fail to encode, and Dask closes a worker
    whose heartbeat fails: the report is plain data instead."""
    from distributed.protocol import dumps, loads

    from dfllm.dashboard.reporting import report
    from dfllm.worker import progress

    def source():
        return [
            hostile_engine("m\udcff" + XSS, prompt_tokens=2**70, generation_tokens=-(2**3000), running=float("nan"))
        ]

    progress.add_engine_source(source)
    try:
        rep = loads(dumps({"metrics": {"dfllm": report()}}))["metrics"]["dfllm"]
    finally:
        progress._engine_sources.remove(source)
    (engine,) = [e for e in rep["engines"] if e["model"].startswith("m")]
    assert engine["model"] == "m\\udcff" + XSS
    assert engine["prompt_tokens"] == 2.0**70 and engine["generation_tokens"] == -math.inf


@given(value=values)
@settings(max_examples=200, deadline=None)
def test_plain_data_always_encodes(value):
    from distributed.protocol import dumps, loads

    from dfllm.dashboard.reporting import plain

    loads(dumps({"v": plain(value)}))
    json.dumps(plain(value, finite=True), allow_nan=False).encode("utf-8")


@pytest.mark.slow
def test_a_worker_reporting_a_hostile_engine_keeps_running(fresh_cluster):
    """On a real cluster (worker processes, msgpack heartbeats), a worker whose engine reports
    a name with a lone surrogate and a counter past 64 bits stays up, runs tasks, and the
    page's data shows the name."""
    from dfllm.dashboard import data_url, install

    client = fresh_cluster
    install(client)

    def add_source():
        from dfllm.worker import progress

        def source():
            return [hostile_engine("m\udcff" + XSS, prompt_tokens=2**70)]

        progress.add_engine_source(source)

    client.run(add_source)
    url = data_url(client.dashboard_link)

    def shown():
        workers = get_json(url)["workers"]
        return workers and workers[0]["models"] == ["m\\udcff" + XSS]

    wait_for(shown, 30, "the hostile engine's report")
    time.sleep(3)  # several heartbeats later
    assert len(client.scheduler_info()["workers"]) == 1
    assert client.submit(sum, [1, 2], pure=False).result(timeout=30) == 3


SUMMARY_STATE = """(() => {
  let img = false, shown = [];
  const walk = (n) => {
    if (n.shadowRoot) walk(n.shadowRoot);
    for (const c of n.children || []) walk(c);
    if (n.classList && n.classList.contains('bk-clearfix')) {  // a Div's content: the summary line
      shown.push(n.textContent);
      img = img || n.querySelector('img') !== null;
    }
  };
  walk(document.documentElement);
  return JSON.stringify({xss: window.__dfllm_xss || null, img, shown: shown.join(' ')});
})()"""


@pytest.mark.slow
def test_chromium_shows_a_hostile_model_name_as_text(tmp_path):
    """A model folder may be named ``<img src=x onerror=...>``: the page's summary line (a
    ``Div``, whose text is HTML) showed it as markup, and Chromium ran its handler."""
    binary = chromium()
    if binary is None:
        pytest.skip("no Chromium: .ci/run installs Debian's chromium package with apt-get, which failed here")
    from distributed import Client, LocalCluster

    from dfllm.dashboard import install
    from dfllm.worker import progress

    def source():
        return [hostile_engine(XSS)]

    progress.add_engine_source(source)  # the in-process worker's engines
    try:
        with (
            LocalCluster(
                n_workers=1,
                threads_per_worker=1,
                processes=False,
                dashboard_address="127.0.0.1:0",
                silence_logs=logging.ERROR,
            ) as c,
            Client(c) as client,
        ):
            from urllib.parse import urlsplit

            page = f"http://127.0.0.1:{urlsplit(install(client)).port}/dfllm"  # bound there; the link names the host
            # the process's other engines (earlier tests') are reported too
            wait_for(lambda: XSS in get_json(page + "/data.json")["cluster"]["models"], 30, "the engine's report")
            port = free_port()
            browser = subprocess.Popen(
                [
                    binary,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    f"--remote-debugging-port={port}",
                    "--remote-allow-origins=*",
                    f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}",
                    page,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                targets = wait_for(
                    lambda: [
                        t
                        for t in get_json(f"http://127.0.0.1:{port}/json/list")
                        if t.get("type") == "page" and "/dfllm" in t.get("url", "")
                    ],
                    60,
                    "Chromium's DevTools endpoint",
                )

                async def watch() -> dict:
                    async with DevTools(targets[0]["webSocketDebuggerUrl"]) as tab:
                        end, state = time.monotonic() + 60, {}
                        while time.monotonic() < end:
                            raw = await tab.evaluate(SUMMARY_STATE)
                            state = json.loads(raw) if raw else {}
                            if state.get("xss") or (XSS in (state.get("shown") or "")):
                                await asyncio.sleep(1.5)  # a refresh later: a handler would have run by now
                                return json.loads(await tab.evaluate(SUMMARY_STATE))
                            await asyncio.sleep(0.5)
                        return state

                state = asyncio.run(watch())
            finally:
                browser.terminate()
                try:
                    browser.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    browser.kill()
    finally:
        progress._engine_sources.remove(source)
    assert state.get("xss") is None and state.get("img") is False, (
        state
    )  # its handler ran before (window.__dfllm_xss was 1)
    assert XSS in state["shown"], state  # the name, as text
