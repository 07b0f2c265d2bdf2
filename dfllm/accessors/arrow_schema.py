"""One Arrow schema per write: deciding it before the first part, and converting each
partition to it.

A write's schema (:func:`job_schema`) takes every column's type from the result's ``meta``
where ``meta`` knows it (Arrow-backed dtypes, numbers, booleans, timestamps, categoricals,
strings) and from the task's declared types for its own ``object`` columns. A passthrough
column that ``meta`` only knows as ``object`` (JSON values, nested values from a pandas
frame) gets the type of its values over the whole source: each partition reports the
Arrow types of its values with their counts (:func:`value_types`), and :func:`unify_counts`
merges them, most common first, as pyarrow's ``unify_schemas(promote_options="permissive")``
does (structs gain the union of their fields, int and float give float, null gives way to
anything). A type that cannot merge with the ones before it (text among lists) is left
out: its values do not fit.

:func:`conform` converts a partition to the schema. A value that does not fit its column's
type becomes null and its row gets an error naming the column and the value; the row's
other columns are kept, and nothing fails the partition.

A processor's output (:mod:`dfllm.jobs.processor`) is typed before it is written:
:func:`meta_dtypes` reads ``meta=``, :func:`input_dtypes` and :func:`infer_dtype` type the
input's and postprocess's columns (Arrow-backed pandas dtypes that hold nulls, dicts keyed by
token id as maps), and :func:`typed_column` converts a column's values, stricter than
:func:`conform`: a value fits only a column of its kind (no number in a string column),
except an error row's input values, which go through Arrow's safe casts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np
import pandas as pd
import pyarrow as pa

from dfllm.errors import shown
from dfllm.tasks.templates import is_null

#: What a partition reports for a column: each Arrow type of its values and how many values had it.
TypeCounts = Counter
#: What ``meta=`` accepts: a DataFrame, a dict or list of (column, dtype) pairs, a pyarrow schema.
Meta: TypeAlias = pd.DataFrame | Mapping[str, Any] | Sequence[tuple[str, Any]] | pa.Schema
STRING = pd.ArrowDtype(pa.string())


# ---- deciding types ----------------------------------------------------------------------------------
def value_type(value) -> pa.DataType:
    """The Arrow type pyarrow infers for one value, with dicts whose keys are not all
    strings (token id -> logprob) as maps and nested numpy arrays as lists."""
    if isinstance(value, str):
        return pa.string()  # even a lone surrogate: a string that will not fit, not a new type
    try:
        return pa.array([value], from_pandas=True).type
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        pass
    if isinstance(value, Mapping) and value:
        if any(not isinstance(k, str) for k in value):
            return pa.map_(_common([value_type(k) for k in value]), _common([value_type(v) for v in value.values()]))
        return pa.struct([(str(k), value_type(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple, np.ndarray)) and len(value):
        return pa.list_(_common([value_type(v) for v in value]))
    raise ValueError(f"a {type(value).__name__} has no Arrow type")


def _common(types: list[pa.DataType]) -> pa.DataType:
    out = unify_counts(Counter(types))
    if out is None:
        raise ValueError("values of incompatible types")
    return out


def value_types(values) -> TypeCounts:
    """The Arrow types of a column's values with their counts (nulls counted as ``null``;
    values with no Arrow type are left out). One pyarrow inference for the whole column
    when it has one type, else one per value."""
    values = list(values)
    try:
        t = pa.array(values, from_pandas=True).type
        _check_shapes(values, t)  # pyarrow reads text as a list of characters, and drops struct keys
        return Counter({t: len(values)})
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        pass
    counts: Counter = Counter()
    for v in values:
        try:
            counts[pa.null() if is_null(v) else value_type(v)] += 1
        except ValueError:
            continue
    return counts


def unify_counts(counts: Mapping[pa.DataType, int]) -> pa.DataType | None:
    """The type of values with these types: the types of the most common kind of value
    (lists, structs, maps, numbers, text...; nulls count for nothing) first, most common
    first, each widening the type before it (pyarrow's permissive promotion), then the
    others that merge with it; None if there are no types. Ties go by name, so every
    process decides alike."""
    kinds: Counter = Counter()
    for t, n in counts.items():
        kinds[_kind(t)] += n
    kinds["null"] = -1
    out: pa.DataType | None = None
    order = sorted(counts.items(), key=lambda kv: (-kinds[_kind(kv[0])], _kind(kv[0]), -kv[1], str(kv[0])))
    for t, _ in order:
        if out is None:
            out = t
            continue
        try:
            out = (
                pa.unify_schemas([pa.schema([("x", out)]), pa.schema([("x", t)])], promote_options="permissive")
                .field("x")
                .type
            )
        except (pa.ArrowException, TypeError, ValueError):
            continue  # e.g. text among lists: those values will not fit
    return out


def _kind(t: pa.DataType) -> str:
    """What kind of value a type holds, for choosing a column's type by its most common kind."""
    if pa.types.is_null(t):
        return "null"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return "list"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    return (
        str(t.id)
        if not (pa.types.is_struct(t) or pa.types.is_map(t))
        else ("struct" if pa.types.is_struct(t) else "map")
    )


def dtype_type(dtype) -> pa.DataType | None:
    """The Arrow type a pandas dtype stands for; None for ``object`` (the values decide)."""
    if isinstance(dtype, pd.ArrowDtype):
        return dtype.pyarrow_dtype
    if isinstance(dtype, np.dtype) and dtype.kind == "O":
        return None
    if isinstance(dtype, pd.CategoricalDtype):
        categories = dtype.categories
        value = pa.string() if categories.dtype == object else dtype_type(categories.dtype) or pa.string()
        return pa.dictionary(pa.int32(), value, ordered=bool(dtype.ordered))
    return pa.Schema.from_pandas(pd.DataFrame({"x": pd.Series([], dtype=dtype)}), preserve_index=False).field("x").type


def settled(t: pa.DataType | None) -> pa.DataType:
    """A decided type with no ``null`` left in it (a column null everywhere is a string)."""
    if t is None or pa.types.is_null(t):
        return pa.string()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return (pa.large_list if pa.types.is_large_list(t) else pa.list_)(settled(t.value_type))
    if pa.types.is_struct(t) and t.num_fields == 0:  # only empty dicts seen: parquet has no empty struct
        return pa.map_(pa.string(), pa.string())
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, settled(f.type)) for f in t])
    if pa.types.is_map(t):
        return pa.map_(settled(t.key_type), settled(t.item_type))
    return t


