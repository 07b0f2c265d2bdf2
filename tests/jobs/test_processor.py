"""``build_processor`` on pandas and on a real Dask cluster of worker processes: the output
schema comes from real rows (or ``meta=``), nothing is dropped silently, and failed rows
keep their input columns."""

from __future__ import annotations

import dask.dataframe as dd
import pandas as pd
import pyarrow as pa
import pytest

import dfllm
from dfllm.worker import engine_cache

SP = dict(temperature=0.0, max_tokens=3, ignore_eos=True)
ENGINE = {"max_model_len": 64, "kv_cache_memory_bytes": 2**22}


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=None) as cluster:
        with Client(cluster) as c:
            yield c


@pytest.fixture(scope="module")
def config(tiny_llama):
    return dfllm.ProcessorConfig(model_source=str(tiny_llama), engine_kwargs=ENGINE, batch_size=4)


@pytest.fixture(scope="module")
def haikus():
    return pd.DataFrame({"id": range(8), "item": [f"haiku #{i}" for i in range(8)]})


def prompt(row):
    return dict(prompt=row["item"], sampling_params=SP)


def split_hash(row):
    return dict(id=row["id"], n=int(row["item"].split("#")[1]), text=row["generated_text"])


def in_order(df: pd.DataFrame) -> pd.DataFrame:
    """Rows in the input's order (the output keeps the input's index)."""
    return df.sort_index()


@pytest.mark.slow
def test_schema_from_real_rows_dask_equals_pandas(client, config, haikus):
    """A postprocess that cannot run on Dask's stand-in row ("foo" has no "#") still gives
    every real column, typed, on Dask as on pandas."""
    processor = dfllm.build_processor(config, preprocess=prompt, postprocess=split_hash)
    loaded_here = engine_cache.load_count()
    lazy = processor(dd.from_pandas(haikus, npartitions=3))
    assert list(lazy.columns) == ["id", "n", "text", "item", "llm_error"]
    # the first rows ran at the call, on the cluster's worker, not in this process
    assert engine_cache.load_count() == loaded_here and list(client.run(engine_cache.load_count).values()) == [1]
    got = lazy.compute()
    assert got["n"].tolist() == list(range(8)) and got["llm_error"].isna().all() and got["text"].notna().all()
    expected = processor(haikus)
    assert got["item"].isna().all()  # an input column postprocess does not return: null on success
    assert lazy._meta.dtypes.to_dict() == got.dtypes.to_dict() == expected.dtypes.to_dict()
    assert got.dtypes["n"] == pd.ArrowDtype(pa.int64())
    pd.testing.assert_frame_equal(in_order(got), in_order(expected))


@pytest.mark.slow
def test_postprocess_failure_keeps_the_rows_identity(client, config, haikus):
    def post(row):
        if row["id"] == 5:
            raise ZeroDivisionError("bad row")
        return dict(id=row["id"], text=row["generated_text"])

    processor = dfllm.build_processor(config, preprocess=prompt, postprocess=post)
    for out in (processor(haikus), processor(dd.from_pandas(haikus, npartitions=3)).compute()):
        failed = in_order(out).loc[5]
        assert failed["id"] == 5 and failed["item"] == "haiku #5" and pd.isna(failed["text"])
        assert failed["llm_error"] == "postprocess: ZeroDivisionError: bad row"
        assert list(out.columns) == ["id", "text", "item", "llm_error"]
        ok = out.set_index("id").drop(index=5)
        assert ok["text"].notna().all() and ok["llm_error"].isna().all() and ok["item"].isna().all()


@pytest.mark.slow
def test_preprocess_and_inference_failures_bypass_postprocess(client, config, haikus, tmp_path):
    """A row failing in preprocess, or in the engine (a prompt past max_model_len), keeps its
    input values and error, and postprocess is never called for it."""
    items = haikus.assign(item=[("x " * 200) if i == 6 else t for i, t in enumerate(haikus["item"])])
    log = tmp_path / "calls.txt"

    def pre(row):
        if row["id"] == 2:
            raise KeyError("no topic")
        return prompt(row)

    def post(row):
        with open(log, "a") as f:  # worker processes too
            f.write(f"{row['id']}\n")
        return dict(key=row["id"], text=row["generated_text"], tokens=row["num_generated_tokens"])

    processor = dfllm.build_processor(config, preprocess=pre, postprocess=post)
    for run in (lambda: processor(items), lambda: processor(dd.from_pandas(items, npartitions=2)).compute()):
        log.write_text("")
        out = in_order(run())
        calls = [int(line) for line in log.read_text().split()]
        assert set(calls) == {0, 1, 3, 4, 5, 7}  # never for rows 2 and 6 (on Dask, sampled rows twice)
        errors = out["llm_error"].tolist()
        assert errors[2] == "preprocess: KeyError: 'no topic'"
        assert "longer than max_model_len=64" in errors[6]
        failed = out.iloc[[2, 6]]
        assert failed["id"].tolist() == [2, 6] and failed["item"].tolist() == items["item"].iloc[[2, 6]].tolist()
        assert failed[["key", "text", "tokens"]].isna().all().all()
        assert list(out.columns) == ["key", "text", "tokens", "id", "item", "llm_error"]
        assert [e is pd.NA for e in errors] == [i not in (2, 6) for i in range(8)]
        ok = out.drop(index=[2, 6])
        assert ok["key"].tolist() == [0, 1, 3, 4, 5, 7] and (ok["tokens"] == 3).all()
        assert ok[["id", "item"]].isna().all().all()
    assert len(calls) == 6 + 3  # the Dask run: 6 rows, and the 3 successful rows of the sample


