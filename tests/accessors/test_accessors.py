"""The .llm accessors on pandas, Dask (a real LocalCluster with worker processes) and Polars."""

from __future__ import annotations

import dask.dataframe as dd
import pandas as pd
import polars as pl
import pytest

import dfllm  # noqa: F401  (registers the accessors)
from dfllm import LLM, SamplingParams
from dfllm.worker import driver, engine_cache

from helpers import build_tiny_classifier, local_client

SP = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def kw(tiny_llama):
    return dict(model=str(tiny_llama), max_model_len=64, kv_cache_memory_bytes=2**22)


@pytest.fixture(scope="module")
def questions():
    return pd.DataFrame(
        {
            "id": range(8),
            "q": [
                "What is 2+2?",
                None,
                "Name a colour.",
                "",
                "   ",
                "Tell me about parquet files.",
                "x " * 200,
                "Why?",
            ],
            "topic": ["math", "none", "art", "none", "none", "data", "long", "why"],
        }
    )


def reference(kw, prompts):
    llm = LLM(kw["model"], max_model_len=kw["max_model_len"], kv_cache_memory_bytes=kw["kv_cache_memory_bytes"])
    return [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(**SP), use_tqdm=False)]


@pytest.mark.slow
def test_pandas_generate_with_per_row_errors(questions, kw):
    out = questions.llm.generate("Q: {q} ({topic})", sampling_params=SP, **kw)
    assert list(out.index) == list(questions.index) and list(out.columns[:3]) == ["id", "q", "topic"]
    assert out.dtypes["generated_text"] == pd.ArrowDtype(__import__("pyarrow").string())
    errors = out["llm_error"].tolist()
    assert [e is not pd.NA and e is not None for e in errors] == [False, True, False, True, True, False, True, False]
    assert "null" in errors[1] and "empty" in errors[3] and "longer than max_model_len=64" in errors[6]
    good = [0, 2, 5, 7]
    prompts = [f"Q: {questions.q[i]} ({questions.topic[i]})" for i in good]
    assert out.generated_text[good].tolist() == reference(kw, prompts)
    assert (out.num_generated_tokens[good] == 6).all() and out.finish_reason[good].eq("length").all()
    assert out.generated_text[[1, 3, 4, 6]].isna().all()


def test_call_time_errors(questions, kw):
    with pytest.raises(ValueError, match=r"column\(s\) \['nope'\] not in the dataframe"):
        questions.llm.generate("nope", **kw)
    with pytest.raises(ValueError, match=r"\['missing'\]"):
        questions.llm.generate("Q: {missing}", **kw)
    with pytest.raises(ValueError, match="temperature"):
        questions.llm.generate("q", sampling_params={"temperature": -1}, **kw)
    with pytest.raises(ValueError, match="no-such-model"):
        questions.llm.generate("q", model="no-such-model")
    with pytest.raises(ValueError, match="on_error"):
        questions.llm.generate("q", on_error="ignore", **kw)
    with pytest.raises(ValueError, match="already exist"):
        questions.llm.generate("q", output_column="topic", **kw)


def test_on_error_raise(questions, kw):
    with pytest.raises(ValueError, match="null"):
        questions.llm.generate("q", sampling_params=SP, on_error="raise", **kw)


def test_per_row_sampling_params_column(kw):
    df = pd.DataFrame(
        {
            "q": ["a b c", "d e f", "g h"],
            "sp": [{"temperature": 0.0, "max_tokens": 2}, {"temperature": 0.0, "max_tokens": 5}, {"temperature": -3.0}],
        }
    )
    out = df.llm.generate("q", sampling_params="sp", **kw)
    assert out.num_generated_tokens.tolist()[:2] == [2, 5]
    assert "temperature" in out.llm_error[2]


