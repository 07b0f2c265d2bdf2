"""Writing accessor and processor results to parquet partition by partition, atomically and resumably.

``write_parquet(result, path, resume=True)`` takes the direct result of a Dask ``.llm``
call (``ddf.llm.generate(...)`` etc.) or of a processor (``build_processor(...)(ddf)``).
Both map their source frame's partitions with a
:class:`~dfllm.accessors.dask_ext.WritableFunction`, whose ``write_key`` names what
decides a partition's output besides its rows: the accessor's task (model, sampling and
engine settings); the processor's config, output types and fingerprints of ``preprocess``
and ``postprocess`` (see :mod:`dfllm.jobs.processor`).

It writes ``part.NNNNN.parquet`` files through fsspec (local paths, ``s3://``, any fsspec
URL with ``storage_options``), one per partition of the input, numbered from 0. Each part
is written to a temporary name and moved into place, then ``_dfllm_keys/part.NNNNN.key``
(a folder parquet readers skip) records what produced it: a hash of the partition's input
rows (index and values) and of the write key, with its row, error (rows with a message in
the error column: ``llm_error``, or a processor's ``__inference_error__``) and token counts
(columns ``num_input_tokens`` and ``num_generated_tokens``, where the output has them).
The part's own parquet footer carries the same record (key-value metadata ``dfllm``), so a
part always says what it holds.

Resume is exact: when ``write_parquet`` returns, the folder holds exactly one part per
partition of this write, each the output of that partition under this task, so a reader
reads every input row exactly once, whatever the partitioning, row order or task of the
earlier writes to the folder.

- ``resume=False`` removes every earlier part and key first and computes everything.
- ``resume=True`` keeps partition ``i`` when ``part.i``'s key record and its footer both
  name this partition's key. A partition whose rows an earlier write put under another
  number (reordered partitions, new input files ahead of the old ones) is copied from
  that part, checked by its footer, rather than recomputed; before a task replaces an
  earlier part of other rows it moves it to ``_dfllm_keys/set-aside/`` so that the
  partition now holding those rows can still copy it. Anything else (a missing, partial or
  foreign part, a part whose key was never recorded, changed rows or partition bounds, a
  changed task or processor) is recomputed.
- At the end, parts and keys of numbers this write does not have (an earlier write with
  more partitions, Dask's own ``part.0.parquet``...), ``_metadata`` files, set-aside parts
  and temporary files of writes that never finished are removed. Then the parts' footers
  are read back: there must be exactly this write's parts, each with the key and row count
  its task reported, so the summary's ``rows`` is what a reader reads; otherwise (another
  job wrote to the folder meanwhile) ``write_parquet`` raises ``RuntimeError``.
- A folder holding files a parquet reader would read that are not ``part.*`` files (any
  file not under a ``.``/``_`` name) is refused before any work, since they would be read
  back with the results.

A write that fails part-way leaves a mix of old and new parts (a reader may then see some
rows twice or not at all); run it again with ``resume=True`` to make the folder exact
without redoing the finished partitions. Two jobs must not write to the same folder at
once. Parts written before footers carried the record are recomputed once. Only one
partition per task is in memory at a time, so datasets far larger than the workers'
memory stream through.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import dask
import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dfllm.accessors.dask_ext import WritableFunction, llm_origin
from dfllm.accessors.schema import NUM_GENERATED_TOKENS, NUM_INPUT_TOKENS

KEYS = "_dfllm_keys"
FOOTER_KEY = b"dfllm"  # the part's record in its parquet footer's key-value metadata
SET_ASIDE = f"{KEYS}/set-aside"  # earlier parts replaced during a resumed write, by key, until it ends
KEY_PATTERN = re.compile(r"[0-9a-f]{64}")  # what partition_key gives


@dataclass
class WriteSummary:
    """What a write did: partitions written and skipped, rows, rows with ``llm_error``,
    prompt and generated tokens (generation tasks; 0 otherwise) and wall seconds.
    Skipped partitions count with the figures recorded when they were written; ``rows``
    is checked against the parts' footers, so it is what a reader of ``path`` reads."""

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
    """Write the lazy result of a Dask ``.llm`` call or of a processor
    (:func:`dfllm.build_processor`) to a parquet dataset at ``path``.

    With ``resume=True`` finished partitions of an earlier write are kept and the rest
    computed; either way the folder ends with one part per partition of this result and
    nothing else a reader reads (see the module docstring). ``resources`` (on a
    distributed cluster) restricts every task of the write to workers that declare them,
    e.g. ``{"GPU": 0.25}`` to run on GPU workers with four tasks feeding each worker's
    engine at once (see :func:`dfllm.jobs.cluster.task_resources`).
    """
    start = time.perf_counter()
    origin = llm_origin(result)
    if origin is None:
        raise ValueError("write_parquet takes the direct result of a Dask .llm call (ddf.llm.generate(...) etc.) "
                         "or of a processor (build_processor(...)(ddf)); for other frames use their own to_parquet")
    source, func = origin
    write_key = func.write_key  # before any work: a processor whose functions have no stable key raises
    resources = resources or func.resources  # the call's resources unless overridden here
    fs, root = _filesystem(path, storage_options)
    _refuse_foreign_files(fs, root, path)
    fs.makedirs(root, exist_ok=True)
    fs.makedirs(f"{root}/{KEYS}", exist_ok=True)
    if not resume:
        for old in fs.glob(f"{root}/part.*") + fs.glob(f"{root}/{KEYS}/part.*") + fs.glob(f"{root}/{SET_ASIDE}"):
            fs.rm(old, recursive=True)
    earlier = dask.delayed(_earlier_parts(fs, root) if resume else {}, traverse=False)  # one graph key
    parts = source.to_delayed()
    run = uuid.uuid4().hex[:8]
    jobs = [dask.delayed(_write_partition, pure=False)(p, func, write_key, path, i, storage_options, resume, earlier,
                                                       dask_key_name=f"llm-write-{func.kind}-{i}-{run}")
            for i, p in enumerate(parts)]
    results = _compute(jobs, progress, resources)
    fs.invalidate_cache(root)  # listings cached before the workers wrote (s3fs, gcsfs...)
    _remove_leftovers(fs, root, len(parts))
    _check_written(fs, root, path, results)
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


