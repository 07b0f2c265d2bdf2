"""The data path a user relies on: templates over any scalar column, per-row sampling params
arriving as text, and placement that travels with the ``llm-*`` tasks on a real cluster
of ``dask worker`` processes (one declaring a GPU resource, one not)."""

from __future__ import annotations

import datetime
import decimal
import os
import shutil

import dask.dataframe as dd
import pandas as pd
import pytest

import dfllm  # noqa: F401  (registers the accessors)
from dfllm import LLM, SamplingParams
from dfllm.worker import engine_cache

from helpers import CLICluster

SP = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def kw(tiny_llama):
    return dict(model=str(tiny_llama), max_model_len=64, kv_cache_memory_bytes=2**22)


@pytest.fixture(scope="module")
def alone(kw):
    llm = LLM(kw["model"], max_model_len=64, kv_cache_memory_bytes=2**22)

    def run(prompt: str, **params) -> str:
        return llm.generate([prompt], SamplingParams(**{**SP, **params}), use_tqdm=False)[0].outputs[0].text

    return run


# ---- templates format every scalar as str.format does ------------------------------------------------
TEMPLATE = "Q{id}: {question} (price {price:.2f}, ok={ok}, on {day}, {amount}, {when:%H:%M})"


def scalar_frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "id": [1, 2, 3],
            "question": ["Why is the sky blue?", "Name a river.", "What is 2+2?"],
            "price": [3.14159, 2.0, None],  # the None becomes NaN: that row's error names the column
            "ok": [True, False, True],
            "day": [datetime.date(2026, 1, 31), datetime.date(2026, 2, 1), datetime.date(2026, 3, 1)],
            "amount": [decimal.Decimal("1.50"), decimal.Decimal("-2"), decimal.Decimal("0.001")],
            "when": pd.to_datetime(["2026-01-31 09:05", "2026-02-01 17:30", "2026-03-01 00:00"]),
        }
    )


def expected_prompts(df: pd.DataFrame) -> list[str | None]:
    return [None if pd.isna(r["price"]) else TEMPLATE.format_map(r) for r in df.to_dict("records")]


def check_template_result(out: pd.DataFrame, df: pd.DataFrame, kw, alone) -> None:
    prompts = expected_prompts(df)
    assert prompts[0] == "Q1: Why is the sky blue? (price 3.14, ok=True, on 2026-01-31, 1.50, 09:05)"
    tok = LLM(kw["model"], max_model_len=64, kv_cache_memory_bytes=2**22).get_tokenizer()
    for i, prompt in enumerate(prompts):
        if prompt is None:
            assert out["llm_error"].iloc[i] == "column 'price' is null" and pd.isna(out["generated_text"].iloc[i])
            continue
        assert pd.isna(out["llm_error"].iloc[i])
        assert out["num_input_tokens"].iloc[i] == len(tok(prompt)["input_ids"])
        assert out["generated_text"].iloc[i] == alone(prompt)


@pytest.mark.slow
def test_template_formats_scalars_like_str_format_pandas(kw, alone):
    df = scalar_frame()
    check_template_result(df.llm.generate(TEMPLATE, sampling_params=SP, **kw), df, kw, alone)


def test_template_formats_scalars_like_str_format_dask(kw, alone):
    df = scalar_frame()
    out = dd.from_pandas(df, npartitions=2).llm.generate(TEMPLATE, sampling_params=SP, **kw).compute()
    check_template_result(out, df, kw, alone)


def test_template_with_an_integer_id_column_is_not_all_errors(kw, alone):
    """The issue's reproduction: 'Q{id}: {question}' with an integer id made every row an error."""
    df = pd.DataFrame({"id": range(4), "question": [f"question {i}" for i in range(4)]})
    out = df.llm.generate("Q{id}: {question}", sampling_params=SP, **kw)
    assert out["llm_error"].isna().all()
    assert out["generated_text"].tolist() == [alone(f"Q{i}: question {i}") for i in range(4)]


# ---- per-row sampling params stored as text ------------------------------------------------------
def sampling_rows() -> tuple[pd.DataFrame, list[int]]:
    lengths = [2, 5, 3, 1]
    sp = [{"temperature": 0.0, "max_tokens": n, "ignore_eos": True} for n in lengths]
    df = pd.DataFrame({"q": [f"Tell me about number {i}." for i in range(4)], "sp": sp})
    return df, lengths


