"""The response cache across jobs (``cache=``, ``--cache``): a rerun answers the rows it saw
before without the engine, with the outputs the engine gave.

Every test runs the real engine on the tiny Llama. "Without the engine" is measured on the
engine itself: the requests it finished (``dfllm_request_generation_tokens``' count, read
in this process or on every Dask worker) do not grow for rows answered from the cache.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dask.dataframe as dd
import pandas as pd
import prometheus_client
import pytest

import dfllm
from dfllm.accessors.partitions import PartitionFunction
from dfllm.engine.input_processor import EngineRequest
from dfllm.outputs import CompletionOutput, Logprob, RequestOutput
from dfllm.tasks import response_cache as rc
from dfllm.tasks.task import make_task

from helpers import free_port, local_client

pytestmark = pytest.mark.timeout(600)

SP = {"temperature": 0.0, "max_tokens": 3}
ENGINE = {"max_model_len": 64}
COLUMNS = ["from_cache", "num_cached_tokens", "time_taken_llm"]
OUTPUTS = ["generated_text", "num_input_tokens", "num_generated_tokens", "finish_reason", "llm_error"]


@pytest.fixture(autouse=True)
def no_idle_engines():
    """Each test starts with no idle engine in this process: a test's new engine would
    otherwise evict the least recently used one (DFLLM_MAX_ENGINES), and its count with it."""
    dfllm.release_engines()
    yield


def engine_requests() -> int:
    """Requests this process's engines finished (each engine's finished-request histogram)."""
    from dfllm.worker.engine_cache import engines_now

    return sum(
        m.count
        for llm in engines_now()
        if llm.engine is not None
        for m in llm.get_metrics()
        if m.name == "dfllm_request_generation_tokens"
    )


def frame(ids) -> pd.DataFrame:
    return pd.DataFrame({"id": list(ids), "q": [f"Question {i}: why is the sky blue?" for i in ids]})


def generate(df, model, cache, sp=SP, **kwargs):
    return df.llm.generate(
        "{q}", model=str(model), sampling_params=sp, cache=cache, engine_columns=COLUMNS, **ENGINE, **kwargs
    )


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.json") if not p.name.startswith("."))


# ---- pandas ----------------------------------------------------------------------------------------------
def test_rerun_answers_the_overlapping_rows_without_the_engine(tiny_llama, tmp_path):
    """Rows 0-7, then rows 4-11 (50% overlap): the second run's engine computes only 8-11;
    every row's output is what a run without the cache gives."""
    cache = str(tmp_path / "cache")
    before = engine_requests()
    first = generate(frame(range(8)), tiny_llama, cache)
    assert engine_requests() - before == 8 and not first["from_cache"].any()
    assert len(entries(tmp_path / "cache")) == 8
    counts = rc.counts()
    before = engine_requests()
    second = generate(frame(range(4, 12)), tiny_llama, cache)
    assert engine_requests() - before == 4  # only the new rows reached the engine
    assert rc.counts()["hits"] - counts["hits"] == 4 and rc.counts()["misses"] - counts["misses"] == 4
    assert (
        prometheus_client.REGISTRY.get_sample_value("dfllm_response_cache_lookups_total", {"result": "hit"})
        == rc.counts()["hits"]
    )
    assert second["from_cache"].tolist() == [True] * 4 + [False] * 4
    hits = second[second["from_cache"]]
    assert (hits["time_taken_llm"] == 0).all() and (hits["num_cached_tokens"] == hits["num_input_tokens"]).all()
    plain = frame(range(12)).llm.generate("{q}", model=str(tiny_llama), sampling_params=SP, **ENGINE)
    pd.testing.assert_frame_equal(
        second[OUTPUTS].reset_index(drop=True), plain[OUTPUTS].iloc[4:].reset_index(drop=True)
    )
    assert len(entries(tmp_path / "cache")) == 12