def test_sampling_struct_column_from_parquet(kw, tmp_path):
    """Read back from parquet, a column of dicts is a struct with every field in every row;
    a null field is one that row did not set."""
    rows = [
        {"temperature": 0.0, "max_tokens": 2},
        {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True},
        {"max_tokens": 3, "temperature": 0.0, "stop": ["zzz"]},
    ]
    pd.DataFrame({"q": ["a b c", "d e f", "g h"], "sp": rows}).to_parquet(tmp_path / "in.parquet")
    back = pd.read_parquet(tmp_path / "in.parquet")
    assert back["sp"].iloc[0]["ignore_eos"] is None  # what parquet gives
    out = back.llm.generate("q", sampling_params="sp", **kw)
    assert out["llm_error"].isna().all()
    llm = LLM(kw["model"], max_model_len=64, kv_cache_memory_bytes=2**22)
    ref = llm.generate(["a b c", "d e f", "g h"], [SamplingParams(**r) for r in rows], use_tqdm=False)
    assert out["generated_text"].tolist() == [r.outputs[0].text for r in ref]


def test_chat_column_and_template(kw):
    df = pd.DataFrame(
        {
            "conv": [[{"role": "user", "content": "Hi"}], [{"role": "wizard", "content": "x"}], "not a conversation"],
            "q": ["Hi", "Hello", None],
        }
    )
    out = df.llm.chat("conv", sampling_params=SP, **kw)
    assert out.llm_error.isna().tolist() == [True, False, False]
    assert "role must be one of" in out.llm_error[1]
    templ = df.llm.chat("{q}", system="Be brief.", sampling_params=SP, **kw)
    assert templ.llm_error.isna().tolist() == [True, True, False]
    llm = LLM(kw["model"], max_model_len=64, kv_cache_memory_bytes=2**22)
    ref = llm.chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        SamplingParams(**SP),
        use_tqdm=False,
    )
    assert templ.generated_text[0] == ref[0].outputs[0].text


def test_embed_score_and_series(tmp_path):
    df = pd.DataFrame({"a": ["Paris is in France.", None, "Trains"], "b": ["The capital of France", "x", "Rails"]})
    emb = df.llm.embed("a")
    assert str(emb.dtypes["embedding"]) == "list<item: float>[pyarrow]"
    llm = LLM("all-minilm-l6-v2")
    assert emb.embedding[0] == pytest.approx(
        llm.embed(["Paris is in France."], use_tqdm=False)[0].outputs.embedding, abs=1e-6
    )
    assert emb.embedding.isna().tolist() == [False, True, False]
    scored = df.llm.score("a", "b")
    assert scored.score[0] == pytest.approx(
        llm.score("Paris is in France.", "The capital of France", use_tqdm=False)[0].outputs.score, abs=1e-5
    )
    assert pd.isna(scored.score[1]) and "null" in scored.llm_error[1]
    series = df["b"].llm.embed()
    assert series.name == "b" and len(series[0]) == 384
    with pytest.raises(ValueError, match="needs a classifier"):
        df.llm.classify("a")


def test_polars_frames_and_expressions(kw):
    df = pl.DataFrame({"q": ["Hi there", None, "Tell me more"]})
    out = df.llm.generate("q", sampling_params=SP, **kw)
    assert out.schema["generated_text"] == pl.String and out.schema["num_generated_tokens"] == pl.Int64
    assert out["llm_error"].is_null().to_list() == [True, False, True]
    lazy = df.lazy().llm.generate("q", sampling_params=SP, **kw)
    assert isinstance(lazy, pl.LazyFrame) and lazy.collect().equals(out)
    expr = df.with_columns(pl.col("q").llm.generate(sampling_params=SP, **kw).alias("answer"))
    assert expr["answer"].to_list() == out["generated_text"].to_list()
    emb = df.with_columns(pl.col("q").llm.embed().alias("e"))
    assert emb.schema["e"] == pl.List(pl.Float32)


# ---- Dask on a real cluster of worker processes ------------------------------------------------------
@pytest.fixture(scope="module")
def client():
    with local_client(workers=2, threads=1) as c:
        yield c


