"""Writing accessor and processor results to parquet partition by partition, atomically and resumably.

``write_parquet(result, path, resume=True)`` takes the direct result of a Dask ``.llm``
call (``ddf.llm.generate(...)`` etc.) or of a processor (``build_processor(...)(ddf)``).
Both map their source frame's partitions with a
:class:`~dfllm.accessors.partitions.WritableFunction`, whose ``write_key`` names what
decides a partition's output besides its rows: the accessor's task (every field of it,
through :func:`dfllm.tasks.write_key.canonical`); the processor's config, output types
and fingerprints of ``preprocess`` and ``postprocess`` (see :mod:`dfllm.jobs.processor`).
The models' files enter each partition's key too (:mod:`dfllm.models.identity`), so new
weights copied into the same folder recompute.

**One schema per write.** Before the first part, the write decides its Arrow schema (see
:mod:`dfllm.accessors.arrow_schema`): the task's output columns as its ``meta`` types them,
the passthrough columns as the source's ``meta`` types them, and a column that ``meta``
holds only as ``object`` by the types of its values over the whole source (one pass over
those columns; ``persist()`` an expensive source). Every part, the empty ones included, is
converted to that schema, and ``_common_metadata`` records it. A value that does not fit
its column's type is null in the part and its row gets an error (in ``llm_error``, or the
processor's error column) naming the column and the value; the row's other columns are
kept, the partition never fails for it.

It writes ``part.NNNNN.parquet`` files through fsspec (local paths, ``s3://``, any fsspec
URL with ``storage_options``), one per partition of the input, numbered from 0. Each part
is written to a temporary name and moved into place, then ``_dfllm_keys/part.NNNNN.key``
(a folder parquet readers skip) records what produced it: a hash of the partition's input
rows (index and values) and of the write key, with its row, error and token counts. The
part's own parquet footer carries the same record (key-value metadata ``dfllm``), so a part
always says what it holds, and that dfllm wrote it.

**Paths are literal**, never glob patterns, and **dfllm deletes only what it wrote**: parts
whose footer carries its record, its key files and temporary files. A folder holding any
other file a parquet reader would read (another tool's ``part.0.parquet``, a CSV, a
``_metadata`` file that dfllm did not write) is refused before any work, and so is an
output folder that is the input's folder, inside it, or holds it, and a response cache in
the output folder or an input folder (:func:`refuse_cache_overlap`).

Resume is exact: when ``write_parquet`` returns, the folder holds exactly one part per
partition of this write, each the output of that partition under this task, so a reader
reads every input row exactly once, whatever the partitioning, row order or task of the
earlier writes to the folder.

- ``resume=False`` removes every earlier dfllm part and key first and computes everything.
- ``resume=True`` keeps partition ``i`` when ``part.i``'s key record and its footer both
  name this partition's key (a kept part whose schema differs from this write's is
  converted to it, without the engine). A partition whose rows an earlier write put under
  another number (reordered partitions, new input files ahead of the old ones) is copied
  from that part, checked by its footer, rather than recomputed; before a task replaces an
  earlier part of other rows it moves it to ``_dfllm_keys/set-aside/`` so that the
  partition now holding those rows can still copy it. Anything else (a missing, partial or
  corrupt part or key record, changed rows or partition bounds, a changed task, model or
  processor) is recomputed.
- At the end, dfllm parts and keys of numbers this write does not have, set-aside parts and
  temporary files of writes that never finished are removed. Then the parts' footers are
  read back: there must be exactly this write's parts, each with the key and row count its
  task reported, so the summary's ``rows`` is what a reader reads; otherwise (another job
  wrote to the folder meanwhile) ``write_parquet`` raises ``RuntimeError``.

**Budgets.** With ``budget=`` (a :class:`~dfllm.accessors.budget.Budget` of prompt and/or
generated tokens), once the partitions this write computed have used a bound no new
partition starts: the partitions already running finish and are written, the others are
not started (see :mod:`dfllm.accessors.budget`). A budgeted write runs without prefix-aware
placement (:mod:`dfllm.accessors.prefix_placement`): a routed partition's task leaves its
thread while its rows run, so more partitions would start before the budget is reached.
Such a write stops there: the end-of-write cleanup above is skipped (earlier parts, key
records and set-aside parts stay, for the resumed write to keep or copy), every finished
part is checked by its footer, and the summary says why it stopped (``stopped``) and how
many partitions it did not write (``missing``). The folder then may hold earlier parts
beside this write's, as after a failed write; ``resume=True`` finishes it, exact.

A write that fails part-way leaves a mix of old and new parts (a reader may then see some
rows twice or not at all); run it again with ``resume=True`` to make the folder exact
without redoing the finished partitions. Two jobs must not write to the same folder at
once. Only one partition per task is in memory at a time, so datasets far larger than the
workers' memory stream through.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import dask
import fsspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dfllm.accessors.arrow_schema import INDEX, conform, job_schema, unify_counts, value_types
from dfllm.accessors.budget import Budget, Gate
from dfllm.accessors.partitions import WritableFunction, llm_origin
from dfllm.tasks.schema import NUM_GENERATED_TOKENS, NUM_INPUT_TOKENS
from dfllm.tasks.write_key import model_key

KEYS = "_dfllm_keys"
FOOTER_KEY = b"dfllm"  # the part's record in its parquet footer's key-value metadata
SET_ASIDE = f"{KEYS}/set-aside"  # earlier parts replaced during a resumed write, by key, until it ends
COMMON_METADATA = "_common_metadata"  # the write's schema, with FOOTER_KEY saying dfllm wrote it
KEY_PATTERN = re.compile(r"[0-9a-f]{64}")  # what partition_key gives
PART = re.compile(r"part\.(\d{5,})\.parquet")  # a part's name (relative to the folder)
KEY_FILE = re.compile(r"part\.(\d{5,})\.key")
SET_ASIDE_FILE = re.compile(r"[0-9a-f]{64}\.parquet")
TEMPORARY = re.compile(r"\.tmp-[0-9a-f]+-part\.\d{5,}\.(parquet|key)")


@dataclass
class WriteSummary:
    """What a write did: partitions written and skipped, rows, rows with ``llm_error``,
    prompt and generated tokens (generation tasks; 0 otherwise) and wall seconds.
    Skipped partitions count with the figures recorded when they were written; ``rows``
    is checked against the parts' footers, so it is what a reader of ``path`` reads.
    A write stopped by its budget says why in ``stopped`` (None: it ran to the end), and
    ``missing`` is how many of its partitions it did not write (``resume=True`` does them);
    its figures are those of the partitions it finished."""

    path: str
    partitions: int
    written: int
    skipped: int
    rows: int
    errors: int
    input_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    stopped: str | None = None
    missing: int = 0


def write_parquet(
    result,
    path: str,
    *,
    resume: bool = False,
    storage_options: dict | None = None,
    progress: bool = True,
    resources: dict | None = None,
    on_partition: Callable[[int, dict], None] | None = None,
    budget: Budget | None = None,
) -> WriteSummary:
    """Write the lazy result of a Dask ``.llm`` call or of a processor
    (:func:`dfllm.build_processor`) to a parquet dataset at ``path``.

    Every part carries one Arrow schema, decided before the first (a value that does not
    fit its column is that row's error). With ``resume=True`` finished partitions of an
    earlier write are kept and the rest computed; either way the folder ends with one part
    per partition of this result and nothing else a reader reads (see the module
    docstring). ``resources`` (on a distributed cluster) restricts every task of the write
    to workers that declare them, e.g. ``{"GPU": 0.25}`` to run on GPU workers with four
    tasks feeding each worker's engine at once (see :func:`dfllm.jobs.cluster.task_resources`).

    ``on_partition(i, record)`` is called on the client as each partition's part is in place
    (written or kept), in the order they finish, with its record (``key``, ``rows``,
    ``errors``, token counts, ``written``): ``dfllm run-batch`` streams the parts into its
    JSONL output while the others run. Parts are checked once more when all are done.

    ``budget`` (a :class:`~dfllm.accessors.budget.Budget`) bounds the prompt and generated
    tokens of the partitions this write computes: once reached, no new partition starts and
    the write returns with ``stopped`` and ``missing`` set, its finished parts in place for
    ``resume=True`` (see the module docstring).
    """
    start = time.perf_counter()
    origin = llm_origin(result)
    if origin is None:
        raise ValueError(
            "write_parquet takes the direct result of a Dask .llm call (ddf.llm.generate(...) etc.) "
            "or of a processor (build_processor(...)(ddf)); for other frames use their own to_parquet"
        )
    source, func = origin
    write_key = func.write_key  # before any work: a processor whose functions have no stable key raises
    resources = resources or func.resources  # the call's resources unless overridden here
    fs, root = folder_filesystem(path, storage_options)
    refuse_overlap(input_paths(source), path, storage_options)
    refuse_cache_overlap(func.response_cache(), input_paths(source), path, storage_options)
    ours = survey_parts(fs, root, path)
    schema = decide_schema(result, source, func)
    fs.makedirs(root, exist_ok=True)
    fs.makedirs(f"{root}/{KEYS}", exist_ok=True)
    if not resume:
        remove_files(
            fs,
            ours
            + _listing(fs, f"{root}/{KEYS}", KEY_FILE)
            + _listing(fs, root, TEMPORARY)
            + _listing(fs, f"{root}/{SET_ASIDE}", SET_ASIDE_FILE),
        )
    earlier = dask.delayed(_earlier_parts(fs, root) if resume else {}, traverse=False)  # one graph key
    parts = source.to_delayed()
    run = uuid.uuid4().hex[:8]
    gate = Gate(budget, _client() is not None) if budget else None
    if gate is not None:  # a routed partition leaves its thread while its rows run: more would start
        func = func.without_placement()
    jobs = [
        dask.delayed(_write_partition, pure=False)(
            p,
            func,
            write_key,
            path,
            i,
            storage_options,
            resume,
            earlier,
            schema,
            gate,
            dask_key_name=f"llm-write-{func.kind}-{i}-{run}",
        )
        for i, p in enumerate(parts)
    ]
    if budget and gate is not None:
        try:
            found, stopped = _compute_budgeted(jobs, progress, resources, gate, on_partition)
        finally:
            gate.forget()
    else:
        found, stopped = compute_in_order(jobs, progress, resources, on_result=on_partition), None
    results = [r for r in found if r is not None and not r.get("stopped")]  # the partitions finished
    fs.invalidate_cache(root)  # listings cached before the workers wrote (s3fs, gcsfs...)
    missing = len(parts) - len(results)
    if not missing:
        stopped = None  # the budget was reached by the last partitions: the write is complete
        _remove_leftovers(fs, root, len(parts))
    _write_common_metadata(fs, root, schema)
    _check_written(fs, root, path, [r if r is not None and not r.get("stopped") else None for r in found])
    return WriteSummary(
        path,
        len(parts),
        sum(r["written"] for r in results),
        sum(not r["written"] for r in results),
        sum(r["rows"] for r in results),
        sum(r["errors"] for r in results),
        sum(r.get("input_tokens", 0) for r in results),
        sum(r.get("output_tokens", 0) for r in results),
        time.perf_counter() - start,
        stopped,
        missing,
    )


def compute_in_order(
    jobs,
    progress: bool,
    resources: dict | None = None,
    desc: str = "llm partitions",
    on_result: Callable[[int, dict], None] | None = None,
) -> list:
    """The jobs' results in order; ``on_result(i, result)`` as each finishes."""
    try:
        from distributed import as_completed, default_client

        client = default_client()
    except (ImportError, ValueError):
        client = None
    if client is None:
        done = list(dask.compute(*jobs))
        if on_result is not None:
            for i, result in enumerate(done):
                on_result(i, result)
        return done
    from tqdm.auto import tqdm

    futures = client.compute(jobs, resources=resources)
    order = {f.key: i for i, f in enumerate(futures)}
    out: list = [None] * len(futures)
    for fut in tqdm(as_completed(futures), total=len(futures), desc=desc, disable=not progress):
        out[order[fut.key]] = fut.result()
        if on_result is not None:
            on_result(order[fut.key], out[order[fut.key]])
    return out


def _client():
    """The default distributed client, or None."""
    try:
        from distributed import default_client

        return default_client()
    except (ImportError, ValueError):
        return None


def _compute_budgeted(
    jobs, progress: bool, resources: dict | None, gate: Gate, on_result: Callable[[int, dict], None] | None = None
) -> tuple[list, str | None]:
    """The write jobs' results in order (None for a job cancelled, ``{"stopped": True}`` for
    one that started after the budget was reached) and why the budget stopped the write
    (None: it was not reached). The jobs keep ``gate``'s totals themselves; once it closes,
    the jobs no worker has started are cancelled."""
    client = _client()
    if client is None:  # the local scheduler: jobs starting after the gate closed return at once
        out = list(dask.compute(*jobs))
        for i, result in enumerate(out):
            if on_result is not None and not result.get("stopped"):
                on_result(i, result)
    else:
        from distributed import as_completed
        from tqdm.auto import tqdm

        futures = client.compute(jobs, resources=resources)
        order = {f.key: i for i, f in enumerate(futures)}
        out = [None] * len(futures)
        cancelled = False
        with tqdm(total=len(futures), desc="llm partitions", disable=not progress) as bar:
            for fut in as_completed(futures):
                if fut.cancelled():
                    continue
                i = order[fut.key]
                out[i] = fut.result()
                if out[i].get("stopped"):
                    continue
                bar.update()
                if on_result is not None:
                    on_result(i, out[i])
                if not cancelled and gate.closed():
                    cancelled = True
                    unstarted = set(
                        client.run_on_scheduler(_not_started, keys=[f.key for f in futures if not f.done()])
                    )
                    client.cancel([f for f in futures if f.key in unstarted])
    return out, gate.budget.reached(*gate.spent())


def _not_started(keys: list, dask_scheduler=None) -> list:
    """Of these task keys, those no worker has started (run on the scheduler)."""
    tasks = dask_scheduler.tasks
    return [k for k in keys if k not in tasks or tasks[k].state not in ("processing", "memory", "erred")]


# ---- the write's schema --------------------------------------------------------------------------------
def decide_schema(result, source, func: WritableFunction) -> pa.Schema:
    """The Arrow schema of every part of ``result``'s write (see the module docstring).
    Columns the result holds as ``object`` that come from the source are typed by their
    values over the whole source (through an earlier ``.llm`` result's declared types
    first, so that no model runs for this)."""
    meta = result._meta
    types = dict(func.arrow_types())
    inner = source
    while True:  # passthrough columns of a chained .llm result keep that result's declared types
        origin = llm_origin(inner)
        if origin is None:
            break
        inner, inner_func = origin
        for column, t in inner_func.arrow_types().items():
            types.setdefault(column, t)
    unknown = [c for c in meta.columns if meta[c].dtype == object and c not in types and c in inner._meta.columns]
    if meta.index.dtype == object:
        unknown.append(INDEX)
    if unknown:
        types.update(_source_types(inner, unknown))
    return as_stored(job_schema(meta, types))


def as_stored(schema: pa.Schema) -> pa.Schema:
    """``schema`` as a parquet file gives it back (lists' items named ``element``...), so
    that a part read back compares equal to the schema it was written in."""
    buf = io.BytesIO()
    pq.write_metadata(schema, buf)
    buf.seek(0)
    return pq.read_schema(buf)


def _source_types(frame, columns: list) -> dict:
    """Column -> the unified Arrow type of its values over every partition of ``frame``."""
    cols = [c for c in columns if c != INDEX]
    jobs = [dask.delayed(_partition_types, pure=True)(p, columns) for p in frame[cols].to_delayed()]
    totals: dict = {c: Counter() for c in columns}
    for counts in compute_in_order(jobs, progress=False, desc="llm schema"):
        for c, found in counts.items():
            totals[c].update(found)
    return {c: t for c, t in ((c, unify_counts(n)) for c, n in totals.items()) if t is not None}


def _partition_types(df: pd.DataFrame, columns: list) -> dict:
    return {c: value_types(df.index if c == INDEX else df[c]) for c in columns}


# ---- keys ----------------------------------------------------------------------------------------------
def partition_key(df: pd.DataFrame, write_key: str) -> str:
    """Hash of a partition's input rows (index and values) and of the write key (what,
    besides the rows, decides the output: see :class:`WritableFunction`). Nested values
    (lists, dicts, structs, maps: conversations) count by their canonical JSON text."""
    h = hashlib.sha256(write_key.encode())
    h.update(_column_hash(pd.Series(df.index, index=df.index)))
    for c in df.columns:
        h.update(str(c).encode("utf-8", "surrogatepass") + b"\0" + _column_hash(df[c]))
    return h.hexdigest()


def _column_hash(series: pd.Series) -> bytes:
    """A column's values, with its dtype: pandas' hash of a value ignores its type and time
    zone (``True`` and ``1``, one instant in two zones, ``-0.0`` and ``0.0`` hash alike),
    which a prompt's text does not (``"True"``/``"1"``, each zone's clock, ``"-0.0"``)."""
    dtype = str(series.dtype).encode() + b"\0"
    flat = series.dtype != object and not (
        isinstance(series.dtype, pd.ArrowDtype) and pa.types.is_nested(series.dtype.pyarrow_dtype)
    )
    if flat:
        try:
            values = pd.util.hash_pandas_object(series, index=False).values.tobytes()
            if series.dtype.kind == "f":  # the sign of a zero
                values += np.signbit(series.to_numpy(dtype="float64", na_value=np.nan)).tobytes()
            return dtype + values
        except (TypeError, ValueError, pa.ArrowException):
            pass
    texts = "\n".join(_canonical(v) for v in series.tolist())
    return dtype + hashlib.sha256(texts.encode("utf-8", "surrogatepass")).digest()


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v))