def partition_key(df: pd.DataFrame, write_key: str) -> str:
    """Hash of a partition's input rows (index and values) and of the write key (what,
    besides the rows, decides the output: see :class:`WritableFunction`)."""
    h = hashlib.sha256(write_key.encode())
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


def _filesystem(path: str, storage_options: dict | None) -> tuple:
    """The fsspec filesystem and root folder of ``path``, with no listing cached from before."""
    fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
    root = root.rstrip("/")
    fs.invalidate_cache(root)
    return fs, root


def _part(root: str, i: int) -> str:
    return f"{root}/part.{i:05d}.parquet"


def _key_file(root: str, i: int) -> str:
    return f"{root}/{KEYS}/part.{i:05d}.key"


def _set_aside(root: str, key: str) -> str:
    return f"{root}/{SET_ASIDE}/{key}.parquet"


def _write_partition(df: pd.DataFrame, func: WritableFunction, write_key: str, path: str, i: int, storage_options,
                     resume: bool, earlier: dict[str, list[str]]) -> dict:
    """Write, keep, or copy from an earlier part, partition ``i``'s part; returns its record
    (key, row, error and token counts) and ``written`` (False if it was not recomputed).

    Only this task changes ``part.i`` and its key; before replacing an earlier part of
    other rows it sets that part aside, so another partition of this write that holds
    those rows can still copy it (``earlier``: key -> where an earlier write put it)."""
    fs, root = _filesystem(path, storage_options)
    key = partition_key(df, write_key)
    if resume:
        kept = _kept_part(fs, root, i, key)
        if kept is not None:
            return {**kept, "written": False}
        found = _earlier_part(fs, earlier.get(key, ()), key)
        if found is not None:
            data, record = found
            _replace_part(fs, root, i, data, record, resume)
            return {**record, "written": False}
    out = func(df)
    errors = int(out[func.error_column].notna().sum()) if func.error_column in out else 0
    record = {"key": key, "rows": len(out), "errors": errors,
              "input_tokens": _total(out, NUM_INPUT_TOKENS), "output_tokens": _total(out, NUM_GENERATED_TOKENS)}
    table = readable_table(out)
    table = table.replace_schema_metadata({**table.schema.metadata, FOOTER_KEY: json.dumps(record).encode()})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    _replace_part(fs, root, i, buf.getvalue(), record, resume)
    return {**record, "written": True}


