"""A processor's result through ``dfllm.write_parquet(resume=True)``: every input row once
(error rows included, in ``llm_error`` or Ray's ``__inference_error__``), a resumed write
computes only the missing partitions and reuses the rest when it is the same processor
(config, output types, and preprocess/postprocess by fingerprint or ``key=``), and
recomputes when it is not.

The writes run on a real LocalCluster of worker processes with a tiny random Llama; the
fingerprints are checked across Python processes with different hash seeds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import dask.dataframe as dd
import pandas as pd
import pyarrow.parquet as pq
import pytest

import dfllm
from dfllm.jobs.fingerprint import FingerprintError, fingerprint

from helpers import local_client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

N = 6
FAILS = 4  # the id whose preprocess fails


# ---- fingerprints -------------------------------------------------------------------------------------
MODULE = """
import json
SP = {"temperature": 0.0, "max_tokens": 4}

def helper(x):
    return x.strip() if x in {"a", "b"} else x

def preprocess(row, n=1):
    return dict(prompt=helper(row["q"]) * n, sampling_params=SP, tag=json.dumps([1]))

def make_postprocess(upper):
    def postprocess(row):
        return dict(id=row["id"], answer=row["generated_text"].upper() if upper else row["generated_text"])
    return postprocess
"""


def _fingerprints(tmp_path: Path, sources: list[str], seed: int) -> list[list[str]]:
    """The fingerprints of each module's functions, computed in one fresh Python process
    (hash seed ``seed``); every source is imported in turn as the same module, ``user_module``."""
    dirs = []
    for i, source in enumerate(sources):
        (tmp_path / f"mod_{seed}_{i}").mkdir()
        (tmp_path / f"mod_{seed}_{i}" / "user_module.py").write_text(textwrap.dedent(source))
        dirs.append(str(tmp_path / f"mod_{seed}_{i}"))
    code = (
        "import importlib, sys\n"
        "from dfllm.jobs.fingerprint import fingerprint\n"
        "for path in sys.argv[1:]:\n"
        "    sys.path.insert(0, path); sys.modules.pop('user_module', None)\n"
        "    m = importlib.import_module('user_module'); sys.path.remove(path)\n"
        "    print(fingerprint(m.preprocess), fingerprint(m.make_postprocess(True)), "
        "fingerprint(m.make_postprocess(False)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *dirs],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": str(seed)},
    )
    return [line.split() for line in out.stdout.splitlines()]


def test_fingerprint_is_stable_across_processes_and_sees_changes(tmp_path):
    [first], [again] = _fingerprints(tmp_path, [MODULE], 1), _fingerprints(tmp_path, [MODULE], 2)
    assert first == again  # a re-run of the same script: same fingerprints, whatever the hash seed
    assert first[1] != first[2]  # the closure's value counts
    edits = {  # every one of these changes what preprocess does
        "its code": MODULE.replace('helper(row["q"]) * n', 'helper(row["q"]) * n + "!"'),
        "a global it reads": MODULE.replace('"max_tokens": 4', '"max_tokens": 5'),
        "a helper of its module": MODULE.replace("x.strip()", "x.lower()"),
        "a default": MODULE.replace("n=1", "n=2"),
    }
    # comments, blank lines and line numbers do not count
    moved = "\n\n# a comment\n" + MODULE.replace("def helper(x):", "def helper(x):  # strips")
    *edited, same = _fingerprints(tmp_path, [*edits.values(), moved], 3)
    for what, prints in zip(edits, edited):
        assert prints[0] != first[0], what
    assert same == first


def test_fingerprint_of_callables():
    import functools

    def f(row, k=1):
        return {"k": k}

    class Post:
        def __init__(self, n):
            self.n = n

        def __call__(self, row):
            return {"n": self.n}

    assert fingerprint(None) == "none"
    assert fingerprint(functools.partial(f, k=2)) != fingerprint(functools.partial(f, k=3))
    assert fingerprint(Post(1)) == fingerprint(Post(1)) != fingerprint(Post(2))
    lock = threading.Lock()
    with pytest.raises(FingerprintError, match="closure value 'lock': a lock has no stable fingerprint"):
        fingerprint(lambda row: {"locked": lock.locked()})


# ---- writes on a cluster --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client():
    with local_client(workers=2, threads=1) as c:
        yield c


@pytest.fixture(scope="module")
def rows() -> pd.DataFrame:
    return pd.DataFrame({"id": range(N), "q": [f"Tell me about lake number {i}." for i in range(N)]})


def make_processor(tiny_llama, *, max_tokens: int = 2, upper: bool = False, key: str | None = None, **config):
    """A processor as a re-run of the same script builds it: fresh function objects."""

    def preprocess(row):
        if row["id"] == FAILS:
            raise KeyError("no lake")
        return dict(prompt=row["q"], sampling_params=dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))

    def postprocess(row):
        text = row["generated_text"]
        return dict(id=row["id"], answer=text.upper() if upper else text, n=row["num_generated_tokens"])

    config = {"batch_size": 2, "engine_kwargs": {"max_model_len": 64, "kv_cache_memory_bytes": 2**22}, **config}
    cfg = dfllm.ProcessorConfig(model_source=str(tiny_llama), **config)
    return dfllm.build_processor(cfg, preprocess=preprocess, postprocess=postprocess, key=key)


def write(processor, rows: pd.DataFrame, out: Path, *, npartitions: int = 3, resume: bool = True):
    return dfllm.write_parquet(
        processor(dd.from_pandas(rows, npartitions=npartitions)), str(out), resume=resume, progress=False
    )


def exact(out: Path, summary: dfllm.WriteSummary, error_column: str) -> pd.DataFrame:
    """Every input row once (the failed one with its message), the summary what a reader reads."""
    back = pd.read_parquet(out).sort_values("id")
    assert summary.rows == len(back) == N and back["id"].tolist() == list(range(N))
    assert summary.written + summary.skipped == summary.partitions
    assert sorted(p.name for p in out.glob("part.*")) == [f"part.{i:05d}.parquet" for i in range(summary.partitions)]
    assert not list(out.rglob(".tmp-*"))
    failed = back[back[error_column].notna()]
    assert failed["id"].tolist() == [FAILS] and summary.errors == 1
    assert failed[error_column].iloc[0] == "preprocess: KeyError: 'no lake'"
    return back


@pytest.mark.parametrize("continue_on_error, error_column", [(None, "llm_error"), (True, "__inference_error__")])
def test_killed_write_resumes_only_missing_partitions(
    client, tiny_llama, rows, tmp_path, continue_on_error, error_column
):
    processor = make_processor(tiny_llama, should_continue_on_error=continue_on_error)
    once = processor(dd.from_pandas(rows, npartitions=3)).compute().sort_values("id")
    assert error_column in once.columns and once[error_column].notna().sum() == 1
    out = tmp_path / "out"
    first = write(processor, rows, out, resume=False)
    assert (first.partitions, first.written, first.skipped) == (3, 3, 0)
    exact(out, first, error_column)
    record = pq.read_metadata(out / "part.00000.parquet").metadata[b"dfllm"]
    assert (out / "_dfllm_keys" / "part.00000.key").read_bytes() == record  # the footer carries the record

    # a killed run: part 1 lost, part 2's key never recorded, a half-written part left behind
    mtime = (out / "part.00000.parquet").stat().st_mtime_ns
    (out / "part.00001.parquet").unlink()
    (out / "_dfllm_keys" / "part.00002.key").unlink()
    (out / ".tmp-0123abcd-part.00001.parquet").write_bytes(b"PAR1 half a file")
    rerun = make_processor(tiny_llama, should_continue_on_error=continue_on_error)  # the script run again
    again = write(rerun, rows, out)
    assert (again.written, again.skipped) == (2, 1)
    assert (out / "part.00000.parquet").stat().st_mtime_ns == mtime
    back = exact(out, again, error_column)
    pd.testing.assert_frame_equal(back, once, check_dtype=False)  # as a one-shot run
    third = write(make_processor(tiny_llama, should_continue_on_error=continue_on_error), rows, out)
    assert (third.written, third.skipped) == (0, 3)
    # other partitions of the same rows: the one-row partitions a 6-way split shares with none
    # of the 3 earlier parts are recomputed, and the folder is exact again
    pd.testing.assert_frame_equal(
        exact(out, write(rerun, rows, out, npartitions=6), error_column), once, check_dtype=False
    )


def test_changed_processor_is_noticed(client, tiny_llama, rows, tmp_path):
    out = tmp_path / "out"
    exact(out, write(make_processor(tiny_llama), rows, out, resume=False), "llm_error")
    # settings that only place or pace the work: the parts are reused
    paced = write(make_processor(tiny_llama, concurrency=2, max_concurrent_batches=2), rows, out)
    assert (paced.written, paced.skipped) == (0, 3)
    # a changed postprocess, preprocess's sampling settings, or config: recomputed
    upper = write(make_processor(tiny_llama, upper=True), rows, out)
    assert (upper.written, upper.skipped) == (3, 0)
    back = exact(out, upper, "llm_error")
    assert (back["answer"].dropna() == back["answer"].dropna().str.upper()).all()
    longer = write(make_processor(tiny_llama, max_tokens=3), rows, out)
    assert longer.written == 3
    assert (exact(out, longer, "llm_error")["n"].dropna() == 3).all()
    batched = write(make_processor(tiny_llama, max_tokens=3, batch_size=1), rows, out)
    assert batched.written == 3
    # key= stands in for the functions' fingerprints: the same key reuses, another recomputes
    keyed = write(make_processor(tiny_llama, key="v1"), rows, out)
    assert keyed.written == 3 and (exact(out, keyed, "llm_error")["n"].dropna() == 2).all()
    same_key = write(make_processor(tiny_llama, upper=True, key="v1"), rows, out)
    assert (same_key.written, same_key.skipped) == (0, 3)
    assert write(make_processor(tiny_llama, key="v2"), rows, out).written == 3


def test_unfingerprintable_function_asks_for_a_key(tiny_llama, rows, tmp_path):
    lock = threading.Lock()
    cfg = dfllm.ProcessorConfig(model_source=str(tiny_llama), engine_kwargs={"max_model_len": 64})
    meta = {"id": "int64", "answer": "string"}
    processor = dfllm.build_processor(
        cfg,
        preprocess=lambda r: dict(prompt=r["q"]),
        postprocess=lambda r: dict(id=r["id"], answer=r["generated_text"], busy=lock.locked()),
        meta=meta,
    )
    ddf = dd.from_pandas(rows, npartitions=2)
    with pytest.raises(ValueError, match=r"closure value 'lock'.*pass key="):
        dfllm.write_parquet(processor(ddf), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()  # refused before any work
    assert '"key":"v1"' in processor(ddf, key="v1").expr.func.write_key
    with pytest.raises(ValueError, match="key= must be a non-empty string"):
        processor(ddf, key="")
    with pytest.raises(ValueError, match="direct result of a Dask .llm call .* or of a processor"):
        dfllm.write_parquet(processor(ddf, key="v1")[["id"]], str(tmp_path / "out"))