def folder_filesystem(path: str, storage_options: dict | None) -> tuple:
    """The fsspec filesystem and root folder of ``path``, with no listing cached from before."""
    fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
    root = root.rstrip("/")
    fs.invalidate_cache(root)
    return fs, root


def part_path(root: str, i: int) -> str:
    return f"{root}/part.{i:05d}.parquet"


def key_path(root: str, i: int) -> str:
    return f"{root}/{KEYS}/part.{i:05d}.key"


def _set_aside(root: str, key: str) -> str:
    return f"{root}/{SET_ASIDE}/{key}.parquet"


# ---- one partition ----------------------------------------------------------------------------------------
def _write_partition(
    df: pd.DataFrame,
    func: WritableFunction,
    write_key: str,
    path: str,
    i: int,
    storage_options,
    resume: bool,
    earlier: dict[str, list[str]],
    schema: pa.Schema,
    gate: Gate | None = None,
) -> dict:
    """Write, keep, or copy from an earlier part, partition ``i``'s part; returns its record
    (key, row, error and token counts) and ``written`` (False if it was not recomputed).
    Once the write's budget ``gate`` is closed a partition does nothing (not even keep or
    copy an earlier part): ``{"stopped": True}``.

    Only this task changes ``part.i`` and its key; before replacing an earlier part of
    other rows it sets that part aside, so another partition of this write that holds
    those rows can still copy it (``earlier``: key -> where an earlier write put it)."""
    if gate is not None and gate.closed():
        return {"stopped": True}
    fs, root = folder_filesystem(path, storage_options)
    key = partition_key(df, f"{write_key}\0models={model_key(func.model_sources())}")
    if resume:
        kept = _kept_part(fs, root, i, key, schema)
        if kept is not None:
            return {**kept, "written": False}
        found = _earlier_part(fs, earlier.get(key, []), key, schema)
        if found is not None:
            data, record = found
            _replace_part(fs, root, i, data, record, resume)
            return {**record, "written": False}
    out = func(df)
    table, problems = conform(out, schema)
    errors = _error_count(table, func.error_column, problems)
    if problems:
        table = _with_errors(table, func.error_column, problems)
    record = {
        "key": key,
        "rows": table.num_rows,
        "errors": errors,
        "input_tokens": _total(out, NUM_INPUT_TOKENS),
        "output_tokens": _total(out, NUM_GENERATED_TOKENS),
    }
    _replace_part(fs, root, i, _parquet_bytes(table, record), record, resume)
    if gate is not None:  # before returning: a partition starting next on this thread sees the budget
        gate.spend(record["input_tokens"], record["output_tokens"])
    return {**record, "written": True}