@pytest.mark.slow
def test_a_failed_rows_input_values_take_the_output_types_by_arrows_safe_casts(client, config, haikus, tmp_path):
    """postprocess returns ``id=str(row["id"])``: a row failing in preprocess keeps its input
    id as that column's text ("7", not a null), in the returned frame and in the written
    parquet, so it can be found and retried; an input value no safe cast converts (the text
    "haiku #7" in the integer column postprocess makes of ``item``) is null, and the row's
    error names the column and shows the value."""

    def pre(row):
        if row["id"] == 7:
            raise KeyError("no topic")
        return prompt(row)

    def post(row):
        return dict(id=str(row["id"]), item=len(row["item"]), text=row["generated_text"])

    processor = dfllm.build_processor(config, preprocess=pre, postprocess=post)
    lazy = processor(dd.from_pandas(haikus, npartitions=2))  # sampled: rows 0-3, all fine
    lazy.to_parquet(tmp_path / "out")
    written = in_order(dd.read_parquet(tmp_path / "out").compute())
    summary = dfllm.write_parquet(lazy, str(tmp_path / "resumable"), resume=True, progress=False)
    assert summary.errors == 1
    resumable = in_order(pd.read_parquet(tmp_path / "resumable"))
    for out in (processor(haikus), in_order(lazy.compute()), written, resumable):
        assert list(out.columns) == ["id", "item", "text", "llm_error"]
        assert out["id"].tolist() == [str(i) for i in range(8)]
        assert out["item"].iloc[:7].tolist() == [len(f"haiku #{i}") for i in range(7)]
        error = out.loc[7, "llm_error"]
        assert error.startswith("preprocess: KeyError: 'no topic'; column 'item': the input value 'haiku #7' (str)")
        assert pd.isna(out.loc[7, "item"]) and pd.isna(out.loc[7, "text"])
        assert out["llm_error"].iloc[:7].isna().all()
    assert lazy.dtypes["id"] == pd.ArrowDtype(pa.string()) and lazy.dtypes["item"] == pd.ArrowDtype(pa.int64())


def test_model_sources_name_the_model_the_engine_loads(config):
    """What a resumable write keys on besides the write key: the config's model, else the
    task's default model (the writer's None is the default chat model)."""
    from dfllm.jobs.processor import ProcessorFunction

    def sources(cfg):
        return ProcessorFunction(dfllm.build_processor(cfg), {}).model_sources()

    assert sources(config) == (config.model_source,)
    assert sources(dfllm.ProcessorConfig(task_type="embed")) == ("all-minilm-l6-v2",)
    assert sources(dfllm.vLLMEngineProcessorConfig(task_type="score")) == ("all-minilm-l6-v2",)
    assert sources(dfllm.ProcessorConfig()) == (None,)


