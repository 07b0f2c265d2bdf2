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
