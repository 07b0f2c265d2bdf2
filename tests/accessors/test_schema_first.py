"""One Arrow schema per write, user paths taken literally, nothing of the user's deleted.

Each test here failed before the writer decided one schema per job: parts typed from their
own partition's Python objects disagreed (fields lost on read-back), one bad value failed a
whole partition, globs in paths deleted another folder's files, and ``dfllm run data data``
deleted its own input. Real parquet files, the real command line on a real cluster, a tiny
random Llama; read back with pandas, pyarrow and Polars.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import dask
import dask.dataframe as dd
import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dfllm

from helpers import build_tiny_model

pytestmark = pytest.mark.timeout(600)


def dfllm_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfllm.jobs.cli", *args], capture_output=True, text=True, timeout=300)


def part_schemas(out: Path) -> list[pa.Schema]:
    return [pq.read_schema(p).remove_metadata() for p in sorted(out.glob("part.*.parquet"))]


def read_back(out: Path) -> pd.DataFrame:
    """The dataset read with pandas, pyarrow and Polars: one schema across parts, the same rows."""
    schemas = part_schemas(out)
    assert schemas and all(s.equals(schemas[0]) for s in schemas), schemas
    common = pq.read_schema(out / "_common_metadata").remove_metadata()
    assert common.equals(schemas[0])
    table = pq.read_table(out)
    frame = pl.read_parquet(str(out / "part.*.parquet"))
    back = pd.read_parquet(out)
    assert len(back) == table.num_rows == frame.height
    return back


def gen(ddf, model: Path, **kw):
    return ddf.llm.generate(
        "prompt",
        model=str(model),
        max_model_len=64,
        kv_cache_memory_bytes=2**22,
        sampling_params={"max_tokens": 1, "temperature": 0.0, "ignore_eos": True},
        **kw,
    )


# ---- 1 and 5: JSON Lines whose fields vary between files, and rows whose values do not fit --------------
@pytest.mark.slow
def test_run_over_json_lines_with_varying_fields_keeps_every_field(cli_cluster, tiny_llama, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    first = [
        {"id": 1, "meta": {"a": 1}, "tags": None, "messages": [{"role": "user", "content": "Say hi."}]},
        {"id": 2, "meta": {"a": 2}, "tags": None, "messages": "not a conversation"},
    ]
    second = [
        {"id": 3, "meta": {"a": 3, "b": 4}, "tags": ["x", "y"], "messages": [{"role": "user", "content": "Say yes."}]},
        {"id": 4, "meta": {"a": 5, "b": 6}, "tags": ["z"], "messages": [{"role": "user", "content": "No."}]},
    ]
    for name, rows in (("a.jsonl", first), ("b.jsonl", second)):
        (src / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    result = dfllm_cli(
        "run",
        str(src),
        str(out),
        "--task",
        "chat",
        "--model",
        str(tiny_llama),
        "--max-tokens",
        "2",
        "--max-model-len",
        "128",
        "--scheduler",
        cli_cluster.address,
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr
    back = read_back(out).sort_values("id").reset_index(drop=True)
    assert back["id"].tolist() == [1, 2, 3, 4]
    assert [dict(m) for m in back["meta"]] == [
        {"a": 1, "b": None},
        {"a": 2, "b": None},
        {"a": 3, "b": 4},
        {"a": 5, "b": 6},
    ]
    assert [None if t is None else list(t) for t in back["tags"]] == [None, None, ["x", "y"], ["z"]]
    errors = back["llm_error"].tolist()
    assert pd.isna(errors[0]) and pd.isna(errors[2]) and pd.isna(errors[3])
    assert "column 'messages'" in errors[1] and "'not a conversation'" in errors[1]
    assert back["messages"].iloc[1] is None and len(back["messages"].iloc[0]) == 1
    assert back["generated_text"].notna().tolist() == [True, False, True, True]


@pytest.mark.slow
def test_run_row_with_a_number_for_its_prompt_fails_alone(cli_cluster, tiny_llama, tmp_path):
    src = tmp_path / "in.jsonl"
    rows = [{"prompt": "Tell me a story."}, {"prompt": 5}, {"prompt": "Another one."}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    result = dfllm_cli(
        "run",
        str(src),
        str(out),
        "--model",
        str(tiny_llama),
        "--max-tokens",
        "2",
        "--max-model-len",
        "64",
        "--scheduler",
        cli_cluster.address,
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr
    back = read_back(out)
    assert back["generated_text"].notna().tolist() == [True, False, True]
    assert "column 'prompt'" in back["llm_error"].iloc[1]


def test_parquet_files_with_other_struct_fields_and_a_null_list_column(tiny_llama, tmp_path):
    """Parquet inputs whose files disagree (a struct field only in one, a list column null
    throughout one, a map column) read back with every field."""
    from dfllm.jobs.sources import read_input

    src = tmp_path / "in"
    src.mkdir()
    pq.write_table(
        pa.table(
            {
                "prompt": ["a b", "c d"],
                "s": pa.array([{"a": 1}, {"a": 2}]),
                "t": pa.array([None, None], pa.list_(pa.string())),
                "m": pa.array([[("k", 1)], []], pa.map_(pa.string(), pa.int64())),
            }
        ),
        src / "1.parquet",
    )
    pq.write_table(
        pa.table(
            {
                "prompt": ["e f"],
                "s": pa.array([{"a": 3, "b": 4}]),
                "t": pa.array([["x"]]),
                "m": pa.array([[("z", 3)]], pa.map_(pa.string(), pa.int64())),
            }
        ),
        src / "2.parquet",
    )
    out = tmp_path / "out"
    summary = dfllm.write_parquet(gen(read_input(str(src)), tiny_llama), str(out), progress=False)
    assert (summary.rows, summary.errors) == (3, 0)
    back = read_back(out)
    assert [dict(s) for s in back["s"]] == [{"a": 1, "b": None}, {"a": 2, "b": None}, {"a": 3, "b": 4}]
    table = pq.read_table(out)
    assert pa.types.is_map(table.schema.field("m").type)
    assert table.column("m").to_pylist() == [[("k", 1)], [], [("z", 3)]]
    assert table.column("t").to_pylist() == [None, None, ["x"]]


def test_files_whose_types_cannot_be_unified_are_refused_naming_the_column(tmp_path):
    from dfllm.jobs.sources import InputError, read_input

    pq.write_table(pa.table({"x": [1]}), tmp_path / "1.parquet")
    pq.write_table(pa.table({"x": ["one"]}), tmp_path / "2.parquet")
    with pytest.raises(InputError, match=r"column 'x' is int64 in .*1.parquet but string in .*2.parquet"):
        read_input(str(tmp_path))


def test_empty_partitions_write_the_same_schema(tiny_llama, tmp_path):
    df = pd.DataFrame({"prompt": ["a b", "c d"], "extra": [{"k": [1, 2]}, {"k": [3]}]})
    with dask.config.set({"dataframe.convert-string": False}):  # keep the dicts (Dask would make them text)
        ddf = dd.from_pandas(df, npartitions=2)
    ddf = ddf[ddf["prompt"] == "a b"]  # the second partition is empty
    out = tmp_path / "out"
    dfllm.write_parquet(gen(ddf, tiny_llama), str(out), progress=False)
    assert [pq.read_metadata(p).num_rows for p in sorted(out.glob("part.*"))] == [1, 0]
    back = read_back(out)
    assert back["extra"].iloc[0]["k"].tolist() == [1, 2]


# ---- 2: the input folder as the output -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("where", ["same", "inside", "holding"])
def test_run_refuses_an_output_overlapping_its_input(tmp_path, where):
    data = tmp_path / "data"
    data.mkdir()
    pd.DataFrame({"prompt": ["a b"]}).to_parquet(data / "part.0.parquet")  # Dask's naming, as a user has it
    src, out = {"same": (data, data), "inside": (data, data / "out"), "holding": (data / "part.0.parquet", tmp_path)}[
        where
    ]
    result = dfllm_cli("run", str(src), str(out), "--no-progress")
    assert result.returncode == 1
    assert "overlaps the input" in result.stderr
    assert sorted(p.name for p in data.iterdir()) == ["part.0.parquet"]
    assert pd.read_parquet(data / "part.0.parquet")["prompt"].tolist() == ["a b"]


def test_write_parquet_refuses_an_output_inside_its_input(tiny_llama, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    pd.DataFrame({"prompt": ["a b"]}).to_parquet(data / "x.parquet")
    with pytest.raises(ValueError, match="overlaps the input"):
        dfllm.write_parquet(gen(dd.read_parquet(str(data)), tiny_llama), str(data / "out"), progress=False)
    assert sorted(p.name for p in data.iterdir()) == ["x.parquet"]


# ---- 3: glob characters in paths ----------------------------------------------------------------------------
def test_output_path_with_glob_characters_is_literal(tiny_llama, tmp_path):
    sibling = tmp_path / "out1"
    sibling.mkdir()
    shutil.copy(Path(__file__), sibling / "keep.txt")
    ddf = dd.from_pandas(pd.DataFrame({"prompt": ["a b", "c d", "e f"]}), npartitions=3)
    first = dfllm.write_parquet(gen(ddf, tiny_llama), str(sibling.parent / "other"), progress=False)
    assert first.rows == 3
    for p in sorted((tmp_path / "other").glob("part.*")):  # dfllm's own parts: exactly what a glob would take
        shutil.copy(p, sibling / p.name)
    before = {p.name: p.read_bytes() for p in sibling.iterdir()}
    out = tmp_path / "out[1]"
    two = dd.from_pandas(pd.DataFrame({"prompt": ["g h"]}), npartitions=1)
    for resume in (False, True, False):
        summary = dfllm.write_parquet(gen(two, tiny_llama), str(out), progress=False, resume=resume)
        assert summary.rows == 1
    assert {p.name: p.read_bytes() for p in sibling.iterdir()} == before
    assert sorted(p.name for p in out.glob("part.*")) == ["part.00000.parquet"]
    from dfllm.jobs.sources import read_input

    assert read_input(str(out)).compute()["prompt"].tolist() == ["g h"]  # an existing path is not a glob


# ---- 4: output names against everything the task writes --------------------------------------------------
@pytest.mark.parametrize(
    "name, extra",
    [
        ("llm_error", {}),
        ("finish_reason", {}),
        ("num_input_tokens", {}),
        ("num_cached_tokens", {"engine_columns": ["num_cached_tokens"]}),
    ],
)
def test_output_column_may_not_be_one_the_task_writes(tiny_llama, name, extra):
    ddf = dd.from_pandas(pd.DataFrame({"prompt": ["a b"]}), npartitions=1)
    with pytest.raises(ValueError, match=rf"output_column '{name}' is one of the columns generate itself writes"):
        gen(ddf, tiny_llama, output_column=name, **extra)
    with pytest.raises(ValueError, match="itself writes"):
        pd.DataFrame({"prompt": ["a b"]}).llm.generate("prompt", model=str(tiny_llama), output_column=name, **extra)


# ---- 6 and 7: nested Arrow columns, lone surrogates -----------------------------------------------------
def test_nested_arrow_columns_and_pyarrow_conversations(tiny_llama, tmp_path):
    convs = [[{"role": "user", "content": "Say hi."}], [{"role": "user", "content": "Say bye."}]]
    df = pd.DataFrame({"messages": convs, "counts": [{"a": 1}, {"b": 2}]})
    table = pa.Table.from_pandas(df, preserve_index=False).set_column(
        1, "counts", pa.array([[("a", 1)], [("b", 2)]], pa.map_(pa.string(), pa.int64()))
    )
    arrow_df = table.to_pandas(types_mapper=pd.ArrowDtype)
    ddf = dd.from_pandas(arrow_df, npartitions=2)
    result = ddf.llm.chat(
        "messages",
        model=str(tiny_llama),
        max_model_len=128,
        kv_cache_memory_bytes=2**22,
        sampling_params={"max_tokens": 2, "temperature": 0.0},
    )
    out = tmp_path / "out"
    summary = dfllm.write_parquet(result, str(out), progress=False)
    assert (summary.rows, summary.errors) == (2, 0)
    again = dfllm.write_parquet(result, str(out), progress=False, resume=True)
    assert (again.written, again.skipped) == (0, 2)  # hashed for the resume key, and kept
    back = pq.read_table(out)
    assert back.column("counts").to_pylist() == [[("a", 1)], [("b", 2)]]
    assert read_back(out)["generated_text"].notna().all()


def test_a_lone_surrogate_is_its_rows_error(tiny_llama, tmp_path):
    df = pd.DataFrame({"prompt": ["a b", "c d", "e f"], "note": pd.Series(["ok", "bad \ud800", "fine"], dtype=object)})
    with dask.config.set({"dataframe.convert-string": False}):  # Dask's own conversion cannot encode it
        ddf = dd.from_pandas(df, npartitions=1)
    out = tmp_path / "out"
    summary = dfllm.write_parquet(gen(ddf, tiny_llama), str(out), progress=False)
    assert (summary.rows, summary.errors) == (3, 1)
    back = read_back(out)
    assert back["note"].tolist()[::2] == ["ok", "fine"] and back["note"].isna().tolist()[1]
    assert "column 'note'" in back["llm_error"].iloc[1]
    assert back["generated_text"].notna().all()  # its other columns are kept


# ---- 9: a model replaced in place --------------------------------------------------------------------------
@pytest.mark.slow
def test_resume_recomputes_after_new_weights_in_the_same_folder(tiny_llama, smollm2_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    ddf = dd.from_pandas(pd.DataFrame({"prompt": ["a b", "c d"]}), npartitions=2)
    out = tmp_path / "out"
    first = dfllm.write_parquet(gen(ddf, model), str(out), progress=False)
    assert first.written == 2
    assert dfllm.write_parquet(gen(ddf, model), str(out), progress=False, resume=True).skipped == 2
    other = build_tiny_model(tmp_path / "other", smollm2_dir, seed=5)
    for weights in other.glob("*.safetensors"):
        shutil.copy(weights, model / weights.name)
    again = dfllm.write_parquet(gen(ddf, model), str(out), progress=False, resume=True)
    assert (again.written, again.skipped) == (2, 0)
    (model / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "top_k": 3}))
    assert dfllm.write_parquet(gen(ddf, model), str(out), progress=False, resume=True).written == 2


@pytest.mark.slow
def test_every_sampling_field_enters_the_write_key():
    """The one serialisation of a task: changing any field of SamplingParams changes it."""
    from dfllm.sampling_params import SamplingParams
    from dfllm.structured_outputs import StructuredOutputsParams
    from dfllm.tasks.write_key import canonical

    base = SamplingParams()
    changed = {
        "n": 2,
        "temperature": 0.5,
        "top_p": 0.5,
        "top_k": 5,
        "min_p": 0.1,
        "seed": 3,
        "max_tokens": 7,
        "min_tokens": 1,
        "stop": ["x"],
        "stop_token_ids": [5],
        "ignore_eos": True,
        "logprobs": 2,
        "prompt_logprobs": 1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.2,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "spaces_between_special_tokens": False,
    }
    keys = {canonical(base)}
    for name, value in changed.items():
        if name in vars(base):
            keys.add(
                canonical(
                    SamplingParams(
                        **{
                            **{
                                k: v
                                for k, v in vars(base).items()
                                if not k.startswith("_") and k in SamplingParams.__dataclass_fields__
                            },
                            name: value,
                        }
                    )
                )
            )
    assert len(keys) == 1 + sum(name in vars(base) for name in changed)
    a = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)
    b = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=False)
    assert canonical(a) != canonical(b)
    with pytest.raises(TypeError, match="has no stable key"):
        canonical(lambda: 0)