def job_schema(meta: pd.DataFrame, types: Mapping[str, pa.DataType]) -> pa.Schema:
    """The schema every part of a write carries: ``meta``'s columns and index, typed by
    ``types`` where given (the task's declared types, what the source's values gave) and
    otherwise by their dtypes; with pandas' metadata for ``meta``, so that every part
    reads back with the same dtypes."""
    base = pa.Table.from_pandas(meta, preserve_index=True).schema
    pandas_meta = readable_pandas_metadata(base.metadata or {})
    fields = []
    names = [str(c) for c in meta.columns]
    for i, f in enumerate(base):
        name = names[i] if i < len(names) else f.name
        given = types.get(name) if i < len(names) else types.get(INDEX)
        if given is None:
            given = dtype_type(meta.dtypes.iloc[i]) if i < len(names) else dtype_type(meta.index.dtype)
        fields.append(pa.field(f.name, settled(given if given is not None else f.type)))
    return pa.schema(fields, metadata=pandas_meta)


#: ``types``' key for the index (its values decide an ``object`` index's type).
INDEX = "__index__"


def readable_pandas_metadata(metadata: Mapping[bytes, bytes]) -> dict[bytes, bytes]:
    """pandas' parquet metadata with nested Arrow dtypes recorded as ``object``: pandas
    records ``list<item: float>[pyarrow]`` and the like under names its own reader cannot
    parse again. pandas then reads those columns as arrays (``dtype_backend="pyarrow"``
    gives the Arrow types back); Polars and pyarrow read the file's schema as it is."""
    import json

    out = dict(metadata)
    if b"pandas" not in out:
        return out
    meta = json.loads(out[b"pandas"])
    for column in meta["columns"]:
        if column["numpy_type"].endswith("[pyarrow]") and "<" in column["numpy_type"]:
            column["numpy_type"] = "object"
    out[b"pandas"] = json.dumps(meta).encode()
    return out


# ---- converting a partition ------------------------------------------------------------------------
def conform(df: pd.DataFrame, schema: pa.Schema) -> tuple[pa.Table, dict[int, str]]:
    """``df`` (columns, then its index) as a table of exactly ``schema``, and row position ->
    why a value of that row did not fit (that cell is null)."""
    problems: dict[int, list[str]] = {}
    arrays = []
    ncols = len(df.columns)
    for i, f in enumerate(schema):
        if i < ncols:
            values, what = df.iloc[:, i], f"column {f.name!r}"
        else:
            values, what = pd.Series(df.index, index=df.index), "the index"
        arrays.append(_array(values, f.type, what, problems))
    table = pa.Table.from_arrays(arrays, schema=schema)
    return table, {i: "; ".join(msgs) for i, msgs in problems.items()}


