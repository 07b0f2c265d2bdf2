"""Writing accessor results to parquet partition by partition, atomically and resumably.

``write_parquet(result, path, resume=True)`` writes ``part.NNNNN.parquet`` files through
fsspec (local paths, ``s3://``, any fsspec URL with ``storage_options``). Each part is
written to a temporary name and moved into place, then ``_dfllm_keys/part.NNNNN.key``
(a folder parquet readers skip) records
what produced it: a hash of the partition's input rows and of the task (model, sampling and
engine settings). With ``resume=True`` a partition whose part and matching key exist is
skipped; anything else (a missing or partial part, changed input, a changed config) is
recomputed. Only one partition per task is in memory at a time, so datasets far larger
than the workers' memory stream through.
"""

from __future__ import annotations

import hashlib
import io
import json
import uuid
from dataclasses import dataclass

import dask
import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dfllm.accessors.task import LLMTask, run_task

KEYS = "_dfllm_keys"
# result name -> (input dataframe, task), registered by the Dask accessor
ORIGINS: dict[str, tuple] = {}


@dataclass
class WriteSummary:
    """What a write did: partitions written and skipped, rows, rows with ``llm_error``."""

    path: str
    partitions: int
    written: int
    skipped: int
    rows: int
    errors: int


def write_parquet(result, path: str, *, resume: bool = False, storage_options: dict | None = None,
                  progress: bool = True) -> WriteSummary:
    """Write the lazy result of a Dask ``.llm`` call to a parquet dataset at ``path``."""
    if result._name not in ORIGINS:
        raise ValueError("write_parquet takes the direct result of a Dask .llm call (ddf.llm.generate(...) etc.); "
                         "for other frames use their own to_parquet")
    source, task = ORIGINS[result._name]
    fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
    fs.makedirs(root, exist_ok=True)
    fs.makedirs(f"{root}/{KEYS}", exist_ok=True)
    if not resume:
        for old in fs.glob(f"{root}/part.*") + fs.glob(f"{root}/{KEYS}/part.*"):
            fs.rm(old)
    parts = source.to_delayed()
    jobs = [dask.delayed(_write_partition, pure=False)(p, task, path, i, storage_options, resume,
                                                       dask_key_name=f"llm-write-{task.kind}-{i}-{uuid.uuid4().hex[:8]}")
            for i, p in enumerate(parts)]
    results = _compute(jobs, progress)
    return WriteSummary(path, len(parts), sum(r[0] for r in results), sum(not r[0] for r in results),
                        sum(r[1] for r in results), sum(r[2] for r in results))


def _compute(jobs, progress: bool) -> list:
    try:
        from distributed import as_completed, default_client

        client = default_client()
    except (ImportError, ValueError):
        client = None
    if client is None:
        return list(dask.compute(*jobs))
    from tqdm.auto import tqdm

    futures = client.compute(jobs)
    order = {f.key: i for i, f in enumerate(futures)}
    out: list = [None] * len(futures)
    for fut in tqdm(as_completed(futures), total=len(futures), desc="llm partitions", disable=not progress):
        out[order[fut.key]] = fut.result()
    return out


def partition_key(df: pd.DataFrame, task: LLMTask) -> str:
    """Hash of a partition's input rows (index and values) and of the task."""
    h = hashlib.sha256(repr(task).encode())
    h.update(pd.util.hash_pandas_object(df, index=True).values.tobytes())
    h.update(",".join(map(str, df.columns)).encode())
    return h.hexdigest()


def _write_partition(df: pd.DataFrame, task: LLMTask, path: str, i: int, storage_options, resume: bool):
    """Returns ``(written, rows, errors)`` for one partition."""
    fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
    name, key_file = f"{root}/part.{i:05d}", f"{root}/{KEYS}/part.{i:05d}.key"
    key = partition_key(df, task)
    if resume and fs.exists(f"{name}.parquet") and fs.exists(key_file):
        with fs.open(key_file, "r") as f:
            recorded = json.load(f)
        if recorded.get("key") == key:
            return False, recorded["rows"], recorded["errors"]
    out = run_task(df, task)
    errors = int(out["llm_error"].notna().sum())
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(out, preserve_index=True), buf)
    _atomic_write(fs, f"{name}.parquet", buf.getvalue())
    _atomic_write(fs, key_file, json.dumps({"key": key, "rows": len(out), "errors": errors}).encode())
    return True, len(out), errors


def _atomic_write(fs, target: str, data: bytes) -> None:
    tmp = f"{target.rsplit('/', 1)[0]}/.tmp-{uuid.uuid4().hex}-{target.rsplit('/', 1)[1]}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, target)
