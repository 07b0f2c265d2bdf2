"""What ``dfllm.write_parquet``, ``dfllm run`` and ``dfllm run-batch`` may touch: only their
own files, whatever the paths.

- Object-storage folders whose names hold glob characters, spaces, non-ASCII, ``%`` or
  ``..`` (on a real S3-compatible server on 127.0.0.1): written, resumed and rewritten
  exactly, and the user's objects beside them (those a glob or a normalised path would
  reach) are left as they were.
- The response cache is never the output folder or inside it (its JSON entries would sit
  among the parts a reader reads, and refuse the folder to the next write), nor an input
  folder or inside one (the job would write into the user's input, and the next read of a
  JSON Lines folder would take the entries for input rows); nor inside run-batch's staging
  folder. Refused before any work, nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import dask
import dask.dataframe as dd
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dfllm
from dfllm.jobs.batch_job import run_batch
from dfllm.jobs.cli import main

from helpers import free_port
from run_batch_data import ENGINE, chat, write_jsonl

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with one bucket; yields storage options and an s3fs."""
    import boto3
    import s3fs
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    opts = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket="safety")
    yield opts, s3fs.S3FileSystem(**opts)
    server.stop()


def frame(n: int = 4, npartitions: int = 2) -> dd.DataFrame:
    df = pd.DataFrame({"id": range(n), "q": [f"question {i}" for i in range(n)]})
    return dd.from_pandas(df, npartitions=npartitions)


def generate(ddf: dd.DataFrame, model: Path, **kwargs):
    return ddf.llm.generate(
        "{q}",
        model=str(model),
        max_model_len=64,
        kv_cache_memory_bytes=2**22,
        sampling_params={"max_tokens": 2, "temperature": 0.0, "ignore_eos": True},
        **kwargs,
    )


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---- object storage names ---------------------------------------------------------------------------------
NAMES = ["out[1]", "sp ace/é", "pct%41", "dots/../x", "trail/", "a*b?"]
NEIGHBOURS = {  # objects a glob of, or a normalised path to, the folders above would reach
    "out1/part.00000.parquet": b"U1",
    "out[1]x": b"U2",
    "sp ace/é-old/part.00000.parquet": b"U3",
    "pctA/part.00000.parquet": b"U4",
    "x/part.00000.parquet": b"U5",
    "trail-x": b"U6",
    "aXbY/part.00000.parquet": b"U7",
    "a*b?.txt": b"U8",
}


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(NAMES), resumes=st.lists(st.booleans(), min_size=2, max_size=3))
def test_s3_folder_names_are_literal(s3, tiny_llama, name, resumes):
    opts, fs = s3
    for key, value in NEIGHBOURS.items():
        fs.pipe_file(f"safety/{key}", value)
    with dask.config.set(scheduler="sync"):
        for resume in resumes:
            summary = dfllm.write_parquet(
                generate(frame(), tiny_llama),
                f"s3://safety/{name}",
                resume=resume,
                storage_options=opts,
                progress=False,
            )
            assert summary.rows == 4
    fs.invalidate_cache()
    for key, value in NEIGHBOURS.items():
        assert fs.cat_file(f"safety/{key}") == value, key
    root = f"safety/{name.rstrip('/')}"
    assert sorted(f.rsplit("/", 1)[1] for f in fs.find(root) if "_dfllm_keys" not in f) == [
        "_common_metadata",
        "part.00000.parquet",
        "part.00001.parquet",
    ]
    fs.rm(root, recursive=True)