def _with_errors(table: pa.Table, column: str | None, problems: dict[int, str]) -> pa.Table:
    """``table`` with each row's conversion problems joined to its error column's message;
    ``ValueError`` naming the first where the output has no error column."""
    if column is None or column not in table.column_names:
        row, message = min(problems.items())
        raise ValueError(f"row {row} of the partition: {message} (the output has no error column to record it in)")
    at = table.column_names.index(column)
    old = table.column(at).to_pylist()
    new = [
        problems[i] if i in problems and old[i] is None else f"{old[i]}; {problems[i]}" if i in problems else old[i]
        for i in range(len(old))
    ]
    return table.set_column(at, table.schema.field(at), pa.array(new, type=table.schema.field(at).type))


def _error_count(table: pa.Table, column: str | None, problems: dict[int, str]) -> int:
    if column is None or column not in table.column_names:
        return 0
    present = table.column(column).is_valid().to_pylist()
    return sum(1 for i, valid in enumerate(present) if valid or i in problems)


def _parquet_bytes(table: pa.Table, record: dict) -> bytes:
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), FOOTER_KEY: json.dumps(record).encode()})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def _kept_part(fs, root: str, i: int, key: str, schema: pa.Schema) -> dict | None:
    """Part ``i``'s record if both its key record and its footer name ``key``, else None.
    A kept part of another schema is converted to ``schema`` in place (None if it cannot be)."""
    try:
        with fs.open(key_path(root, i), "r") as f:
            recorded = json.load(f)
        if not isinstance(recorded, dict) or recorded.get("key") != key:
            return None
        with fs.open(part_path(root, i), "rb") as f:
            rows, record, found = _footer(f)
    # not a record (RecursionError: nested deeper than Python reads): the part is recomputed
    except (FileNotFoundError, ValueError, RecursionError, OSError, pa.ArrowException):
        return None
    if record.get("key") != key:
        return None
    record = {**record, "rows": rows}
    if not found.equals(schema):
        data = _converted(fs.cat_file(part_path(root, i)), schema, record)
        if data is None:
            return None
        _atomic_write(fs, part_path(root, i), data)
    return record


