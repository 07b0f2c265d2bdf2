"""Reading a job's input, a file, a folder or a glob of parquet, CSV or JSON Lines, into Dask.

Any fsspec URL works (local paths, ``s3://``, ``gs://``...) with ``storage_options``. The
format comes from the file extensions (``.parquet``/``.pq``, ``.csv``, ``.jsonl``/``.ndjson``/
``.json``), or is given. A path that exists is taken literally (a folder called ``out[1]``
is that folder); only a path that does not exist is read as a glob. Problems (nothing at
the path, mixed or unknown formats, a file that does not parse) raise ``InputError``
naming the path, before any model runs.

The frame has one schema for all files, decided before any partition is read:

- parquet: the files' schemas (their footers) unified as pyarrow's
  ``unify_schemas(promote_options="permissive")`` does (a struct with other fields in
  another file gets the union of them, a column null throughout one file takes the others'
  type); files whose types cannot be unified are refused, naming the column and the two
  types. Columns are Arrow-backed (``dtype_backend="pyarrow"``), one partition per file
  (or per run of row groups of a large file).
- JSON Lines: every line is parsed once up front (on the cluster, if there is one) and
  each field's type unified over all files in the same way; a field whose values have no
  common type (text in one row, a list in the others) stays an ``object`` column, and the
  writer then types it by its most common kind of value (the other rows get an error
  naming the column). A field some of whose values are of its kind but do not convert to
  its type (a list mixing kinds among lists of numbers, an integer beyond 64 bits) is read
  as JSON text in every row and file (so is an integer of more digits than Python reads,
  as its digits); text holding a lone surrogate (valid JSON, no valid UTF-8) is read with
  that surrogate as its ``\\uXXXX`` escape, and bytes that are not UTF-8 as their ``\\xNN``
  escape, as in CSV. A UTF-8 byte-order mark at the start of a file is dropped. A line that
  is not a JSON object (or nests too deeply to read) refuses its file, naming the line. A
  file with no line (zero bytes, or blank lines only) has no row and no field. One
  partition per file.
- CSV: every file is read once up front (on the cluster, if there is one) for its columns'
  pandas types, unified by :func:`csv_types` (integers and floats give floats; any other
  difference, integers in one file and text in another, gives text, the cells as written);
  a column missing from a file is null there, bytes that are not UTF-8 are read as their
  ``\\xNN`` escape. A row with more fields than the header names refuses its file, naming
  the line (pandas would take the extra fields for the frame's index, losing every value).
  One partition per file.
- A parquet file with two columns of one name is refused, naming the column and the file.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import dask
import dask.dataframe as dd
import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dfllm.accessors.arrow_schema import settled, unify_counts, value_types
from dfllm.errors import printable
from dfllm.jobs.openai_batch import _find, _read_int, _TooLong

FORMATS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".parq": "parquet",
    ".csv": "csv",
    ".jsonl": "json",
    ".ndjson": "json",
    ".json": "json",
}


class InputError(ValueError):
    """The job's input cannot be found or read."""