def _array(series: pd.Series, type_: pa.DataType, what: str, problems: dict[int, list[str]]) -> pa.Array:
    try:
        return _whole(series, type_)
    except Exception:  # noqa: BLE001  (pyarrow raises Arrow, Python and Unicode errors): one value at a time
        pass
    cells = []
    for i, value in enumerate(series.tolist()):
        try:
            cells.append(_one(value, type_))
        except Exception as exc:  # noqa: BLE001
            problems.setdefault(i, []).append(
                f"{what}: the value {_show(value)} does not fit {type_} ({type(exc).__name__}: {exc})"
            )
            cells.append(pa.nulls(1, type_))
    return pa.concat_arrays(cells) if cells else pa.array([], type=type_)


def _whole(series: pd.Series, type_: pa.DataType) -> pa.Array:
    if isinstance(series.dtype, pd.ArrowDtype) or isinstance(series.dtype, pd.CategoricalDtype):
        arr = pa.array(series, from_pandas=True)
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        return arr if arr.type == type_ else arr.cast(type_, safe=True)
    if series.dtype == object and pa.types.is_nested(type_):
        _check_shapes(series.tolist(), type_)
    return pa.array(series, type=type_, from_pandas=True)


def _one(value, type_: pa.DataType) -> pa.Array:
    if pa.types.is_nested(type_):
        _check_shapes([value], type_)
    if isinstance(value, pd.Timestamp | np.datetime64 | pd.Timedelta):
        return pa.array(pd.Series([value]), from_pandas=True).cast(type_, safe=True)
    return pa.array([value], type=type_, from_pandas=True)


def _check_shapes(values: list, type_: pa.DataType) -> None:
    """``ValueError`` where a value's shape is not the type's: pyarrow would read text as a
    list of its characters, or drop a dict's keys that a struct lacks."""
    for v in values:
        _shape_fits(v, type_)


def _shape_fits(value, type_: pa.DataType) -> None:
    if is_null(value):
        return
    if pa.types.is_struct(type_):
        if not isinstance(value, Mapping):
            raise ValueError(f"a {type(value).__name__} is not a struct")
        fields = {f.name: f.type for f in type_}
        extra = [k for k in value if k not in fields]
        if extra:
            raise ValueError(f"field(s) {extra} not in the struct")
        for k, v in value.items():
            _shape_fits(v, fields[k])
    elif pa.types.is_map(type_):
        items = value.items() if isinstance(value, Mapping) else value
        if isinstance(items, str | bytes):
            raise ValueError(f"a {type(value).__name__} is not a map")
        for pair in items:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise ValueError("a map holds (key, value) pairs")
            _shape_fits(pair[0], type_.key_type)
            _shape_fits(pair[1], type_.item_type)
    elif pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_fixed_size_list(type_):
        if not isinstance(value, list | tuple | np.ndarray):
            raise ValueError(f"a {type(value).__name__} is not a list")
        for v in value:
            _shape_fits(v, type_.value_type)


# ---- a processor's output columns --------------------------------------------------------------------
def meta_dtypes(meta: Meta) -> dict:
    """``meta=`` as column -> dtype (``pd.ArrowDtype`` or ``pd.CategoricalDtype``)."""
    if isinstance(meta, pa.Schema):
        pairs = [(f.name, f.type) for f in meta]
    elif isinstance(meta, pd.DataFrame):
        pairs = list(meta.dtypes.items())
    elif isinstance(meta, Mapping):
        pairs = list(meta.items())
    elif isinstance(meta, (list, tuple)) and all(isinstance(p, tuple) and len(p) == 2 for p in meta):
        pairs = list(meta)
    else:
        raise TypeError(
            "meta= must be a pandas DataFrame, a dict or list of (column, dtype) pairs, or a "
            f"pyarrow schema, got {type(meta).__name__}"
        )
    out = {}
    for name, dtype in pairs:
        try:
            out[name] = _as_dtype(dtype)
        except (TypeError, ValueError, pa.ArrowException) as exc:
            raise ValueError(f"meta=: column {name!r}: {dtype!r} is not a dtype dfllm can hold ({exc})") from None
    return out