def _earlier_part(fs, places: list[str], key: str, schema: pa.Schema) -> tuple[bytes, dict] | None:
    """The bytes (in ``schema``) and record of an earlier part made from ``key``, from the
    first of ``places`` whose file (read whole, then checked by its footer) holds it."""
    for place in places:
        try:
            data = fs.cat_file(place)
            rows, record, found = _footer(io.BytesIO(data))
        except (FileNotFoundError, ValueError, OSError, pa.ArrowException):
            continue
        if record.get("key") == key:
            record = {**record, "rows": rows}
            if not found.equals(schema):
                data = _converted(data, schema, record)
                if data is None:
                    continue
            return data, record
    return None


def _converted(data: bytes, schema: pa.Schema, record: dict) -> bytes | None:
    """An earlier part of another schema, converted to ``schema`` (None if a value does not fit)."""
    try:
        table = pq.read_table(io.BytesIO(data))
        if sorted(table.schema.names) != sorted(schema.names):
            return None
        table = table.select(schema.names).cast(pa.schema(list(schema), metadata=table.schema.metadata))
    except (pa.ArrowException, ValueError, TypeError):
        return None
    table = table.replace_schema_metadata(schema.metadata)
    return _parquet_bytes(table, {k: v for k, v in record.items() if k != "rows"} | {"rows": record["rows"]})