@pytest.mark.slow
def test_dask_generate_on_a_cluster(client, questions, kw, tmp_path):
    ddf = dd.from_pandas(questions, npartitions=4)
    result = ddf.llm.generate("Q: {q} ({topic})", sampling_params=SP, **kw)
    assert "llm-generate" in result._name
    computed = result.compute()
    assert result._meta.dtypes.to_dict() == computed.dtypes.to_dict()
    expected = questions.llm.generate("Q: {q} ({topic})", sampling_params=SP, **kw)
    pd.testing.assert_frame_equal(
        computed[["generated_text", "llm_error"]].reset_index(drop=True),
        expected[["generated_text", "llm_error"]].reset_index(drop=True),
        check_dtype=False,
    )
    loads = client.run(engine_cache.load_count)
    steps = client.run(driver.partitions_per_step)
    ran = [w for w in loads if steps[w]]  # the workers that generated rows
    # 4 partitions on 2 workers: one ran two or more, and still built one engine
    assert ran and all(loads[w] == 1 for w in ran) and all(loads[w] == 0 for w in loads if w not in ran)
    result.to_parquet(tmp_path / "out")
    back = pd.read_parquet(tmp_path / "out")
    assert len(back) == len(questions) and set(back.columns) >= {"generated_text", "llm_error"}


@pytest.mark.slow
def test_worker_metrics_endpoint_lists_dfllm_metrics(client, questions, kw):
    import urllib.request

    dd.from_pandas(questions, npartitions=2).llm.generate("q", sampling_params=SP, **kw).compute()
    pages = []
    for addr, info in client.scheduler_info()["workers"].items():
        host = addr.split("://")[1].rsplit(":", 1)[0]
        port = info["services"]["dashboard"]
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
            pages.append(response.read().decode())
    served = [p for p in pages if "dfllm_generation_tokens_total" in p]
    assert served, "no worker served dfllm metrics"
    assert all("dask_worker_tasks" in p for p in pages)
    assert 'dfllm_prompt_tokens_total{model_name="' in served[0]


@pytest.mark.slow
def test_dask_embed_series(client):
    s = dd.from_pandas(pd.Series(["alpha", "beta", "gamma", None], name="t"), npartitions=2)
    out = s.llm.embed().compute()
    assert out.name == "t" and len(out.iloc[0]) == 384 and pd.isna(out.iloc[3])


@pytest.mark.slow
def test_release_engines_on_every_worker(client):
    """``client.run(dfllm.release_engines)`` drops every worker's idle engines; the next
    computation loads them again."""
    s = dd.from_pandas(pd.Series(["alpha", "beta", "gamma", "delta"], name="t"), npartitions=2)
    s.llm.embed().compute()
    assert sum(client.run(dfllm.release_engines).values()) >= 1
    assert set(client.run(lambda: len(engine_cache.engines())).values()) == {0}
    loads = sum(client.run(engine_cache.load_count).values())
    assert s.llm.embed().compute().notna().all()
    assert sum(client.run(engine_cache.load_count).values()) > loads


def test_concurrent_partitions_share_batches(kw):
    """Two threads' partitions through one shared engine share its steps (the driver is held
    until both have handed over their rows, so they start in the same step, and its record
    shows steps serving both), give the serial results, and every generated token is
    counted once."""
    import threading
    import time

    from dfllm.worker.driver import driver, partitions_per_step
    from dfllm.worker.engine_cache import get_engine

    frames = [pd.DataFrame({"q": [f"question {i} {j}" for j in range(4)]}) for i in range(2)]
    serial = [f.llm.generate("q", sampling_params=SP, **kw) for f in frames]
    llm = get_engine(kw["model"], {k: v for k, v in kw.items() if k != "model"})
    steps_before = llm.get_metrics()
    recorded = len(partitions_per_step())
    results = [None, None]

    holding_now = threading.Event()

    def hold():  # runs on the driver thread: no step until both partitions are queued
        holding_now.set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and driver().waiting(llm.engine) < 2:
            time.sleep(0.005)

    holding = threading.Thread(target=lambda: driver().call(hold))
    holding.start()
    assert holding_now.wait(30)

    def work(i):
        results[i] = frames[i].llm.generate("q", sampling_params=SP, **kw)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads + [holding]:
        t.join()
    for got, want in zip(results, serial):
        assert got.generated_text.tolist() == want.generated_text.tolist()
    shared = partitions_per_step()[recorded:]
    assert len(shared) == 6 and shared.count(2) == 6  # both partitions in every step (4 rows x 6 tokens each)
    tokens = next(m for m in llm.get_metrics() if m.name == "dfllm_generation_tokens").value
    assert tokens - next(m for m in steps_before if m.name == "dfllm_generation_tokens").value == 8 * 6