def input_files(path: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """The filesystem and the data files at ``path`` (a file, a folder, or a glob)."""
    try:
        fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
    except (ValueError, TypeError, ImportError) as exc:
        raise InputError(f"cannot open {path!r}: {exc}") from None
    if any(c in root for c in "*?[") and not fs.exists(root):
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
    rel = file[len(root.rstrip("/")) + 1 :]
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
    if fmt == "parquet":
        return _read_parquet(fs, files, urls, path)
    if fmt == "json":
        return _read_jsonl(fs, files, urls, path)
    if fmt == "csv":
        return _read_csv(fs, files, urls, path)
    raise InputError(f"unknown format {fmt!r}; use parquet, csv or json")


# ---- parquet --------------------------------------------------------------------------------------------
ROW_GROUP_BYTES = 128 << 20  # a large file's partitions: runs of row groups of about this many bytes


def _read_parquet(fs, files: list[str], urls: list[str], path: str) -> dd.DataFrame:
    def footer(file: str):
        with fs.open(file, "rb") as f:
            return pq.read_metadata(f)

    try:
        with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
            footers = list(pool.map(footer, files))
    except Exception as exc:  # noqa: BLE001  (a file that is no parquet: name the problem, no traceback)
        raise InputError(f"cannot read {path} as parquet: {type(exc).__name__}: {exc}") from None
    schemas = [m.schema.to_arrow_schema().remove_metadata() for m in footers]  # pandas' metadata left out
    for file, schema in zip(files, schemas):
        twice = sorted({n for n in schema.names if schema.names.count(n) > 1})
        if twice:
            raise InputError(f"{file} has more than one column named {twice[0]!r}; a column's name must be unique")
    schema = unified(schemas, files)
    pieces = []
    for url, meta in zip(urls, footers):
        run: list[int] = []
        size = 0
        for g in range(meta.num_row_groups):
            if run and size + meta.row_group(g).total_byte_size > ROW_GROUP_BYTES:
                pieces.append((url, tuple(run)))
                run, size = [], 0
            run.append(g)
            size += meta.row_group(g).total_byte_size
        pieces.append((url, tuple(run)))
    reader = ParquetPieces(schema, fs, path)
    return dd.from_map(reader, pieces, meta=reader.empty(), enforce_metadata=False)


def unified(schemas: list[pa.Schema], files: list[str]) -> pa.Schema:
    """The files' schemas as one (pyarrow's permissive promotion); ``InputError`` naming the
    column, its two types and their files where they cannot be unified."""
    out = schemas[0]
    first = {f.name: files[0] for f in out}
    for schema, file in zip(schemas[1:], files[1:]):
        try:
            out = pa.unify_schemas([out, schema], promote_options="permissive")
        except (pa.ArrowException, TypeError) as exc:
            for f in schema:
                if f.name in out.names and out.field(f.name).type != f.type:
                    try:
                        pa.unify_schemas([pa.schema([out.field(f.name)]), pa.schema([f])], promote_options="permissive")
                    except (pa.ArrowException, TypeError):
                        raise InputError(
                            f"column {f.name!r} is {out.field(f.name).type} in "
                            f"{first.get(f.name, files[0])} but {f.type} in {file}; the input's files "
                            "must agree on each column's type"
                        ) from None
            raise InputError(f"the input's files have schemas that cannot be unified: {exc}") from None
        for f in schema:
            first.setdefault(f.name, file)
    return out


class ParquetPieces:
    """Reads one piece (a file's run of row groups) in the unified schema, Arrow-backed."""

    def __init__(self, schema: pa.Schema, fs, path: str):
        self.schema, self.fs, self.input_paths = schema, fs, [path]  # what the user named: see refuse_overlap

    def __call__(self, piece: tuple[str, tuple[int, ...]]) -> pd.DataFrame:
        url, groups = piece
        with self.fs.open(self.fs._strip_protocol(url), "rb") as f:
            table = pq.ParquetFile(f).read_row_groups(list(groups)) if groups else None
        columns = []
        for field in self.schema:
            if table is not None and field.name in table.column_names:
                columns.append(table.column(field.name).cast(field.type))
            else:
                columns.append(pa.nulls(0 if table is None else table.num_rows, field.type))
        return _frame(pa.Table.from_arrays(columns, schema=self.schema))

    def empty(self) -> pd.DataFrame:
        return _frame(self.schema.empty_table())


def _frame(table: pa.Table) -> pd.DataFrame:
    """Arrow-backed columns (categoricals stay pandas categoricals)."""
    return table.to_pandas(types_mapper=lambda t: None if pa.types.is_dictionary(t) else pd.ArrowDtype(t))


# ---- CSV ------------------------------------------------------------------------------------------------
def _read_csv(fs, files: list[str], urls: list[str], path: str) -> dd.DataFrame:
    """Each file read once up front (on the cluster, if there is one) for its columns' types,
    unified over all files (see :func:`csv_types`); one partition per file."""
    surveys = _cached_surveys(fs, files, _survey_csv, "CSV")
    reader = CsvFiles(csv_types(surveys), fs, path)
    with dask.config.set({"dataframe.convert-string": False}):  # the reader gives its own string columns
        return dd.from_map(reader, urls, meta=reader.empty(), enforce_metadata=False)


def _read_csv_file(fs, file: str, text: list[str] | None = None) -> pd.DataFrame:
    """One CSV file as pandas reads it (bytes that are not UTF-8 as their ``\\xNN`` escape),
    the columns in ``text`` as text. ``InputError`` naming the line where the file's rows
    have more fields than its header: pandas would take the extra first field(s) of every
    row for the frame's index and leave the named columns holding the wrong fields, or
    none (a row with more fields than the header among rows without is pandas' own error,
    which names its line too)."""
    with fs.open(file, "rb") as f:
        df = pd.read_csv(f, encoding="utf-8", encoding_errors="backslashreplace", dtype=dict.fromkeys(text or (), str))
    if not isinstance(df.index, pd.RangeIndex):  # pandas' implicit index: more fields than names
        raise InputError(_extra_fields(fs, file, len(df.columns)))
    return df


def _extra_fields(fs, file: str, names: int) -> str:
    """What is wrong with a CSV file whose rows have more fields than its ``names`` header
    names: the first such row's line (the line it starts on, counted from 1)."""
    import csv
    import io

    with fs.open(file, "rb") as f:
        lines = io.TextIOWrapper(f, encoding="utf-8-sig", errors="backslashreplace", newline="")
        reader = csv.reader(lines)
        start, header = 1, None
        for record in reader:
            if header is None and record:
                header = record
            elif header is not None and len(record) > names:
                return (
                    f"line {start} has {len(record)} fields but the header names {names} column(s); a row "
                    "may not have more fields than the header (give the extra field(s) a name in the header)"
                )
            start = reader.line_num + 1
    return f"its rows have more fields than the header names ({names}); give the extra field(s) a name in the header"


def _survey_csv(fs, file: str) -> dict | str:
    """Each column's pandas dtype (``None``: null throughout this file); or what is wrong."""
    try:
        df = _read_csv_file(fs, file)
    except InputError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001  (a file that does not parse: say why, no traceback)
        return f"{type(exc).__name__}: {exc}"
    return {str(c): (None if not df[c].notna().any() else str(df[c].dtype)) for c in df.columns}


def csv_types(surveys) -> dict[str, str]:
    """Column -> how every file's values are read: ``int64``, ``float64``, ``bool`` when the
    files agree (integers and floats: ``float64``; a column null throughout a file, or
    missing from it, takes the others' type, an integer or boolean one becoming ``float64``
    or text as pandas reads a column with empty cells), else ``text``: the cells as written."""
    found: dict[str, set] = {}
    gaps: set[str] = set()
    for survey in surveys:
        for name, dtype in survey.items():
            found.setdefault(name, set())
            if dtype is None:
                gaps.add(name)
            else:
                found[name].add(dtype)
    for survey in surveys:
        gaps.update(n for n in found if n not in survey)
    types = {}
    for name, kinds in found.items():
        if kinds <= {"int64", "float64"} and kinds:
            t = "float64" if "float64" in kinds or name in gaps else "int64"
        elif kinds == {"bool"} and name not in gaps:
            t = "bool"
        else:
            t = "text"
        types[name] = t
    return types


class CsvFiles:
    """Reads one CSV file in the unified types (:func:`csv_types`), every column there (null
    where the file lacks it)."""

    def __init__(self, types: dict[str, str], fs, path: str):
        self.types, self.fs, self.input_paths = types, fs, [path]

    def __call__(self, url: str) -> pd.DataFrame:
        text = [n for n, t in self.types.items() if t == "text"]
        df = _read_csv_file(self.fs, self.fs._strip_protocol(url), text)
        df.columns = [str(c) for c in df.columns]
        out = {}
        for name, t in self.types.items():
            if name not in df.columns:
                out[name] = pd.Series([None] * len(df), dtype=_csv_dtype(t))
            elif t == "text":
                out[name] = df[name].astype(object).where(df[name].notna(), None).astype(_csv_dtype(t))
            else:
                out[name] = df[name].astype(_csv_dtype(t))
        return pd.DataFrame(out, index=pd.RangeIndex(len(df)))

    def empty(self) -> pd.DataFrame:
        return pd.DataFrame({name: pd.Series([], dtype=_csv_dtype(t)) for name, t in self.types.items()})


def _csv_dtype(t: str):
    return pd.StringDtype("pyarrow") if t == "text" else t


def _cached_surveys(fs, files: list[str], survey, kind: str) -> tuple:
    """``survey(fs, file)`` of every file, run on the cluster if there is one, or their result
    for the same files (names, sizes, times) the last time: the command line builds its job
    twice (checked before its cluster starts, then on it). ``InputError`` naming a file that
    cannot be read as ``kind`` (its survey says what is wrong)."""
    stamp = (kind,) + tuple(
        (f, info.get("size"), str(info.get("mtime", info.get("LastModified", info.get("ETag")))))
        for f, info in ((f, fs.info(f)) for f in files)
    )
    surveys = _SURVEYS.get(stamp)
    if surveys is None:
        surveys = dask.compute(*[dask.delayed(survey)(fs, f) for f in files])
        _SURVEYS.clear()
        _SURVEYS[stamp] = surveys
    for file, found in zip(files, surveys):
        if isinstance(found, str):
            raise InputError(f"cannot read {file} as {kind}: {found}")
    return surveys


# ---- JSON Lines -----------------------------------------------------------------------------------------
def _read_jsonl(fs, files: list[str], urls: list[str], path: str) -> dd.DataFrame:
    surveys = _cached_surveys(fs, files, _survey_jsonl, "JSON Lines")
    columns: dict[str, Counter] = {}
    as_text: set[str] = set()
    for found in surveys:
        for name, counts in found.items():
            if isinstance(counts, str):
                as_text.add(name)
                columns.setdefault(name, Counter())
            else:
                columns.setdefault(name, Counter()).update(counts)
    types: dict[str, pa.DataType | str | None] = {}
    for name, counts in columns.items():
        if name in as_text:
            types[name] = _AS_TEXT
            continue
        t = unify_counts(counts)
        fits = t is not None and all(_merges(t, other) for other in counts)
        types[name] = settled(t) if fits else None  # None: mixed kinds, an object column
    reader = JsonLines(types, fs, path)
    with dask.config.set({"dataframe.convert-string": False}):  # nested values stay Python objects
        return dd.from_map(reader, urls, meta=reader.empty(), enforce_metadata=False)


_SURVEYS: dict[tuple, tuple] = {}  # the last input's surveys, by its files' names, sizes and times


def _survey_jsonl(fs, file: str) -> dict | str:
    """Each field's value types with counts, in order of first appearance; or what is wrong."""
    try:
        rows, huge = _parse(fs, file)
    except ValueError as exc:
        return str(exc)
    names = list(dict.fromkeys(k for r in rows for k in r))
    out: dict = {}
    for n in names:
        values = [r.get(n) for r in rows]
        if huge and any(isinstance(_find(v, lambda x: isinstance(x, _TooLong))[1], _TooLong) for v in values):
            out[n] = _AS_TEXT  # an integer of more digits than Python reads: JSON text, as beyond 64 bits
            continue
        counts = value_types(values)
        out[n] = counts if _fit(values, counts) else _AS_TEXT
    return out


#: A field's survey when some of its values do not convert to the type of the others (a
#: list mixing kinds among lists of numbers, an integer beyond 64 bits): read as JSON text.
_AS_TEXT = "json-text"


def _fit(values: list, counts) -> bool:
    """Whether ``values`` convert to the type their counts unify to (every value of a kind
    that merges into it; values of other kinds are the writer's to refuse, see the module's
    docstring)."""
    t = unify_counts(counts)
    if t is None or pa.types.is_null(t):
        return all(v is None for v in values)  # e.g. an integer too large for any Arrow type
    present = [v for v in values if v is not None]
    try:
        pa.array(present, type=settled(t))
        return True
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        pass
    for v in present:  # a value of another kind is not this field's misfit (an object column)
        try:
            counts_v = value_types([v])
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return False
        if not counts_v:
            return False  # a value with no Arrow type (an integer beyond 64 bits)
        if not all(_merges(t, other) for other in counts_v):
            continue
        try:
            pa.array([v], type=settled(t))
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return False
    return True


def json_text(value) -> str | None:
    """A value as its JSON text (None stays None; an integer of more digits than Python
    reads, :class:`~dfllm.jobs.openai_batch._TooLong`, as its digits)."""
    if value is None:
        return None
    try:
        return json.dumps(value, ensure_ascii=False)
    except TypeError:  # a _TooLong in it
        return _json_with_digits(value)


def _json_with_digits(value) -> str:
    if isinstance(value, _TooLong):
        return value.digits
    if isinstance(value, dict):
        items = (f"{json.dumps(k, ensure_ascii=False)}: {_json_with_digits(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_json_with_digits(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _rows(fs, file: str) -> list[dict]:
    return _parse(fs, file)[0]


def _parse(fs, file: str) -> tuple[list[dict], bool]:
    """The file's rows, and whether any holds an integer of more digits than Python reads
    (a :class:`~dfllm.jobs.openai_batch._TooLong`, read as JSON text: see :func:`json_text`).
    A UTF-8 byte-order mark at the start of the file is dropped (as the CSV reader and
    ``run-batch`` drop it); bytes that are not UTF-8 are read as their ``\\xNN`` escape, as
    the CSV reader reads them (inside a JSON string, the four characters ``\\xff``; outside
    one the line is not JSON). ``ValueError`` naming the line that is not a JSON object,
    or nests too deeply to read."""
    rows, huge = [], False
    with fs.open(file, "rt", encoding="utf-8-sig", errors="surrogateescape") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row, long = _load(_escape_bytes(line))
                if isinstance(row, dict):
                    row = _valid_text(row)
            except RecursionError:
                raise ValueError(
                    f"line {number} is not valid JSON dfllm can read: it nests arrays or objects too deeply"
                ) from None
            except ValueError as exc:
                raise ValueError(f"line {number} is not valid JSON ({exc})") from None
            if not isinstance(row, dict):
                kind = "int" if isinstance(row, _TooLong) else type(row).__name__
                raise ValueError(f"line {number} is a JSON {kind}, not an object")
            rows.append(row)
            huge = huge or long
    return rows, huge


_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, as ``surrogateescape`` reads it


def _escape_bytes(line: str) -> str:
    """``line`` (read with ``surrogateescape``) with each byte that is not UTF-8 as the JSON
    text of its ``\\xNN`` escape (an escaped backslash, then ``xNN``)."""
    if line.isascii():
        return line
    return _NOT_UTF8.sub(lambda m: "\\\\x%02x" % (ord(m.group()) - 0xDC00), line)


def _load(text: str) -> tuple:
    """``text``'s JSON value, and whether it holds an integer of more digits than Python
    reads (read as run-batch reads it, :func:`~dfllm.jobs.openai_batch._read_int`)."""
    try:
        return json.loads(text), False
    except json.JSONDecodeError:
        raise
    except ValueError:  # Python's limit on the digits of an integer
        return json.loads(text, parse_int=_read_int), True


def _valid_text(value):
    """``value`` with each text (keys included, at any depth) holding a lone surrogate (valid
    JSON, ``"\\ud800"``, but no valid UTF-8) written with that surrogate as its escape, as
    the file has it (the six characters ``\\ud800``)."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {_valid_text(k): _valid_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_valid_text(v) for v in value]
    return value


def _merges(t: pa.DataType, other: pa.DataType) -> bool:
    try:
        return (
            pa.unify_schemas([pa.schema([("x", t)]), pa.schema([("x", other)])], promote_options="permissive")
            .field("x")
            .type
            == t
        )
    except (pa.ArrowException, TypeError):
        return False


class JsonLines:
    """Reads one JSON Lines file in the unified types (``None``: an object column)."""

    def __init__(self, types: dict, fs, path: str):
        self.types, self.fs, self.input_paths = types, fs, [path]

    def __call__(self, url: str) -> pd.DataFrame:
        rows = _rows(self.fs, self.fs._strip_protocol(url))
        data = {}
        for name, t in self.types.items():
            values = [r.get(name) for r in rows]
            if isinstance(t, str):
                data[name] = pd.Series([json_text(v) for v in values], dtype=STRING_DTYPE)
                continue
            if t is None:
                data[name] = pd.Series(values, dtype=object)
                continue
            try:
                array = pa.array(values, type=t)
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                # a value the survey let through (e.g. an integer beyond float's exact range in a
                # float column): the values as they are, each typed by the writer, which gives a
                # row whose value does not fit an llm_error naming the column and the value
                data[name] = pd.Series(values, dtype=object)
                continue
            data[name] = pd.Series(pd.arrays.ArrowExtensionArray(array), dtype=pd.ArrowDtype(t))
        return pd.DataFrame(data, index=pd.RangeIndex(len(rows)))

    def empty(self) -> pd.DataFrame:
        return pd.DataFrame({name: pd.Series([], dtype=_dtype(t)) for name, t in self.types.items()})


STRING_DTYPE = pd.ArrowDtype(pa.string())


def _dtype(t):
    if t is None:
        return object
    return STRING_DTYPE if isinstance(t, str) else pd.ArrowDtype(t)


def repartition(
    ddf: dd.DataFrame, *, partition_size: int | None = None, npartitions: int | None = None
) -> dd.DataFrame:
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