@pytest.mark.slow
def test_logprobs_and_structured_outputs_come_back_as_computed(tiny_llama, tmp_path):
    """An entry keeps everything the row's columns need: logprobs, prompt logprobs, the
    structured output's completeness (a choice column)."""
    sp = {**SP, "logprobs": 2, "prompt_logprobs": 1}
    cols = ["logprobs", "prompt_logprobs", "generated_tokens", "from_cache"]
    run = lambda: frame(range(3)).llm.generate(  # noqa: E731
        "{q}",
        model=str(tiny_llama),
        sampling_params=sp,
        cache=tmp_path / "c",
        engine_columns=cols,
        **ENGINE,
    )
    a, b = run(), run()
    assert not a["from_cache"].any() and b["from_cache"].all()
    for c in ("logprobs", "prompt_logprobs", "generated_tokens", *OUTPUTS):
        assert a[c].tolist() == b[c].tolist(), c
    choose = lambda: frame(range(3)).llm.generate(  # noqa: E731
        "{q}",
        model=str(tiny_llama),
        choice=["yes", "no"],
        sampling_params={"temperature": 0.0, "max_tokens": 4},
        cache=tmp_path / "c",
        engine_columns="from_cache",
        **ENGINE,
    )
    x, y = choose(), choose()
    assert y["from_cache"].all() and x["generated_text"].tolist() == y["generated_text"].tolist()
    assert set(y["generated_text"]) <= {"yes", "no"} and y["llm_error"].isna().all()


def test_only_deterministic_requests_use_the_cache(tiny_llama, tmp_path):
    """Sampled rows without a seed bypass the cache (looked up never, stored never); seeded
    sampling is cached; params with a callable (a logits processor) would have no key."""
    cache = tmp_path / "cache"
    sampled = {"temperature": 0.9, "max_tokens": 3}
    counts = rc.counts()
    generate(frame(range(3)), tiny_llama, cache, sampled)
    out = generate(frame(range(3)), tiny_llama, cache, sampled)
    assert not out["from_cache"].any() and not entries(cache)
    assert rc.counts()["bypassed"] - counts["bypassed"] == 6 and rc.counts()["hits"] == counts["hits"]
    seeded = {**sampled, "seed": 11}
    a = generate(frame(range(3)), tiny_llama, cache, seeded)
    before = engine_requests()
    b = generate(frame(range(3)), tiny_llama, cache, seeded)
    assert engine_requests() == before and b["from_cache"].all()
    assert a["generated_text"].tolist() == b["generated_text"].tolist()
    assert len(entries(cache)) == 3
    keyless = dfllm.SamplingParams(temperature=0.0)
    keyless.logits_processors = [lambda ids, logits: logits]  # refused at SamplingParams' check; no key either
    assert rc.request_key("engine", EngineRequest(None, [1, 2], keyless)) is None
    assert rc.request_key("engine", EngineRequest(None, [1, 2], dfllm.SamplingParams(temperature=0.0)))


