"""Reading a job's input, a file, a folder or a glob of parquet, CSV or JSON Lines, into Dask.

Any fsspec URL works (local paths, ``s3://``, ``gs://``...) with ``storage_options``. The
format comes from the file extensions (``.parquet``/``.pq``, ``.csv``, ``.jsonl``/``.ndjson``/
``.json``), or is given. Problems (nothing at the path, mixed or unknown formats, a file
that does not parse) raise ``InputError`` naming the path, before any model runs.
"""

from __future__ import annotations

import math

import dask
import dask.dataframe as dd
import fsspec

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".parq": "parquet", ".csv": "csv", ".jsonl": "json",
           ".ndjson": "json", ".json": "json"}


class InputError(ValueError):
    """The job's input cannot be found or read."""


def input_files(path: str, storage_options: dict | None = None) -> tuple[object, list[str]]:
    """The filesystem and the data files at ``path`` (a file, a folder, or a glob)."""
    try:
        fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
    except (ValueError, TypeError, ImportError) as exc:
        raise InputError(f"cannot open {path!r}: {exc}") from None
    if any(c in root for c in "*?["):
        files = fs.glob(root)
    elif fs.isdir(root):
        files = [f for f in fs.find(root) if not _hidden(f, root)]
    elif fs.exists(root):
        files = [root]
    else:
        raise InputError(f"input not found: {path}")
    files = sorted(f for f in files if fs.isfile(f))
    if not files:
        raise InputError(f"no input files at {path}")
    return fs, files


def _hidden(file: str, root: str) -> bool:
    rel = file[len(root.rstrip("/")) + 1:]
    return any(part.startswith((".", "_")) for part in rel.split("/"))


def detect_format(files: list[str]) -> str:
    """``parquet``, ``csv`` or ``json`` from the files' extensions (all must agree)."""
    found = set()
    for f in files:
        ext = "." + f.rsplit(".", 1)[-1].lower() if "." in f.rsplit("/", 1)[-1] else ""
        if ext not in FORMATS:
            raise InputError(f"cannot tell the format of {f} from its extension; give --format parquet|csv|json")
        found.add(FORMATS[ext])
    if len(found) > 1:
        raise InputError(f"the input mixes formats {sorted(found)}; point at one kind of file or give --format")
    return found.pop()


def read_input(path: str, *, fmt: str | None = None, storage_options: dict | None = None) -> dd.DataFrame:
    """A lazy Dask dataframe of the input at ``path`` (its schema is read now, its rows later)."""
    fs, files = input_files(path, storage_options)
    fmt = fmt or detect_format(files)
    urls = [fs.unstrip_protocol(f) for f in files]
    opts = {"storage_options": storage_options} if storage_options else {}
    try:
        if fmt == "parquet":
            return dd.read_parquet(urls, **opts)
        if fmt == "csv":
            return dd.read_csv(urls, blocksize=None, **opts)
        if fmt == "json":  # keep nested values (conversations) as Python objects, not their repr as strings
            with dask.config.set({"dataframe.convert-string": False}):
                return dd.read_json(urls, lines=True, blocksize=None, **opts)
    except Exception as exc:  # a file that does not parse: name it, no traceback
        raise InputError(f"cannot read {path} as {fmt}: {type(exc).__name__}: {exc}") from None
    raise InputError(f"unknown format {fmt!r}; use parquet, csv or json")


def repartition(ddf: dd.DataFrame, *, partition_size: int | None = None,
                npartitions: int | None = None) -> dd.DataFrame:
    """Split ``ddf`` into ``npartitions``, or into partitions of about ``partition_size`` rows
    (this counts the rows once). Each partition is one task, one resumable output file."""
    if npartitions is not None:
        if npartitions < 1:
            raise ValueError(f"--npartitions must be >= 1, got {npartitions}")
        return ddf.repartition(npartitions=npartitions)
    if partition_size is None:
        return ddf
    if partition_size < 1:
        raise ValueError(f"--partition-size must be >= 1, got {partition_size}")
    rows = int(ddf.map_partitions(len).sum().compute())
    return ddf.repartition(npartitions=max(1, math.ceil(rows / partition_size)))