@pytest.mark.slow
def test_write_parquet_resumes_only_missing_partitions(client, questions, kw, tmp_path):

    ddf = dd.from_pandas(questions, npartitions=4)
    result = ddf.llm.generate("Q: {q}", sampling_params=SP, **kw)
    path = str(tmp_path / "answers")
    first = dfllm.write_parquet(result, path, progress=False)
    assert (first.partitions, first.written, first.skipped, first.rows) == (4, 4, 0, 8)
    assert first.errors == 4  # the null, empty, blank and too-long questions
    parts = sorted((tmp_path / "answers").glob("part.*.parquet"))
    mtimes = {p.name: p.stat().st_mtime_ns for p in parts}
    parts[2].unlink()  # a partition lost in a crash
    (tmp_path / "answers" / "_dfllm_keys" / "part.00001.key").unlink()  # a partition whose key was never written
    again = dfllm.write_parquet(ddf.llm.generate("Q: {q}", sampling_params=SP, **kw), path, resume=True, progress=False)
    assert (again.written, again.skipped) == (2, 2)
    for p in parts:
        if p.name not in ("part.00002.parquet", "part.00001.parquet"):
            assert p.stat().st_mtime_ns == mtimes[p.name]
    back = pd.read_parquet(path)
    assert sorted(back["id"].tolist()) == list(range(8))  # every row exactly once
    assert not list((tmp_path / "answers").rglob(".tmp-*"))
    changed = dfllm.write_parquet(
        ddf.llm.generate("Q: {q}", sampling_params={**SP, "max_tokens": 3}, **kw), path, resume=True, progress=False
    )
    assert changed.written == 4  # a changed sampling config recomputes everything
    with pytest.raises(ValueError, match="direct result"):
        dfllm.write_parquet(result[["id"]], path)


@pytest.mark.slow
def test_build_processor_like_ray_data_llm(client, kw):
    """The Ray Data LLM example on Dask: preprocess -> engine -> postprocess, columns carried."""
    import dfllm

    config = dfllm.ProcessorConfig(
        model_source=kw["model"],
        engine_kwargs={"max_model_len": 64, "kv_cache_memory_bytes": 2**22},
        batch_size=2,
        concurrency=1,
    )

    def preprocess(row):
        if row["id"] == 3:
            raise KeyError("no topic")
        return dict(
            messages=[{"role": "system", "content": "You complete haikus."}, {"role": "user", "content": row["item"]}],
            sampling_params=dict(temperature=0.0, max_tokens=5, ignore_eos=True),
        )

    def postprocess(row):
        return dict(id=row["id"], resp=row["generated_text"], n=row["num_generated_tokens"])

    items = pd.DataFrame({"id": range(6), "item": [f"first line number {i}" for i in range(6)]})
    processor = dfllm.build_processor(config, preprocess=preprocess, postprocess=postprocess)
    lazy = processor(dd.from_pandas(items, npartitions=2))
    # postprocess's columns, the input column it drops (held on error rows), llm_error
    assert list(lazy.columns) == ["id", "resp", "n", "item", "llm_error"]
    out = lazy.compute().sort_values("id")
    llm = LLM(kw["model"], max_model_len=64, kv_cache_memory_bytes=2**22)
    ok = [i for i in range(6) if i != 3]
    ref = llm.chat(
        [
            [
                {"role": "system", "content": "You complete haikus."},
                {"role": "user", "content": f"first line number {i}"},
            ]
            for i in ok
        ],
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )
    assert out.set_index("id").loc[ok, "resp"].tolist() == [r.outputs[0].text for r in ref]
    assert out.set_index("id").loc[ok, "n"].tolist() == [5] * 5
    failed = out.set_index("id").loc[3]
    assert "preprocess: KeyError" in failed["llm_error"] and pd.isna(failed["resp"])
    assert failed["item"] == "first line number 3"  # an error row keeps its input values
    assert out.set_index("id").loc[ok, "llm_error"].isna().all() and out.set_index("id").loc[ok, "item"].isna().all()
    with pytest.raises(ValueError, match="task_type"):
        dfllm.ProcessorConfig(task_type="translate")