@pytest.mark.slow
def test_changed_params_or_model_files_miss(tiny_llama, tmp_path):
    """Any output-deciding change is another key: max_tokens, a stop string, the engine's
    arguments, new weights at the same path (the model's content identity)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    cache = tmp_path / "cache"
    generate(frame(range(2)), model, cache)
    assert generate(frame(range(2)), model, cache)["from_cache"].all()
    for sp in ({**SP, "max_tokens": 2}, {**SP, "stop": ["zzz"]}, {**SP, "repetition_penalty": 1.2}):
        assert not generate(frame(range(2)), model, cache, sp)["from_cache"].any(), sp
    assert (
        not frame(range(2))
        .llm.generate(
            "{q}", model=str(model), sampling_params=SP, cache=cache, engine_columns="from_cache", max_model_len=48
        )["from_cache"]
        .any()
    )
    weights = next(model.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # "new" weights
    assert not generate(frame(range(2)), model, cache)["from_cache"].any()
    assert generate(frame(range(2)), model, cache)["from_cache"].all()


def test_a_corrupt_or_mismatched_entry_is_a_miss_never_a_wrong_answer(tiny_llama, tmp_path):
    cache = tmp_path / "cache"
    want = generate(frame(range(3)), tiny_llama, cache)
    files = entries(cache)
    assert len(files) == 3
    doc = json.loads(files[0].read_text())
    doc["payload"] = doc["payload"].replace('"text":"', '"text":"WRONG ')  # checksum no longer matches
    files[0].write_text(json.dumps(doc))
    files[1].write_bytes(files[1].read_bytes()[:40])  # truncated
    shutil.copy(files[2], tmp_path / "other")
    counts = rc.counts()
    got = generate(frame(range(3)), tiny_llama, cache)
    assert got["from_cache"].sum() == 1 and rc.counts()["corrupt"] - counts["corrupt"] == 2
    pd.testing.assert_frame_equal(got[OUTPUTS], want[OUTPUTS])
    assert generate(frame(range(3)), tiny_llama, cache)["from_cache"].all()  # recomputed rows stored again
    for f in files[:2]:  # another entry's file under these names: its key does not match theirs
        shutil.copy(tmp_path / "other", f)
    counts = rc.counts()
    got = generate(frame(range(3)), tiny_llama, cache)
    assert rc.counts()["corrupt"] - counts["corrupt"] == 2 and got["from_cache"].sum() == 1
    pd.testing.assert_frame_equal(got[OUTPUTS], want[OUTPUTS])


def test_polars_frames_and_expressions_share_the_cache(tiny_llama, tmp_path):
    import polars as pl

    df = pl.from_pandas(frame(range(3)))
    a = df.llm.generate(
        "{q}", model=str(tiny_llama), sampling_params=SP, cache=tmp_path / "c", engine_columns="from_cache", **ENGINE
    )
    b = df.llm.generate(
        "{q}", model=str(tiny_llama), sampling_params=SP, cache=tmp_path / "c", engine_columns="from_cache", **ENGINE
    )
    assert a["from_cache"].to_list() == [False] * 3 and b["from_cache"].to_list() == [True] * 3
    before = engine_requests()
    texts = df.select(
        pl.col("q").llm.generate(model=str(tiny_llama), sampling_params=SP, cache=tmp_path / "c", **ENGINE)
    )
    assert engine_requests() == before and texts["q"].to_list() == a["generated_text"].to_list()


def test_a_store_that_cannot_be_used_is_logged_and_the_job_goes_on(tiny_llama, tmp_path, caplog):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache's folder should be")
    counts = rc.counts()
    out = generate(frame(range(2)), tiny_llama, blocked)
    assert out["llm_error"].isna().all() and not out["from_cache"].any()
    assert rc.counts()["stored"] == counts["stored"] and "response cache" in caplog.text


# ---- the store: eviction and concurrent writers ------------------------------------------------------
def fake_output(i: int, text_len: int = 50) -> RequestOutput:
    lp = {7: Logprob(-0.5, 1, "a"), 9: Logprob(float("-inf"), 2, None)}
    c = CompletionOutput(0, f"answer {i} " + "x" * text_len, [1, 2, i], -1.25, [lp, None], "stop", "\n", None)
    return RequestOutput(f"r{i}", None, [5, 6], [c], True, prompt_logprobs=[None, {6: Logprob(-3.0, 4, "b")}])


def test_entries_round_trip_through_json(tmp_path):
    cache = rc.ResponseCache(str(tmp_path / "c"))
    out = fake_output(3)
    cache.store({"k3": rc.payload_of(out)})
    (payload,) = cache.lookup(["k3"])
    back = rc.output_of(payload, type("Req", (), {"prompt": None, "prompt_token_ids": [5, 6]})(), "x")
    assert back.outputs[0] == out.outputs[0] and back.prompt_logprobs == out.prompt_logprobs
    assert back.num_cached_tokens == 2 and cache.lookup(["k4"]) == [None]


def test_eviction_keeps_the_cache_within_max_bytes_and_the_recently_used(tmp_path):
    root = tmp_path / "c"
    size = len(rc.encode_entry("k0", rc.payload_of(fake_output(0))))
    cache = rc.ResponseCache(str(root), max_bytes=10 * size + size // 2)
    foreign = [root / "README.txt", root / "ab" / "cd" / "notes.json"]
    for f in foreign:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("not an entry")
    for i in range(8):
        cache.store({f"k{i}": rc.payload_of(fake_output(i))})
        os.utime(cache.path_of(f"k{i}"), (1000 + i, 1000 + i))  # written in order
    assert cache.lookup(["k0"])[0] is not None  # a hit refreshes k0's time
    counts = rc.counts()
    for i in range(8, 14):
        cache.store({f"k{i}": rc.payload_of(fake_output(i))})
    assert cache.size() <= cache.max_bytes
    assert rc.counts()["evicted"] - counts["evicted"] >= 3
    kept = [i for i in range(14) if cache.lookup([f"k{i}"])[0] is not None]
    assert 0 in kept and 1 not in kept and set(range(8, 14)) <= set(kept)  # least recently used go first
    assert all(f.exists() for f in foreign)  # nothing but entries is ever deleted
    big = rc.ResponseCache(str(tmp_path / "small"), max_bytes=size // 2)
    big.store({"k": rc.payload_of(fake_output(0))})  # larger than the whole bound: not stored
    assert big.lookup(["k"]) == [None]


def _writer(args) -> dict:
    root, worker = args
    cache = rc.ResponseCache(root)
    wrong, corrupt = 0, rc.counts()["corrupt"]  # a forked process starts with its parent's counts
    for round_ in range(3):
        shared = {f"shared-{i}": rc.payload_of(fake_output(i)) for i in range(30)}
        own = {f"own-{worker}-{round_}-{i}": rc.payload_of(fake_output(100 + i)) for i in range(10)}
        cache.store({**shared, **own})
        for key, payload in zip(shared, cache.lookup(list(shared))):
            wrong += payload is not None and payload != shared[key]
    return {"wrong": wrong, "corrupt": rc.counts()["corrupt"] - corrupt}


def test_concurrent_writers_leave_only_whole_entries(tmp_path):
    """Four processes write the same 30 entries and 30 of their own at once, reading back as
    they go: nobody reads a partial or wrong entry, every entry is whole afterwards, and no
    temporary file is left."""
    root = str(tmp_path / "c")
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.map(_writer, [(root, w) for w in range(4)])
    assert all(r["wrong"] == 0 and r["corrupt"] == 0 for r in results)
    cache = rc.ResponseCache(root)
    keys = [f"shared-{i}" for i in range(30)] + [
        f"own-{w}-{r}-{i}" for w in range(4) for r in range(3) for i in range(10)
    ]
    assert all(p is not None for p in cache.lookup(keys))
    assert len(entries(Path(root))) == 30 + 120
    assert not [p for p in Path(root).rglob(".tmp-*")]


# ---- object storage --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    import boto3

    boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket="cache")
    yield {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
    }
    server.stop()


@pytest.mark.slow
def test_a_cache_on_object_storage(s3, tiny_llama):
    cache = dfllm.ResponseCache("s3://cache/responses", storage_options=s3, max_bytes=1 << 20)
    a = generate(frame(range(3)), tiny_llama, cache)
    before = engine_requests()
    b = generate(frame(range(3)), tiny_llama, {"url": "s3://cache/responses", "storage_options": s3})
    assert engine_requests() == before and b["from_cache"].all()
    pd.testing.assert_frame_equal(a[OUTPUTS], b[OUTPUTS])
    import s3fs

    found = s3fs.S3FileSystem(**s3).find("cache/responses")
    assert len(found) == 3 and all(rc._is_entry(p, "cache/responses", 2) for p in found)


def test_evicting_a_cache_whose_name_is_a_pattern_deletes_only_its_own_entries(s3):
    import s3fs

    payload = {"text": "x" * 1000}
    other = dfllm.ResponseCache("s3://cache/c1", storage_options=s3, max_bytes=1 << 30)
    mine = dfllm.ResponseCache("s3://cache/c[1]", storage_options=s3, max_bytes=1 << 30)
    for c in (other, mine):
        c.store({f"k{i}": payload for i in range(4)})
    fs = s3fs.S3FileSystem(**s3)
    theirs = sorted(fs.find("cache/c1"))
    assert len(theirs) == 4
    # s3fs's rm of a list expands patterns: "c[1]/..." matched the cache "c1"'s entries too
    assert dfllm.ResponseCache("s3://cache/c[1]", storage_options=s3, max_bytes=100).evict() == 4
    fs.invalidate_cache()
    assert sorted(fs.find("cache/c1")) == theirs


# ---- Dask, the processor, the CLI --------------------------------------------------------------------
@pytest.mark.slow
def test_dask_workers_share_a_cache_on_disk(tiny_llama, tmp_path):
    """Two worker processes fill one cache folder; a rerun over half new rows sends only
    those to the engines, whichever worker runs which partition."""
    cache = str(tmp_path / "cache")
    with local_client(workers=2) as client:
        ddf = dd.from_pandas(frame(range(8)), npartitions=4)
        first = generate(ddf, tiny_llama, cache).compute()
        assert not first["from_cache"].any() and len(entries(tmp_path / "cache")) == 8
        before = sum(client.run(engine_requests).values())
        second = generate(dd.from_pandas(frame(range(4, 12)), npartitions=4), tiny_llama, cache).compute()
        assert sum(client.run(engine_requests).values()) - before == 4
        assert second.set_index("id")["from_cache"].to_dict() == {i: i < 8 for i in range(4, 12)}
        hits = sum(c["hits"] for c in client.run(rc.counts).values())
        assert hits == 4
    pd.testing.assert_frame_equal(second.set_index("id").loc[4:7, OUTPUTS], first.set_index("id").loc[4:7, OUTPUTS])


def test_processor_uses_the_cache(tiny_llama, tmp_path):
    config = dfllm.ProcessorConfig(model_source=str(tiny_llama), engine_kwargs=ENGINE, cache=str(tmp_path / "c"))
    proc = dfllm.build_processor(
        config,
        lambda row: {"prompt": row["q"], "sampling_params": SP},
        lambda row: {"id": row["id"], "text": row["generated_text"]},
    )
    a = proc(frame(range(4)))
    before = engine_requests()
    b = dfllm.build_processor(
        dfllm.ProcessorConfig(model_source=str(tiny_llama), engine_kwargs=ENGINE),
        proc.preprocess,
        proc.postprocess,
        cache=str(tmp_path / "c"),
    )(frame(range(4)))
    assert engine_requests() == before
    pd.testing.assert_frame_equal(a, b)
    with pytest.raises(ValueError, match="cache: the response cache is for task_type='generate'"):
        dfllm.ProcessorConfig(task_type="embed", cache=str(tmp_path / "c"))


@pytest.mark.slow
def test_cli_cache_answers_a_rerun_and_says_so(cli_cluster, tiny_llama, tmp_path):
    frame(range(6)).to_parquet(tmp_path / "a.parquet")
    frame(range(3, 9)).to_parquet(tmp_path / "b.parquet")

    def run(src: str, out: str) -> str:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "dfllm.jobs.cli",
                "run",
                str(tmp_path / src),
                str(tmp_path / out),
                "--prompt",
                "{q}",
                "--model",
                str(tiny_llama),
                "--max-tokens",
                "3",
                "--max-model-len",
                "64",
                "--npartitions",
                "2",
                "--cache",
                str(tmp_path / "cache"),
                "--cache-max-bytes",
                "10M",
                "--scheduler",
                cli_cluster.address,
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    assert "cache:       0 rows answered from the response cache, 6 missed (6 stored)" in run("a.parquet", "oa")
    assert "cache:       3 rows answered from the response cache, 3 missed (3 stored)" in run("b.parquet", "ob")
    a, b = (pd.read_parquet(tmp_path / o).set_index("id").sort_index() for o in ("oa", "ob"))
    assert a.loc[3:5, "generated_text"].tolist() == b.loc[3:5, "generated_text"].tolist()


# ---- call-time checks and the resume key ---------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cache": {"url": "x", "max_bytes": 0}}, "cache: max_bytes must be a positive integer, got 0"),
        ({"cache": {"path": "x"}}, "cache: a dict takes 'url'"),
        ({"cache": 3}, "cache must be a path or URL"),
        ({"cache": "nosuchprotocol://bucket/x"}, "cache: cannot open 'nosuchprotocol://bucket/x'"),
    ],
)
def test_bad_cache_arguments_raise_at_call_time(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        frame(range(1)).llm.generate("{q}", model=str(tiny_llama), **kwargs)


def test_pooling_tasks_take_no_cache(tmp_path):
    with pytest.raises(ValueError, match="embed takes no cache"):
        make_task("embed", ("q",), ["q"], output_column="e", cache=str(tmp_path), model_check=lambda t: None)


@pytest.mark.slow
def test_the_cache_is_not_part_of_a_resumed_writes_key(tmp_path):
    """The cache decides no output: a resumed write may add, move or drop it."""
    task = lambda cache: make_task(  # noqa: E731
        "generate",
        ("q",),
        ["q"],
        output_column="g",
        cache=cache,
        model_check=lambda t: None,
    )
    keys = {PartitionFunction(task(c)).write_key for c in (None, str(tmp_path / "a"), str(tmp_path / "b"))}
    assert len(keys) == 1