def _as_dtype(dtype) -> pd.api.extensions.ExtensionDtype:
    if isinstance(dtype, pa.DataType):
        return pd.ArrowDtype(_nullable(dtype))
    dtype = pd.api.types.pandas_dtype(dtype)
    if isinstance(dtype, pd.CategoricalDtype):
        return dtype
    return pd.ArrowDtype(_nullable(dtype_type(dtype) or pa.null()))


def _nullable(t: pa.DataType) -> pa.DataType:
    """``t`` with a null type (nothing known) read as a string, and large strings as strings."""
    if pa.types.is_null(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_list(t) or pa.types.is_list(t):
        return pa.list_(_nullable(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _nullable(f.type)) for f in t])
    return t


def input_dtypes(df: pd.DataFrame, error: str) -> dict:
    """The input's columns (but the error column ``error``) as Arrow-backed dtypes, from the column's
    dtype and values (an ``object`` column without values, or of values with no Arrow type,
    is a string)."""
    out = {}
    for i, name in enumerate(df.columns):
        if name == error:
            continue
        series = df.iloc[:, i]  # by position: a repeated name is the caller's to refuse
        if isinstance(series.dtype, pd.CategoricalDtype):  # as its values (Dask's may be unknown)
            series = pd.Series(series.dtype.categories[:0] if not len(series) else series.astype(object))
        try:
            t = pa.Array.from_pandas(series).type
        except (pa.ArrowException, TypeError, ValueError):
            t = pa.string()
        if pa.types.is_dictionary(t):
            t = t.value_type
        out[name] = pd.ArrowDtype(_nullable(t))
    return out


def infer_dtype(values: list, column, fallback) -> pd.api.extensions.ExtensionDtype:
    """The Arrow-backed dtype of postprocess's ``values`` for ``column``: pyarrow's type of
    them all or, when they have none together (or it is bytes, and some are text), that of
    the most common kind of value (text,
    numbers, lists...; ties by the kind's name) among those that have an Arrow type
    (:func:`value_types`, then :func:`unify_counts` of that kind's types); ``fallback``,
    else a string, when they are all null or none has a type. A value with no Arrow type (a
    lone surrogate, an integer beyond 64 bits...) or of another kind decides nothing,
    whichever its row: :func:`typed_column` makes it that row's error, naming ``column``."""
    try:
        t = _infer_type(values)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        t = None
    if t is None or (pa.types.is_binary(t) and any(isinstance(v, str) for v in values)):
        # one value at a time (pyarrow makes text among bytes bytes, which no text fits)
        counts: Counter = sum((value_types([v]) for v in values), Counter())
        kinds: Counter = Counter()
        for vt, n in counts.items():
            if not pa.types.is_null(vt):
                kinds[_kind(vt)] += n
        # only the most common kind: no widening into another (text into binary), which
        # would make every value of the most common kind not fit (see _compatible)
        best = min(kinds, key=lambda k: (-kinds[k], k), default=None)
        t = unify_counts({vt: n for vt, n in counts.items() if _kind(vt) == best})
    if t is None or pa.types.is_null(t):
        return fallback if fallback is not None else STRING
    return pd.ArrowDtype(_nullable(t))


def _infer_type(values: list) -> pa.DataType:
    """The Arrow type of ``values`` as pyarrow infers it, except that dicts whose keys are
    not strings (token id -> logprob, as in Ray's ``logprobs``) are maps, at any depth."""
    try:
        return pa.array(values, from_pandas=True).type
    except (pa.ArrowException, TypeError) as exc:
        present = [v for v in values if not is_null(v)]
        if (
            present
            and all(isinstance(v, Mapping) for v in present)
            and any(not isinstance(k, str) for v in present for k in v)
        ):
            keys = _infer_type([k for v in present for k in v])
            items = _infer_type([x for v in present for x in v.values()])
            return pa.map_(keys, items)
        if present and all(isinstance(v, (list, tuple, np.ndarray)) for v in present):
            return pa.list_(_infer_type([x for v in present for x in v]))
        if present and all(isinstance(v, Mapping) for v in present):
            names = list(dict.fromkeys(k for v in present for k in v))
            return pa.struct([(n, _infer_type([v.get(n) for v in present])) for n in names])
        raise exc


