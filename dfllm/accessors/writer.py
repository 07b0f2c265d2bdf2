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
import time
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
    """What a write did: partitions written and skipped, rows, rows with ``llm_error``,
    prompt and generated tokens (generation tasks; 0 otherwise) and wall seconds.
    Skipped partitions count with the figures recorded when they were written."""

    path: str
    partitions: int
    written: int
    skipped: int
    rows: int
    errors: int
    input_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0


def write_parquet(result, path: str, *, resume: bool = False, storage_options: dict | None = None,
                  progress: bool = True, resources: dict | None = None) -> WriteSummary:
    """Write the lazy result of a Dask ``.llm`` call to a parquet dataset at ``path``.

    ``resources`` (on a distributed cluster) restricts every task of the write to workers
    that declare them, e.g. ``{"GPU": 0.25}`` to run on GPU workers with four tasks
    feeding each worker's engine at once (see :func:`dfllm.cluster.task_resources`).
    """
    start = time.perf_counter()
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
    results = _compute(jobs, progress, resources)
    _remove_leftovers(fs, root)
    return WriteSummary(path, len(parts), sum(r["written"] for r in results), sum(not r["written"] for r in results),
                        sum(r["rows"] for r in results), sum(r["errors"] for r in results),
                        sum(r.get("input_tokens", 0) for r in results), sum(r.get("output_tokens", 0) for r in results),
                        time.perf_counter() - start)


def _compute(jobs, progress: bool, resources: dict | None = None) -> list:
    try:
        from distributed import as_completed, default_client

        client = default_client()
    except (ImportError, ValueError):
        client = None
    if client is None:
        return list(dask.compute(*jobs))
    from tqdm.auto import tqdm

    futures = client.compute(jobs, resources=resources)
    order = {f.key: i for i, f in enumerate(futures)}
    out: list = [None] * len(futures)
    for fut in tqdm(as_completed(futures), total=len(futures), desc="llm partitions", disable=not progress):
        out[order[fut.key]] = fut.result()
    return out


def partition_key(df: pd.DataFrame, task: LLMTask) -> str:
    """Hash of a partition's input rows (index and values) and of the task."""
    h = hashlib.sha256(repr(task).encode())
    h.update(pd.util.hash_pandas_object(_hashable_frame(df), index=True).values.tobytes())
    h.update(",".join(map(str, df.columns)).encode())
    return h.hexdigest()


def _hashable_frame(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with nested values (lists, dicts, arrays: conversations) as canonical JSON text."""
    nested = [c for c in df.columns if df[c].dtype == object and
              any(isinstance(v, (list, dict, tuple)) or hasattr(v, "tolist") for v in df[c])]
    if not nested:
        return df
    return df.assign(**{str(c): df[c].map(_canonical) for c in nested})


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v))


def _write_partition(df: pd.DataFrame, task: LLMTask, path: str, i: int, storage_options, resume: bool) -> dict:
    """Write one partition; returns ``written`` (False if resumed) and its row, error and token counts."""
    fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
    name, key_file = f"{root}/part.{i:05d}", f"{root}/{KEYS}/part.{i:05d}.key"
    key = partition_key(df, task)
    if resume and fs.exists(f"{name}.parquet") and fs.exists(key_file):
        with fs.open(key_file, "r") as f:
            recorded = json.load(f)
        if recorded.get("key") == key:
            return {**recorded, "written": False}
    out = run_task(df, task)
    counts = {"key": key, "rows": len(out), "errors": int(out["llm_error"].notna().sum()),
              "input_tokens": _total(out, "num_input_tokens"), "output_tokens": _total(out, "num_generated_tokens")}
    buf = io.BytesIO()
    pq.write_table(readable_table(out), buf)
    _atomic_write(fs, f"{name}.parquet", buf.getvalue())
    _atomic_write(fs, key_file, json.dumps(counts).encode())
    return {**counts, "written": True}


def readable_table(df: pd.DataFrame) -> pa.Table:
    """``df`` as an Arrow table whose parquet files pandas and Dask can read back.

    pandas records nested Arrow columns (``list<item: float>[pyarrow]``, structs) in the
    parquet metadata under names that its own reader cannot parse again, so a plain
    ``pd.read_parquet`` of such a file fails. Those columns are recorded as ``object``:
    pandas reads them as arrays (``dtype_backend="pyarrow"`` gives the Arrow types back),
    Polars and pyarrow read the Arrow types from the file's schema as before.
    """
    table = pa.Table.from_pandas(df, preserve_index=True)
    meta = json.loads(table.schema.metadata[b"pandas"])
    for column in meta["columns"]:
        if column["numpy_type"].endswith("[pyarrow]") and "<" in column["numpy_type"]:
            column["numpy_type"] = "object"
    return table.replace_schema_metadata({**table.schema.metadata, b"pandas": json.dumps(meta).encode()})


def _total(df: pd.DataFrame, column: str) -> int:
    return int(df[column].sum()) if column in df else 0


def _remove_leftovers(fs, root: str) -> None:
    """Delete temporary files of writes that never finished (a worker killed mid-write, a
    crashed earlier run); called once every partition of this write is done."""
    for tmp in fs.glob(f"{root}/.tmp-*") + fs.glob(f"{root}/{KEYS}/.tmp-*"):
        fs.rm(tmp)


def _atomic_write(fs, target: str, data: bytes) -> None:
    tmp = f"{target.rsplit('/', 1)[0]}/.tmp-{uuid.uuid4().hex}-{target.rsplit('/', 1)[1]}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, target)