def test_pandas_generation_shows_progress_over_rows(kw, capsys):
    df = pd.DataFrame({"q": [f"question {i}" for i in range(12)]})
    out = df.llm.generate("{q}", sampling_params=SP, **kw)
    assert out["llm_error"].isna().all()
    err = capsys.readouterr().err
    assert "llm rows" in err and "12/12" in err


def test_custom_chat_template_in_accessor_and_processor(kw):
    import dfllm

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    convs = [[{"role": "user", "content": f"Say {w}."}] for w in ("hi", "bye")]
    llm = LLM(kw["model"], max_model_len=64, kv_cache_memory_bytes=2**22)
    ref = llm.chat(convs, SamplingParams(**SP), chat_template=template, use_tqdm=False)
    default = llm.chat(convs, SamplingParams(**SP), use_tqdm=False)
    assert [len(r.prompt_token_ids) for r in ref] != [len(r.prompt_token_ids) for r in default]

    df = pd.DataFrame({"conv": convs})
    out = df.llm.chat("conv", chat_template=template, sampling_params=SP, **kw)
    assert out["num_input_tokens"].tolist() == [len(r.prompt_token_ids) for r in ref]
    assert out["generated_text"].tolist() == [r.outputs[0].text for r in ref]

    config = dfllm.ProcessorConfig(
        model_source=kw["model"],
        chat_template=template,
        engine_kwargs={"max_model_len": 64, "kv_cache_memory_bytes": 2**22},
    )
    processor = dfllm.build_processor(config, preprocess=lambda row: dict(messages=row["conv"], sampling_params=SP))
    got = processor(df)
    assert got["generated_text"].tolist() == [r.outputs[0].text for r in ref]
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['chat_template'\]"):
        df.llm.generate("conv", chat_template=template, **kw)  # refused at call time, not by LLM(...)


def test_conversations_stored_as_text(kw):
    """JSON text (CSV inputs) and the strings Dask's convert-string makes of a column of lists
    are read back as conversations, and give the same replies as the lists themselves."""
    convs = [[{"role": "user", "content": "Say hi."}], [{"role": "user", "content": "It's 'quoted' \"text\"."}]]
    ref = pd.DataFrame({"c": convs}).llm.chat("c", sampling_params=SP, **kw)["generated_text"].tolist()
    import json

    as_json = pd.DataFrame({"c": [json.dumps(c) for c in convs]}).llm.chat("c", sampling_params=SP, **kw)
    assert as_json["generated_text"].tolist() == ref and as_json["llm_error"].isna().all()
    converted = dd.from_pandas(pd.DataFrame({"c": convs}), npartitions=1)  # convert-string: lists -> strings
    assert str(converted["c"].dtype) == "string"
    got = converted.llm.chat("c", sampling_params=SP, **kw).compute(scheduler="sync")
    assert got["generated_text"].tolist() == ref and got["llm_error"].isna().all()


def test_nested_arrow_columns_read_back_from_dask_to_parquet(tmp_path):
    """pandas records nested Arrow dtypes in parquet metadata under names its own reader did
    not parse; with dfllm imported, Dask's own to_parquet output reads back typed."""
    import numpy as np
    import pyarrow as pa

    from dfllm.accessors.arrow_dtypes import parse_arrow_type

    for t in [
        pa.list_(pa.float32()),
        pa.large_list(pa.string()),
        pa.list_(pa.timestamp("ns")),
        pa.struct(
            [
                ("name", pa.string()),
                ("n", pa.int64()),
                ("tags", pa.list_(pa.string())),
                ("inner", pa.struct([pa.field("x", pa.bool_(), nullable=False)])),
            ]
        ),
    ]:
        assert parse_arrow_type(str(t)) == t
    with pytest.raises(TypeError):
        pd.api.types.pandas_dtype("list<item: nonsense>[pyarrow]")

    texts = pd.DataFrame({"t": ["a cat", "a dog", None]})
    dd.from_pandas(texts, npartitions=2).llm.embed("t").to_parquet(tmp_path / "emb")
    for frame in (pd.read_parquet(tmp_path / "emb"), dd.read_parquet(tmp_path / "emb").compute()):
        assert str(frame["embedding"].dtype) == "list<item: float>[pyarrow]"
        ref = texts.llm.embed("t")["embedding"]
        np.testing.assert_allclose(np.array(frame["embedding"].iloc[0]), np.array(ref.iloc[0]), atol=1e-6)
        assert frame["embedding"].isna().tolist() == [False, False, True]