def _kept_part(fs, root: str, i: int, key: str) -> dict | None:
    """Part ``i``'s record if both its key record and its footer name ``key``, else None."""
    try:
        with fs.open(_key_file(root, i), "r") as f:
            if json.load(f).get("key") != key:
                return None
        with fs.open(_part(root, i), "rb") as f:
            rows, record = _footer(f)
    except (FileNotFoundError, ValueError, OSError, pa.ArrowException):
        return None
    return {**record, "rows": rows} if record.get("key") == key else None


def _earlier_part(fs, places: list[str], key: str) -> tuple[bytes, dict] | None:
    """The bytes and record of an earlier part made from ``key``, from the first of
    ``places`` whose file (read whole, then checked by its footer) holds it."""
    for place in places:
        try:
            data = fs.cat_file(place)
            rows, record = _footer(io.BytesIO(data))
        except (FileNotFoundError, ValueError, OSError, pa.ArrowException):
            continue
        if record.get("key") == key:
            return data, {**record, "rows": rows}
    return None


def _replace_part(fs, root: str, i: int, data: bytes, record: dict, set_aside: bool) -> None:
    """Move ``data`` into place as part ``i`` and record its key (both atomically). With
    ``set_aside`` an earlier part ``i`` of other rows is first moved under ``_dfllm_keys``
    (a move keeps the file in one place or the other at every moment)."""
    part = _part(root, i)
    if set_aside:
        try:
            with fs.open(part, "rb") as f:
                old = _footer(f)[1].get("key")
        except (FileNotFoundError, ValueError, OSError, pa.ArrowException):
            old = None
        if isinstance(old, str) and KEY_PATTERN.fullmatch(old) and old != record["key"]:
            fs.makedirs(f"{root}/{SET_ASIDE}", exist_ok=True)
            fs.mv(part, _set_aside(root, old))
    _atomic_write(fs, part, data)
    _atomic_write(fs, _key_file(root, i), json.dumps(record).encode())


def _footer(f) -> tuple[int, dict]:
    """A part's row count and its dfllm record, from its parquet footer ({} if none)."""
    meta = pq.read_metadata(f)
    raw = (meta.metadata or {}).get(FOOTER_KEY)
    return meta.num_rows, json.loads(raw) if raw else {}


def _earlier_parts(fs, root: str) -> dict[str, list[str]]:
    """Key -> where parts an earlier write made from it may be: the part its key record
    names (unless replaced meanwhile), then the set-aside folder. Read once, on the client."""
    found: dict[str, list[str]] = {}
    for stashed in fs.glob(f"{root}/{SET_ASIDE}/*.parquet"):
        found[stashed.rsplit("/", 1)[1][:-len(".parquet")]] = [stashed]
    files = fs.glob(f"{root}/{KEYS}/part.*.key")
    for file, data in (fs.cat(files, on_error="omit") if files else {}).items():
        match = re.search(r"part\.(\d+)\.key$", file)
        try:
            key = json.loads(data).get("key")
        except (ValueError, AttributeError):
            continue
        if match and isinstance(key, str) and KEY_PATTERN.fullmatch(key):
            found[key] = [_part(root, int(match.group(1))), _set_aside(root, key)]
    return found


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
    """The sum of a numeric column (nulls skipped), else 0."""
    return int(df[column].sum()) if column in df and pd.api.types.is_numeric_dtype(df[column].dtype) else 0