def _replace_part(fs, root: str, i: int, data: bytes, record: dict, set_aside: bool) -> None:
    """Move ``data`` into place as part ``i`` and record its key (both atomically). With
    ``set_aside`` an earlier part ``i`` of other rows is first moved under ``_dfllm_keys``
    (a move keeps the file in one place or the other at every moment)."""
    part = part_path(root, i)
    if set_aside:
        try:
            with fs.open(part, "rb") as f:
                old = _footer(f)[1].get("key")
        except (FileNotFoundError, ValueError, OSError, pa.ArrowException):
            old = None
        if isinstance(old, str) and KEY_PATTERN.fullmatch(old) and old != record["key"]:
            fs.makedirs(f"{root}/{SET_ASIDE}", exist_ok=True)
            _move(fs, part, _set_aside(root, old))
    _atomic_write(fs, part, data)
    _atomic_write(fs, key_path(root, i), json.dumps(record).encode())


def _footer(f) -> tuple[int, dict, pa.Schema]:
    """A part's row count, its dfllm record ({} if none) and its Arrow schema (no metadata
    but pandas'), from its parquet footer."""
    meta = pq.read_metadata(f)
    raw = (meta.metadata or {}).get(FOOTER_KEY)
    try:
        record = json.loads(raw) if raw else {}
    except (ValueError, RecursionError):  # not a record (RecursionError: nested past Python's limit)
        record = {}
    schema = meta.schema.to_arrow_schema()
    schema = schema.with_metadata({k: v for k, v in (schema.metadata or {}).items() if k == b"pandas"})
    return meta.num_rows, record if isinstance(record, dict) else {}, schema