# ---- the task registry, the engines' lifecycle, write_parquet's origin -----------------------------------------
@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny random BERT sequence classifier (3 labels) with MiniLM's tokenizer."""
    return build_tiny_classifier(tmp_path_factory.mktemp("models"))


def test_registry_drives_the_output_columns(kw, classifier):
    """Every kind of KINDS adds exactly its registered columns, with their dtypes and
    ``llm_error`` last: on real rows, on an empty frame (no model runs) and in Dask's meta."""
    from dfllm.tasks.kinds import KINDS

    df = pd.DataFrame({"t": ["Paris is in France.", None], "u": ["The capital of France", "x"]})
    options = {
        "generate": dict(sampling_params=SP, **kw),
        "chat": dict(sampling_params=SP, **kw),
        "classify": {"model": str(classifier)},
    }
    inputs = {"chat": ("{t}",), "score": ("t", "u")}
    assert list(KINDS) == ["generate", "chat", "embed", "score", "classify"]
    for name, spec in KINDS.items():
        want = spec.output_dtypes(spec.output_column)
        assert list(want)[0] == spec.output_column and list(want)[-1] == "llm_error"

        def call(frame, name=name):  # bound now (called only in this iteration)
            return getattr(frame.llm, name)(*inputs.get(name, ("t",)), **options.get(name, {}))

        for frame in (df, df.iloc[:0]):
            out = call(frame)
            assert list(out.columns) == ["t", "u", *want], name
            assert out.dtypes[list(want)].to_dict() == want, name
        assert out[spec.output_column].isna().all()
        real = call(df)
        assert real[spec.output_column].notna().tolist() == [True, False] and "null" in real.llm_error[1], name
        assert call(dd.from_pandas(df, npartitions=1))._meta.dtypes[list(want)].to_dict() == want, name


@pytest.mark.slow
def test_release_engines_drops_only_idle_engines():
    """``dfllm.release_engines()`` shuts down and forgets every idle engine of the process
    (a later call loads its engine again) and leaves an engine that a running task holds."""
    from dfllm.tasks.kinds import DEFAULT_EMBED_MODEL

    frame = pd.DataFrame({"t": ["alpha", "beta"]})
    want = frame.llm.embed("t").embedding.tolist()
    assert dfllm.release_engines() >= 1 and engine_cache.engines() == []
    loads = engine_cache.load_count()
    assert frame.llm.embed("t").embedding.tolist() == want
    assert engine_cache.load_count() == loads + 1
    with engine_cache.lease(DEFAULT_EMBED_MODEL, {}) as running:  # as a task holds it
        assert dfllm.release_engines() == 0 and engine_cache.engines() == [running.llm]
    assert dfllm.release_engines() == 1 and engine_cache.engines() == []


@pytest.mark.slow
def test_released_engine_leaves_the_metrics_registry_and_memory(kw):
    """A generative engine's ``dfllm_`` metrics are served by the process's default registry
    while the process holds it; once released they are not, and nothing keeps the engine."""
    import gc
    import weakref

    import prometheus_client

    def served() -> set[str]:  # the engine's metrics (the response cache's are the process's own)
        return {
            m.name
            for m in prometheus_client.REGISTRY.collect()
            if m.samples and m.name.startswith("dfllm_") and not m.name.startswith("dfllm_response_cache_")
        }

    dfllm.release_engines()
    assert not served()
    pd.DataFrame({"q": ["Hi there"]}).llm.generate("q", sampling_params=SP, **kw)
    assert "dfllm_generation_tokens" in served()
    engine = weakref.ref(engine_cache.engines()[0].engine)
    assert dfllm.release_engines() == 1 and not served()
    gc.collect()
    assert engine() is None