@pytest.mark.slow
def test_explicit_meta_runs_nothing_and_flags_what_does_not_fit(client, config, haikus):
    """With meta= nothing runs at call time (the first rows fail postprocess, which would
    stop the sampling); values that do not fit, and columns meta lacks, are row errors
    naming the column."""

    def post(row):
        if row["id"] < 3:
            raise ValueError("early rows fail")
        out = dict(
            id=row["id"],
            n=2.5 if row["id"] == 4 else row["id"],
            text=row["generated_text"],
            d={"a": 1, "b": 2} if row["id"] == 5 else {"a": 1},
        )
        if row["id"] == 6:
            out["surprise"] = 1
        return out

    metas = [
        {"id": "int64", "n": pa.int64(), "text": pd.ArrowDtype(pa.string()), "d": pa.struct([("a", pa.int64())])},
        pa.schema(
            [("id", pa.int64()), ("n", pa.int64()), ("text", pa.string()), ("d", pa.struct([("a", pa.int64())]))]
        ),
    ]
    ddf = dd.from_pandas(haikus, npartitions=2)
    with pytest.raises(ValueError, match="none of the 3 sampled rows.*row 0.*early rows fail.*meta="):
        dfllm.build_processor(config, preprocess=prompt, postprocess=post, sample_rows=3)(ddf)
    for meta in metas:
        processor = dfllm.build_processor(config, preprocess=prompt, postprocess=post, meta=meta)
        lazy = processor(ddf)
        expected_types = {
            "id": pa.int64(),
            "n": pa.int64(),
            "text": pa.string(),
            "d": pa.struct([("a", pa.int64())]),
            "item": pa.string(),
            "llm_error": pa.string(),
        }
        assert {c: t.pyarrow_dtype for c, t in lazy._meta.dtypes.items()} == expected_types
        for out in (in_order(lazy.compute()), processor(haikus)):
            assert {c: t.pyarrow_dtype for c, t in out.dtypes.items()} == expected_types
            errors = out["llm_error"].tolist()
            assert all(e.startswith("postprocess: ValueError: early rows fail") for e in errors[:3])
            assert "column 'n'" in errors[4] and "2.5" in errors[4]
            assert pd.isna(out.loc[4, "n"]) and out.loc[4, "text"] is not pd.NA and out.loc[4, "item"] == "haiku #4"
            assert "column 'd'" in errors[5] and out.loc[5, "n"] == 5
            assert "['surprise']" in errors[6] and out.loc[6, "n"] == 6 and out.loc[6, "item"] == "haiku #6"
            assert errors[3] is pd.NA and errors[7] is pd.NA and out.loc[7, "d"] == {"a": 1}
    # a processor built without meta takes one at call time
    processor = dfllm.build_processor(config, preprocess=prompt, postprocess=post)
    assert list(processor(ddf, meta=metas[1]).columns) == ["id", "n", "text", "d", "item", "llm_error"]


@pytest.mark.slow
def test_a_column_null_in_the_sample_is_a_string_and_later_values_are_not_dropped(client, config, haikus):
    def post(row):
        return dict(id=row["id"], note=None if row["id"] < 6 else 7, label="x" if row["id"] < 6 else 8)

    processor = dfllm.build_processor(config, preprocess=prompt, postprocess=post)
    out = in_order(processor(dd.from_pandas(haikus, npartitions=2)).compute())  # sampled: rows 0-3
    assert out.dtypes["note"] == pd.ArrowDtype(pa.string()) and out.dtypes["label"] == pd.ArrowDtype(pa.string())
    assert out["llm_error"].iloc[:6].isna().all()
    for i in (6, 7):
        assert "column 'note'" in out.loc[i, "llm_error"] and "column 'label'" in out.loc[i, "llm_error"]
        assert out.loc[i, "item"] == f"haiku #{i}" and out.loc[i, "id"] == i


@pytest.mark.slow
def test_all_sampled_rows_failing_is_a_call_time_error(client, config, haikus):
    processor = dfllm.build_processor(config, preprocess=lambda row: dict(prompt=row["missing"]))
    with pytest.raises(ValueError, match=r"none of the 4 sampled rows.*row 0.*KeyError: 'missing'.*pass meta="):
        processor(dd.from_pandas(haikus, npartitions=2))
    empty = dd.from_pandas(haikus.iloc[:0], npartitions=1)
    with pytest.raises(ValueError, match="no rows.*meta="):
        dfllm.build_processor(config, preprocess=prompt)(empty)
    # on pandas every row is there to see: the rows carry their errors
    out = processor(haikus)
    assert list(out.columns) == ["id", "item", "llm_error"] and out["id"].tolist() == list(range(8))
    assert out["llm_error"].str.contains("KeyError: 'missing'").all()


@pytest.mark.slow
def test_written_with_dask_to_parquet(client, config, haikus, tmp_path):
    items = haikus.assign(item=[("x " * 200) if i == 1 else t for i, t in enumerate(haikus["item"])])

    def post(row):
        return dict(
            id=row["id"],
            text=row["generated_text"],
            tokens=row["num_generated_tokens"],
            meta={"n": row["num_input_tokens"], "tags": ["a", "b"]},
        )

    processor = dfllm.build_processor(config, preprocess=prompt, postprocess=post)
    lazy = processor(dd.from_pandas(items, npartitions=3))
    lazy.to_parquet(tmp_path / "out")
    back = in_order(dd.read_parquet(tmp_path / "out").compute())
    expected = in_order(processor(items))
    pd.testing.assert_frame_equal(back, expected, check_dtype=False)  # Dask reads strings as its own
    assert {c: str(t) for c, t in back.dtypes.items() if t != "string"} == {
        c: str(t) for c, t in expected.dtypes.items() if t != pd.ArrowDtype(pa.string())
    }
    assert "max_model_len" in back.loc[1, "llm_error"] and back.loc[1, "item"] == items.loc[1, "item"]
    assert back.loc[0, "meta"]["tags"] == ["a", "b"] and back["tokens"].iloc[2:].eq(3).all()