def _earlier_parts(fs, root: str) -> dict[str, list[str]]:
    """Key -> where parts an earlier write made from it may be: the part its key record
    names (unless replaced meanwhile), then the set-aside folder. Read once, on the client."""
    found: dict[str, list[str]] = {}
    for stashed in _listing(fs, f"{root}/{SET_ASIDE}", SET_ASIDE_FILE):
        found[stashed.rsplit("/", 1)[1][: -len(".parquet")]] = [stashed]
    files = _listing(fs, f"{root}/{KEYS}", KEY_FILE)

    def read(file: str) -> bytes | None:
        try:
            return fs.cat_file(file)  # one file by its literal name (fs.cat would expand a pattern)
        except (FileNotFoundError, OSError):
            return None

    with ThreadPoolExecutor(max_workers=min(16, max(1, len(files)))) as pool:
        contents = list(pool.map(read, files))
    for file, data in zip(files, contents):
        match = KEY_FILE.fullmatch(file.rsplit("/", 1)[1])
        try:
            recorded = json.loads(data) if data is not None else None
        except (ValueError, RecursionError):  # not a record: its part is recomputed
            continue
        key = recorded.get("key") if isinstance(recorded, dict) else None
        if match and isinstance(key, str) and KEY_PATTERN.fullmatch(key):
            found[key] = [part_path(root, int(match.group(1))), _set_aside(root, key)]
    return found


def _total(df: pd.DataFrame, column: str) -> int:
    """The sum of a numeric column (nulls skipped), else 0."""
    return int(df[column].sum()) if column in df and pd.api.types.is_numeric_dtype(df[column].dtype) else 0


# ---- the folder: what is dfllm's, and what it may delete ------------------------------------------------
def _number(name: re.Pattern, path: str) -> int:
    """The partition number in the name of a file that :func:`_listing` found with ``name``."""
    match = name.fullmatch(path.rsplit("/", 1)[-1])
    assert match is not None, path
    return int(match.group(1))