@pytest.mark.slow
def test_engine_bound_drops_the_least_recently_used_idle_engine(monkeypatch, caplog):
    """At most ``DFLLM_MAX_ENGINES`` engine configurations per process: a new one first drops
    the least recently used idle engine; one in use is never dropped (the bound is then
    exceeded, with a warning)."""
    from dfllm.tasks.kinds import DEFAULT_EMBED_MODEL

    frame = pd.DataFrame({"t": ["alpha", "beta"]})

    def held() -> list[int]:  # least recently used first
        return [llm.config.max_model_len for llm in engine_cache.engines()]

    monkeypatch.setenv("DFLLM_MAX_ENGINES", "2")
    dfllm.release_engines()
    loads = engine_cache.load_count()
    for n in (64, 128, 64):
        frame.llm.embed("t", max_model_len=n)
    assert held() == [128, 64] and engine_cache.load_count() == loads + 2
    frame.llm.embed("t", max_model_len=96)  # a third configuration: 128 was used least recently
    assert held() == [64, 96] and engine_cache.load_count() == loads + 3

    monkeypatch.setenv("DFLLM_MAX_ENGINES", "1")
    with engine_cache.lease(DEFAULT_EMBED_MODEL, {"max_model_len": 96}), caplog.at_level("WARNING", logger="dfllm"):
        frame.llm.embed("t", max_model_len=32)  # 64 is idle and goes; 96 is in use and stays
        assert held() == [96, 32] and "DFLLM_MAX_ENGINES=1" in caplog.text
    frame.llm.embed("t", max_model_len=64)
    assert held() == [64] and engine_cache.load_count() == loads + 5

    monkeypatch.setenv("DFLLM_MAX_ENGINES", "0")
    with pytest.raises(ValueError, match="DFLLM_MAX_ENGINES must be a positive integer, got '0'"):
        frame.llm.embed("t", max_model_len=48)
    dfllm.release_engines()


def test_prometheus_unexpose():
    from prometheus_client import REGISTRY, CollectorRegistry, Counter

    from dfllm.worker.prometheus import expose, unexpose

    registry = CollectorRegistry()
    Counter("dfllm_test_unexposed", "a test counter", registry=registry).inc()
    expose(registry)
    assert "dfllm_test_unexposed" in {m.name for m in REGISTRY.collect()}
    unexpose(registry)
    assert "dfllm_test_unexposed" not in {m.name for m in REGISTRY.collect()}


@pytest.mark.slow
def test_write_parquet_finds_the_source_and_task_in_the_result(tmp_path):
    """``write_parquet`` reads the source frame and the task from the result's own expression:
    no module global keeps the source frame alive, and a frame derived from the result (or
    not from ``.llm`` at all) is refused."""
    import gc
    import weakref

    df = pd.DataFrame({"id": range(4), "t": ["alpha", "beta", None, "delta"]})
    ddf = dd.from_pandas(df, npartitions=2)
    result = ddf.llm.embed("t")
    source = weakref.ref(ddf)
    del ddf
    gc.collect()
    assert source() is None
    summary = dfllm.write_parquet(result, str(tmp_path / "out"), progress=False)
    assert (summary.partitions, summary.written, summary.rows, summary.errors) == (2, 2, 4, 1)
    back = pd.read_parquet(tmp_path / "out").sort_values("id")
    assert back["id"].tolist() == [0, 1, 2, 3] and back["embedding"].isna().tolist() == [False, False, True, False]
    again = dfllm.write_parquet(result, str(tmp_path / "out"), resume=True, progress=False)
    assert (again.written, again.skipped) == (0, 2)
    series = dd.from_pandas(df, npartitions=2)["t"].llm.embed()
    for derived in (result[["id", "embedding"]], result.assign(x=1), result["embedding"], series, df):
        with pytest.raises(ValueError, match="direct result of a Dask .llm call"):
            dfllm.write_parquet(derived, str(tmp_path / "other"))
    assert not (tmp_path / "other").exists()