def test_chat_messages_with_per_row_sampling_params(config):
    """preprocess's messages and per-row sampling_params; batch_size rows per engine call;
    no postprocess: the whole row."""
    df = pd.DataFrame({"id": range(5), "q": [f"Say {w}." for w in ("hi", "bye", "yes", "no", "ok")]})

    def pre(row):
        return dict(
            messages=[{"role": "user", "content": row["q"]}],
            sampling_params=dict(temperature=0.0, max_tokens=1 + row["id"], ignore_eos=True),
        )

    out = dfllm.build_processor(config, preprocess=pre)(df)
    assert out["num_generated_tokens"].tolist() == [1, 2, 3, 4, 5] and out["llm_error"].isna().all()
    assert list(out.columns[:4]) == ["id", "q", "messages", "sampling_params"]
    assert out.loc[0, "messages"][0]["content"] == "Say hi."
    llm = dfllm.LLM(config.model_source, **ENGINE)
    ref = llm.chat(
        [[{"role": "user", "content": "Say yes."}]],
        dfllm.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        use_tqdm=False,
    )
    assert out.loc[2, "generated_text"] == ref[0].outputs[0].text


@pytest.mark.slow
def test_pooling_task_types_on_pandas(tmp_path):
    from dfllm.models.bundled import resolve_model

    from helpers import tiny_bert

    docs = pd.DataFrame({"id": [1, 2], "doc": ["Paris is in France.", "Trains run on rails."]})
    embed = dfllm.build_processor(
        dfllm.ProcessorConfig(model_source="all-minilm-l6-v2", task_type="embed"),
        preprocess=lambda row: dict(prompt=row["doc"]),
        postprocess=lambda row: dict(id=row["id"], vec=row["embedding"]),
    )
    out = embed(docs)
    assert out.dtypes["vec"] == pd.ArrowDtype(pa.list_(pa.float32())) and len(out.loc[0, "vec"]) == 384
    score = dfllm.build_processor(
        dfllm.ProcessorConfig(model_source="all-minilm-l6-v2", task_type="score"),
        preprocess=lambda row: dict(text_1="Where is Paris?", text_2=row["doc"]),
    )
    scores = score(docs)["score"].tolist()
    assert scores[0] > scores[1]
    path, _ = tiny_bert(tmp_path, resolve_model("all-minilm-l6-v2"), 3)
    classify = dfllm.build_processor(
        dfllm.ProcessorConfig(model_source=str(path), task_type="classify"),
        preprocess=lambda row: dict(prompt=row["doc"]),
        postprocess=lambda row: dict(id=row["id"], label=row["label"], p=max(row["probs"])),
    )
    out = classify(docs)
    assert out["label"].str.startswith("label_").all() and out.dtypes["p"] == pd.ArrowDtype(pa.float32())


@pytest.mark.slow
def test_mixed_rows_with_logprobs_on_the_cluster_every_row_once(client, config, haikus):
    """One partition mixing messages, prompts, token ids and bad rows, asking for logprobs,
    on worker processes: each row is generated as its own kind (one engine call per kind),
    comes out exactly once, in order, and equal to the pandas run; the logprobs column (an
    Arrow map of token id -> fields) reaches parquet-ready types."""
    llm = dfllm.LLM(config.model_source, **ENGINE)
    ids = llm.get_tokenizer().encode("haiku #2")

    def pre(row):
        sp = dict(SP, logprobs=1)
        kind = row["id"] % 4
        if kind == 0:
            return dict(messages=[{"role": "user", "content": row["item"]}], sampling_params=sp)
        if kind == 1:
            return dict(prompt=row["item"], sampling_params=sp)
        if kind == 2:
            return dict(tokenized_prompt=ids, sampling_params=sp)
        return dict(tokenized_prompt=[-1], sampling_params=sp)  # a bad token id: this row's error

    processor = dfllm.build_processor(config, preprocess=pre)
    lazy = processor(dd.from_pandas(haikus, npartitions=2))
    got = lazy.compute()
    assert got["id"].tolist() == list(range(8))  # every row once, in order
    pd.testing.assert_frame_equal(got.drop(columns="time_taken_llm"), processor(haikus).drop(columns="time_taken_llm"))
    assert lazy.dtypes.to_dict() == got.dtypes.to_dict()
    kind = got["id"].to_numpy(dtype="int64") % 4
    assert got.loc[kind == 3, "llm_error"].str.contains("token").all()
    ok = got[kind != 3]
    assert ok["llm_error"].isna().all() and (ok["logprobs"].list.len() == ok["num_generated_tokens"]).all()
    assert got.loc[kind == 2, "prompt_token_ids"].map(list).tolist() == [ids, ids]
    table = pa.Table.from_pandas(got)
    assert pa.types.is_map(table.schema.field("logprobs").type.value_type)