def _listing(fs, folder: str, name: re.Pattern) -> list[str]:
    """The files directly in ``folder`` whose names match ``name`` (a literal listing, no glob)."""
    try:
        entries = fs.ls(folder, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(
        e["name"].rstrip("/")
        for e in entries
        if e.get("type") != "directory" and name.fullmatch(e["name"].rstrip("/").rsplit("/", 1)[-1])
    )


def _visible(name: str) -> bool:
    """Whether parquet readers (pyarrow, Dask) read the file ``name`` (relative to the
    dataset's folder) as part of the dataset: not under a ``.`` or ``_`` name."""
    return not any(p.startswith((".", "_")) for p in name.split("/"))


def _is_ours(fs, file: str) -> bool:
    """Whether a parquet file's footer carries dfllm's record (dfllm wrote it)."""
    return _footer_says_ours(fs, file) is True


def _footer_says_ours(fs, file: str) -> bool | None:
    """Whether a parquet file's footer carries dfllm's record; None when it has no readable
    footer (a file cut short, or not parquet at all)."""
    try:
        with fs.open(file, "rb") as f:
            return FOOTER_KEY in (pq.read_metadata(f).metadata or {})
    except (FileNotFoundError, ValueError, OSError, pa.ArrowException):
        return None


def _damaged_part_of_ours(fs, root: str, name: str) -> bool:
    """Whether a part without a readable footer is one dfllm wrote: its key record, which
    only dfllm writes and which is written after the part itself, is there (parts are
    written whole by a move, so only damage afterwards cuts one short)."""
    match = PART.fullmatch(name)
    return match is not None and fs.exists(key_path(root, int(match.group(1))))


def survey_parts(fs, root: str, path: str) -> list[str]:
    """The parts dfllm wrote in the folder; raise ``ValueError`` if it holds any other file a
    reader would read (another tool's parts, a foreign ``_metadata``): they would be read back
    with the results, and dfllm deletes nothing it did not write."""
    if not fs.exists(root):
        return []
    if not fs.isdir(root):
        raise ValueError(f"{path} is a file; write_parquet writes a folder of parquet parts")
    inside = [f[len(root) + 1 :] for f in fs.find(root) if f.startswith(root + "/")]
    parts = [f for f in inside if PART.fullmatch(f)]
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(parts)))) as pool:
        says = list(pool.map(lambda f: _footer_says_ours(fs, f"{root}/{f}"), parts))
    # a part cut short after dfllm wrote it is dfllm's (recomputed), not another tool's file
    ours = [f for f, mine in zip(parts, says) if mine or (mine is None and _damaged_part_of_ours(fs, root, f))]
    foreign = [
        f
        for f in inside
        if f.strip("/")
        and f not in ours
        and (_visible(f) or f in ("_metadata", COMMON_METADATA) and not _is_ours(fs, f"{root}/{f}"))
    ]
    if foreign:
        names = ", ".join(foreign[:3]) + (" ..." if len(foreign) > 3 else "")
        raise ValueError(
            f"{path} holds {len(foreign)} file(s) that dfllm did not write ({names}); a reader would "
            "read them with the results, and dfllm deletes only its own files: write to an empty or "
            "dfllm-only folder"
        )
    return [f"{root}/{f}" for f in ours]


def remove_files(fs, files: list[str]) -> None:
    """Delete these files, each by its literal name (``fs.rm`` would expand a pattern)."""
    for file in files:
        try:
            fs.rm_file(file)
        except FileNotFoundError:
            pass


def _move(fs, source: str, target: str) -> None:
    """Move one file by its literal names: ``os.replace`` on a local disk (atomic), else a
    copy then a delete (``fs.mv`` would expand a pattern in the name)."""
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(fs, LocalFileSystem):
        os.replace(fs._strip_protocol(source), fs._strip_protocol(target))
    else:
        fs.cp_file(source, target)
        fs.rm_file(source)


def _remove_leftovers(fs, root: str, partitions: int) -> None:
    """Once every partition of this write is done: delete dfllm's parts and keys of
    partitions this write does not have (an earlier write with more partitions), its
    set-aside parts, and its temporary files of writes that never finished."""
    stale = [f for f in _listing(fs, root, PART) if _number(PART, f) >= partitions and _is_ours(fs, f)]
    stale += [f for f in _listing(fs, f"{root}/{KEYS}", KEY_FILE) if _number(KEY_FILE, f) >= partitions]
    stale += _listing(fs, root, TEMPORARY) + _listing(fs, f"{root}/{KEYS}", TEMPORARY)
    stale += _listing(fs, f"{root}/{SET_ASIDE}", SET_ASIDE_FILE)
    remove_files(fs, stale)
    try:
        fs.rmdir(f"{root}/{SET_ASIDE}")  # empty now (a no-op on object stores)
    except (FileNotFoundError, OSError):
        pass


def _write_common_metadata(fs, root: str, schema: pa.Schema) -> None:
    """``_common_metadata``: the write's schema, marked as dfllm's."""
    buf = io.BytesIO()
    pq.write_metadata(schema.with_metadata({**(schema.metadata or {}), FOOTER_KEY: b"{}"}), buf)
    _atomic_write(fs, f"{root}/{COMMON_METADATA}", buf.getvalue())


def _check_written(fs, root: str, path: str, results: list[dict | None]) -> None:
    """Read the parts' footers back: exactly this write's parts, each with the key and row
    count its task reported; raise ``RuntimeError`` otherwise (another writer interfered).
    A write stopped by its budget (None for each partition it did not finish) checks only
    the parts it finished: the folder may hold others until it is resumed."""
    complete = all(r is not None for r in results)
    done = [(i, r) for i, r in enumerate(results) if r is not None]
    expected = [part_path(root, i) for i, _ in done]
    present = set(_listing(fs, root, PART))
    if not complete and not set(expected) <= present:
        raise RuntimeError(
            f"{path} changed while it was written (missing {sorted(set(expected) - present)[:3]}); "
            "is another job writing to the same folder?"
        )
    if complete and present != set(expected):
        extra, missing = sorted(present - set(expected)), sorted(set(expected) - present)
        raise RuntimeError(
            f"{path} changed while it was written (missing {missing[:3]}, extra {extra[:3]}); "
            "is another job writing to the same folder?"
        )

    def read(file: str) -> tuple[int, dict, pa.Schema]:
        with fs.open(file, "rb") as f:
            return _footer(f)

    with ThreadPoolExecutor(max_workers=min(16, max(1, len(expected)))) as pool:
        footers = list(pool.map(read, expected))
    for file, (rows, record, _), (_, result) in zip(expected, footers, done):
        if record.get("key") != result["key"] or rows != result["rows"]:
            raise RuntimeError(
                f"{file} holds {rows} rows of key {str(record.get('key'))[:12]}, not the "
                f"{result['rows']} rows of key {result['key'][:12]} this write made; "
                f"is another job writing to {path}?"
            )