def test_sampling_params_survive_dask_convert_string(kw, alone):
    """dd.from_pandas turns a column of dicts into their Python literal strings (Dask's
    default convert-string); every row used to fail with 'must be a dict ... got str'."""
    df, lengths = sampling_rows()
    ddf = dd.from_pandas(df, npartitions=2)
    assert isinstance(ddf.partitions[0].compute()["sp"].iloc[0], str)  # the conversion this test is about
    out = ddf.llm.generate("q", sampling_params="sp", **kw).compute()
    assert out["llm_error"].isna().all(), out["llm_error"].tolist()
    assert out["num_generated_tokens"].tolist() == lengths
    assert out["generated_text"].tolist() == [alone(q, max_tokens=n) for q, n in zip(df["q"], lengths)]


def test_sampling_params_as_json_text_from_csv(kw, tmp_path):
    import json

    df, lengths = sampling_rows()
    df.assign(sp=[json.dumps(s) for s in df["sp"]]).to_csv(tmp_path / "in.csv", index=False)
    out = dd.read_csv(tmp_path / "in.csv").llm.generate("q", sampling_params="sp", **kw).compute()
    assert out["llm_error"].isna().all() and out["num_generated_tokens"].tolist() == lengths


# ---- placement travels with the task -------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed_cluster(tiny_llama, tmp_path_factory):
    """One worker declaring GPU=1 and one CPU worker, started from a folder holding
    ``models/tiny``: a relative model path that exists on the workers, not for the client."""
    worker_dir = tmp_path_factory.mktemp("worker-side")
    shutil.copytree(tiny_llama, worker_dir / "models" / "tiny")
    here = os.getcwd()
    os.chdir(worker_dir)
    try:
        cluster = CLICluster(workers=2, threads=2, resources=["GPU=1", None])
    finally:
        os.chdir(here)
    yield cluster
    cluster.close()


def gpu_worker(client) -> str:
    info = client.scheduler_info(n_workers=-1)["workers"]
    return next(a for a, w in info.items() if w.get("resources", {}).get("GPU"))


@pytest.mark.slow
def test_resources_on_the_accessor_keep_dask_writes_on_gpu_workers(mixed_cluster, kw, tmp_path, alone):
    """Dask's own to_parquet and compute (no dfllm writer, no compute kwargs) run the engine
    only on the worker declaring GPU: the CPU worker never loads the model."""
    client = mixed_cluster.client()
    df = pd.DataFrame({"id": range(8), "q": [f"question {i}" for i in range(8)]})
    with client.as_current():
        ddf = dd.from_pandas(df, npartitions=8)
        result = ddf.llm.generate("q", sampling_params=SP, resources={"GPU": 0.5}, **kw)
        result.to_parquet(tmp_path / "out")
        computed = result.compute()
    loads = client.run(engine_cache.load_count)
    gpu = gpu_worker(client)
    assert loads[gpu] == 1 and all(n == 0 for a, n in loads.items() if a != gpu), loads
    back = pd.read_parquet(tmp_path / "out").sort_values("id")
    assert back["id"].tolist() == list(range(8)) and back["llm_error"].isna().all()
    assert back["generated_text"].tolist() == [alone(q) for q in df["q"]]
    assert computed.sort_values("id")["generated_text"].tolist() == back["generated_text"].tolist()


@pytest.mark.slow
def test_model_only_on_the_workers(mixed_cluster, kw, tmp_path):
    """A relative model path that the client cannot see is checked on a worker, and used."""
    client = mixed_cluster.client()
    assert not os.path.isdir("models/tiny")
    df = pd.DataFrame({"q": ["one question", "another question"]})
    with client.as_current():
        ddf = dd.from_pandas(df, npartitions=2)
        out = ddf.llm.generate(
            "q",
            model="models/tiny",
            max_model_len=64,
            kv_cache_memory_bytes=2**22,
            sampling_params=SP,
            resources={"GPU": 0.5},
        ).compute()
        assert out["llm_error"].isna().all() and out["num_generated_tokens"].tolist() == [4, 4]
        with pytest.raises(ValueError, match="Unknown model 'models/nowhere'"):
            ddf.llm.generate("q", model="models/nowhere", sampling_params=SP)
    with pytest.raises(ValueError, match="Unknown model 'models/tiny'"):  # no client: checked here, now
        df.llm.generate("q", model="models/tiny", sampling_params=SP)


@pytest.mark.slow
def test_resources_refused_where_they_mean_nothing(kw):
    df = pd.DataFrame({"q": ["x"]})
    with pytest.raises(ValueError, match="resources= places Dask tasks"):
        df.llm.generate("q", resources={"GPU": 1}, **kw)
    with pytest.raises(ValueError, match="must map to a positive number"):
        dd.from_pandas(df, npartitions=1).llm.generate("q", resources={"GPU": 0}, **kw)