# ---- the response cache is not the output, nor in the input -----------------------------------------------
@pytest.mark.parametrize("where", ["output", "output/cache", "input", "input/cache"])
def test_write_parquet_refuses_a_cache_in_the_output_or_the_input(tiny_llama, tmp_path, where):
    source = tmp_path / "input"
    source.mkdir()
    frame().compute().to_parquet(source / "rows.parquet")
    (tmp_path / "output").mkdir()
    (tmp_path / "output" / "_notes.txt").write_text("mine")
    before = tree(tmp_path)
    result = generate(dd.read_parquet(str(source)), tiny_llama, cache=str(tmp_path / where))
    with pytest.raises(ValueError, match="response cache"):
        dfllm.write_parquet(result, str(tmp_path / "output"), progress=False)
    assert tree(tmp_path) == before


def test_write_parquet_keeps_a_cache_that_holds_the_output(tiny_llama, tmp_path):
    """A cache folder holding the output folder (or beside it) adds nothing the output's reader reads."""
    out = tmp_path / "cache" / "out"
    with dask.config.set(scheduler="sync"):
        summary = dfllm.write_parquet(
            generate(frame(), tiny_llama, cache=str(tmp_path / "cache")), str(out), progress=False
        )
    assert summary.rows == len(pd.read_parquet(out)) == 4


def test_cli_refuses_a_cache_inside_a_jsonl_input_folder(tmp_path, capsys):
    """Without the check, the cache's entries (one JSON object per ``.json`` file) land in
    the input folder and the next run over it reads them as input rows."""
    source = tmp_path / "data"
    source.mkdir()
    (source / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(3)))
    before = tree(tmp_path)
    for cache in (source / "cache", tmp_path / "out"):
        status = main(["run", str(source), str(tmp_path / "out"), "--cache", str(cache), "--no-progress"])
        assert status == 1
        assert "response cache" in capsys.readouterr().err
        assert tree(tmp_path) == before and not (tmp_path / "out").exists()


def test_run_batch_refuses_a_cache_inside_its_staging_folder(tiny_llama, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [chat("a", "Hi")])
    out = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match="response cache"):
        run_batch(
            str(src),
            str(out),
            model=str(tiny_llama),
            cache=str(tmp_path / "out.jsonl.parts" / "cache"),
            progress=False,
            **ENGINE,
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize(
    "cache, refused",
    [("out[1]", True), ("out[1]/c", True), ("c", False), ("out", False), ("in", True), ("in/c", True), (".", False)],
)
def test_the_output_is_literal_and_an_input_glob_is_its_folder(tmp_path, cache, refused):
    """The output ``out[1]`` is that folder (a cache beside it is fine); an input glob
    ``in/*.jsonl`` is the folder ``in``."""
    from dfllm.accessors.writer import refuse_cache_overlap
    from dfllm.tasks.response_cache import ResponseCache

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("{}\n")
    check = lambda: refuse_cache_overlap(  # noqa: E731
        ResponseCache(str(tmp_path / cache)), [str(tmp_path / "in" / "*.jsonl")], str(tmp_path / "out[1]")
    )
    if refused:
        with pytest.raises(ValueError, match="response cache"):
            check()
    else:
        check()


def test_a_processors_cache_in_the_output_is_refused(tiny_llama, tmp_path):
    """build_processor's config.cache is checked as ``.llm.generate``'s cache= is."""
    config = dfllm.ProcessorConfig(
        model_source=str(tiny_llama),
        engine_kwargs={"max_model_len": 64, "kv_cache_memory_bytes": 2**22},
        batch_size=4,
        cache=str(tmp_path / "out" / "cache"),
    )
    processor = dfllm.build_processor(
        config,
        preprocess=lambda row: {"prompt": row["q"], "sampling_params": {"max_tokens": 2, "temperature": 0.0}},
        postprocess=lambda row: {"text": row["generated_text"]},
    )
    lazy = processor(dd.from_pandas(pd.DataFrame({"q": ["a", "b", "c"]}), npartitions=1), meta={"text": "string"})
    with pytest.raises(ValueError, match="response cache"):
        dfllm.write_parquet(lazy, str(tmp_path / "out"), progress=False)
    assert not list((tmp_path / "out").rglob("*.parquet"))