def _atomic_write(fs, target: str, data: bytes) -> None:
    folder, name = target.rsplit("/", 1)
    tmp = f"{folder}/.tmp-{uuid.uuid4().hex}-{name}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    _move(fs, tmp, target)


# ---- the input is not the output ---------------------------------------------------------------------------
def input_paths(frame) -> list[str]:
    """The paths a Dask frame reads (best effort: Dask's readers' ``path``/``filename``
    operands and dfllm's own readers' ``input_paths``), as fsspec URLs or local paths."""
    found: list[str] = []
    expr = getattr(frame, "expr", None)
    if expr is None:
        return found
    for node in expr.walk():
        for name in ("path", "filename", "urlpath"):
            if name in getattr(node, "_parameters", ()):
                value = node.operand(name)
                found += [value] if isinstance(value, str) else [v for v in (value or ()) if isinstance(v, str)]
        func = node.operand("func") if "func" in getattr(node, "_parameters", ()) else None
        found += list(getattr(func, "input_paths", ()) or ())
    return found


def refuse_overlap(inputs: list[str], output: str, storage_options: dict | None = None) -> None:
    """``ValueError`` if the output folder is an input folder, inside it, or holds an input
    (a folder or a file): the output's parts would be read back as input, or the input's
    files taken for parts. A glob counts as the folder before its first pattern character."""
    if not inputs:
        return
    fs, out = fsspec.core.url_to_fs(output, **(storage_options or {}))
    out = normal_path(fs, out)
    for given in inputs:
        try:
            ifs, where = fsspec.core.url_to_fs(given, **(storage_options or {}))
        except (ValueError, TypeError, ImportError):
            continue
        if type(ifs) is not type(fs):
            continue
        where = normal_path(ifs, _static_prefix(ifs, where))
        inside = out == where or out.startswith(where + "/") and not ifs.isfile(where)
        if inside or where.startswith(out + "/"):
            raise ValueError(
                f"the output folder {output} overlaps the input {given}: write to a folder that is "
                "not the input's folder, not inside it and not holding it"
            )


def refuse_cache_overlap(cache, inputs: list[str], output: str, storage_options: dict | None = None) -> None:
    """``ValueError`` if the response cache (a :class:`~dfllm.tasks.response_cache.ResponseCache`
    or None) is the output folder or inside it (its entries, JSON files, would be read with
    the results and refuse the folder to the next write), or is an input folder or inside one
    (the job would write into the user's input, and a later read of it would take the
    entries for input rows). A cache holding the output or the input is fine: it writes and
    evicts only its entries' files."""
    if cache is None:
        return
    try:
        cfs, where = fsspec.core.url_to_fs(cache.url, **dict(cache.storage_options or {}))
    except (ValueError, TypeError, ImportError):
        return
    where = normal_path(cfs, where)
    for given, what in [(output, "output folder"), *((i, "input") for i in inputs)]:
        try:
            fs, folder = fsspec.core.url_to_fs(given, **(storage_options or {}))
        except (ValueError, TypeError, ImportError):
            continue
        if type(fs) is not type(cfs):
            continue
        if what == "input":  # an input glob's folder; the output is literal
            folder = _static_prefix(fs, folder)
        folder = normal_path(fs, folder)
        if what == "input" and fs.isfile(folder):
            continue  # a cache beside an input file adds nothing to it
        if where == folder or where.startswith(folder + "/"):
            raise ValueError(
                f"the response cache {cache.url} is inside the {what} {given}: its entries would be "
                f"{'read with the results' if what == 'output folder' else 'written into the input'}; "
                "put the cache in a folder of its own"
            )


def normal_path(fs, path: str) -> str:
    """A path without protocol or trailing slash; a local one absolute, links resolved."""
    from fsspec.implementations.local import LocalFileSystem

    path = fs._strip_protocol(path).rstrip("/")
    return os.path.realpath(path) if isinstance(fs, LocalFileSystem) else path


def _static_prefix(fs, path: str) -> str:
    """The part of a path before its first glob character, when it does not exist literally."""
    if not any(c in path for c in "*?[") or fs.exists(path):
        return path
    head = re.split(r"[*?\[]", path, maxsplit=1)[0]
    return head.rsplit("/", 1)[0] if "/" in head else head