def _visible(name: str) -> bool:
    """Whether parquet readers (pyarrow, Dask) read the file ``name`` (relative to the
    dataset's folder) as part of the dataset: not under a ``.`` or ``_`` name."""
    return not any(p.startswith((".", "_")) for p in name.split("/"))


def _refuse_foreign_files(fs, root: str, path: str) -> None:
    """Raise if the folder holds files a reader would read that are not parts: they would
    be read back with the results (point the job at its own folder)."""
    if not fs.exists(root):
        return
    if not fs.isdir(root):
        raise ValueError(f"{path} is a file; write_parquet writes a folder of parquet parts")
    inside = [f[len(root) + 1:] for f in fs.find(root) if f.startswith(root + "/")]
    foreign = [f for f in inside if f.strip("/") and _visible(f) and not f.startswith("part.")]
    if foreign:
        names = ", ".join(foreign[:3]) + (" ..." if len(foreign) > 3 else "")
        raise ValueError(f"{path} holds {len(foreign)} file(s) that are not parts of a dfllm dataset ({names}); "
                         "a reader would read them with the results: write to an empty or dfllm-only folder")


def _remove_leftovers(fs, root: str, partitions: int) -> None:
    """Once every partition of this write is done: delete parts and keys of partitions this
    write does not have (an earlier write with more partitions), ``_metadata`` files that
    describe other parts, set-aside parts, and temporary files of writes that never finished."""
    keep = {_part(root, i) for i in range(partitions)} | {_key_file(root, i) for i in range(partitions)}
    stale = [f for f in fs.glob(f"{root}/part.*") + fs.glob(f"{root}/{KEYS}/part.*") if f not in keep]
    stale += fs.glob(f"{root}/_metadata") + fs.glob(f"{root}/_common_metadata") + fs.glob(f"{root}/{SET_ASIDE}")
    stale += fs.glob(f"{root}/.tmp-*") + fs.glob(f"{root}/{KEYS}/.tmp-*")
    for file in stale:
        fs.rm(file, recursive=True)


def _check_written(fs, root: str, path: str, results: list[dict]) -> None:
    """Read the parts' footers back: exactly this write's parts, each with the key and row
    count its task reported; raise ``RuntimeError`` otherwise (another writer interfered)."""
    expected = [_part(root, i) for i in range(len(results))]
    present = set(fs.glob(f"{root}/part.*"))
    if present != set(expected):
        extra, missing = sorted(present - set(expected)), sorted(set(expected) - present)
        raise RuntimeError(f"{path} changed while it was written (missing {missing[:3]}, extra {extra[:3]}); "
                           "is another job writing to the same folder?")

    def read(file: str) -> tuple[int, dict]:
        with fs.open(file, "rb") as f:
            return _footer(f)

    with ThreadPoolExecutor(max_workers=min(16, max(1, len(expected)))) as pool:
        footers = list(pool.map(read, expected))
    for file, (rows, record), result in zip(expected, footers, results):
        if record.get("key") != result["key"] or rows != result["rows"]:
            raise RuntimeError(f"{file} holds {rows} rows of key {str(record.get('key'))[:12]}, not the "
                               f"{result['rows']} rows of key {result['key'][:12]} this write made; "
                               f"is another job writing to {path}?")


def _atomic_write(fs, target: str, data: bytes) -> None:
    tmp = f"{target.rsplit('/', 1)[0]}/.tmp-{uuid.uuid4().hex}-{target.rsplit('/', 1)[1]}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    fs.mv(tmp, target)