def _compatible(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether values inferred as ``src`` may go into a ``dst`` column (a safe cast then
    checks the values themselves: fractions, ranges). No change of kind: a number is no
    string, a string no list, and a struct takes no field it lacks."""
    if src == dst or pa.types.is_null(src):
        return True
    t = pa.types
    numeric = lambda x: t.is_integer(x) or t.is_floating(x) or t.is_decimal(x)  # noqa: E731
    for kind in (
        numeric,
        lambda x: t.is_string(x) or t.is_large_string(x) or t.is_string_view(x),
        lambda x: t.is_binary(x) or t.is_large_binary(x) or t.is_fixed_size_binary(x),
        t.is_timestamp,
        t.is_date,
        t.is_time,
        t.is_duration,
        t.is_boolean,
    ):
        if kind(src) and kind(dst):
            return True
    if (t.is_list(src) or t.is_large_list(src) or t.is_fixed_size_list(src)) and (
        t.is_list(dst) or t.is_large_list(dst) or t.is_fixed_size_list(dst)
    ):
        return _compatible(src.value_type, dst.value_type)
    if t.is_struct(src) and t.is_struct(dst):
        fields = {f.name: f.type for f in dst}
        return all(f.name in fields and _compatible(f.type, fields[f.name]) for f in src)
    return False


def _to_arrow(values: list, dtype, cast: bool = False) -> pa.Array:
    """``values`` as an Arrow array of ``dtype``'s type; ``ValueError`` saying why a value
    does not fit. Only values of the column's kind fit (see :func:`_compatible`), unless
    ``cast``: then any value Arrow's safe cast converts does (an int in a string column is
    its text, a string of digits in an integer column its number)."""
    target = dtype.pyarrow_dtype
    try:
        arr = pa.array(values, from_pandas=True)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        try:  # e.g. dicts keyed by token id, for a map column
            return pa.array(values, type=target, from_pandas=True)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            pass
        raise ValueError(f"has no Arrow type ({type(exc).__name__}: {exc})") from None
    if not cast and not _compatible(arr.type, target):
        raise ValueError(f"is {arr.type}, not {target}")
    try:
        return arr.cast(target, safe=True)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"does not fit {target} ({type(exc).__name__}: {exc})") from None


def typed_column(
    values: list, dtype, index: pd.Index, column, errors: list, inputs: set | frozenset = frozenset()
) -> pd.Series:
    """A typed column; values that do not fit are null, with a message in ``errors``. The
    values of the rows in ``inputs`` are an error row's input values: they go in through
    Arrow's safe casts (see :func:`_to_arrow`), so that the row still says which input row it
    was, and one that cannot be converted is named in the row's error."""
    if isinstance(dtype, pd.CategoricalDtype):
        for i, v in enumerate(values):
            if not is_null(v) and v not in dtype.categories and i in inputs:
                v = values[i] = _category(v, dtype)
            if not is_null(v) and v not in dtype.categories:
                what = "the input value" if i in inputs else ""
                errors[i] = join_errors(
                    errors[i],
                    f"column {column!r}: {what}{' ' if what else ''}{_show(v)} is "
                    f"not one of the categories {list(dtype.categories)}",
                )
                values[i] = None
        return pd.Series(values, index=index, dtype=dtype)
    try:
        arr = _to_arrow(values, dtype)
    except ValueError:  # find the rows, one value at a time
        cells = []
        for i, v in enumerate(values):
            try:
                cells.append(_to_arrow([v], dtype, cast=i in inputs))
            except ValueError as exc:
                what = "input value" if i in inputs else "value"
                errors[i] = join_errors(errors[i], f"column {column!r}: the {what} {_show(v)} {exc}")
                values[i] = None
                cells.append(pa.nulls(1, dtype.pyarrow_dtype))
        arr = pa.concat_arrays(cells)
    return pd.Series(arr, index=index, dtype=dtype)


def _category(value, dtype: pd.CategoricalDtype):
    """An input value as the category Arrow's safe cast makes of it (7 as "7" among string
    categories), or the value itself when none matches."""
    try:
        kind = pd.ArrowDtype(pa.array(dtype.categories, from_pandas=True).type)
        cast = _to_arrow([value], kind, cast=True)[0].as_py()
    except (ValueError, pa.ArrowException, TypeError):
        return value
    return cast if cast in dtype.categories else value


def join_errors(first: str | None, second: str | None) -> str | None:
    """Two error messages (either None) as one."""
    if first is None:
        return second
    return first if second is None else f"{first}; {second}"


def _show(value) -> str:
    """``value`` and its type for a message, never an exception (a ``repr`` that raises)."""
    return f"{shown(value, 80)} ({type(value).__name__})"
