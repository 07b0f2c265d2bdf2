"""A resumed write reuses a part only when its partition's rows would make the same prompts:
the partition key (``dfllm.accessors.writer.partition_key``) differs whenever a template would
write a column's values differently. pandas' own hash of a value ignores its dtype and time
zone (``True`` and ``1``, one instant in two zones, ``-0.0`` and ``0.0``, ``int8`` ``-1`` and
``uint8`` ``255`` hash alike), so the key holds the dtype and a zero's sign too."""

from __future__ import annotations

import itertools

import pandas as pd

from dfllm.accessors.writer import partition_key
from dfllm.tasks.templates import is_null, template_value

UTC = pd.Series(pd.to_datetime(["2020-01-01 00:00", "2020-06-01 12:00"]).tz_localize("UTC"))
COLUMNS = {
    "bool": pd.Series([True, False]),
    "int64": pd.Series([1, 0]),
    "float64": pd.Series([1.0, 0.0]),
    "float64 -0.0": pd.Series([1.0, -0.0]),
    "bool[pyarrow]": pd.Series([True, False], dtype="bool[pyarrow]"),
    "int64[pyarrow]": pd.Series([1, 0], dtype="int64[pyarrow]"),
    "double[pyarrow] -0.0": pd.Series([1.0, -0.0], dtype="double[pyarrow]"),
    "Int64 with NA": pd.Series([1, None], dtype="Int64"),
    "int8 -1": pd.Series([-1, 0], dtype="int8"),
    "uint8 255": pd.Series([255, 0], dtype="uint8"),
    "UTC": UTC,
    "US/Eastern": UTC.dt.tz_convert("US/Eastern"),
    "naive": UTC.dt.tz_localize(None),
    "object text": pd.Series(["1", "0"], dtype=object),
    "str": pd.Series(["1", "0"], dtype="string[pyarrow]"),
}


def texts(series: pd.Series) -> list[str | None]:
    """What a ``{x}`` template writes for each value (None: a null, that row's error)."""
    return [None if is_null(v) else "{}".format(template_value(v, "x")) for v in series.tolist()]


def test_columns_a_template_writes_differently_have_different_keys():
    for (a_name, a), (b_name, b) in itertools.combinations(COLUMNS.items(), 2):
        if texts(a) != texts(b):
            assert partition_key(pd.DataFrame({"x": a}), "k") != partition_key(pd.DataFrame({"x": b}), "k"), (
                a_name,
                b_name,
            )


def test_the_same_rows_have_the_same_key():
    for series in COLUMNS.values():
        frame = pd.DataFrame({"x": series})
        assert partition_key(frame, "k") == partition_key(frame.copy(deep=True), "k")
        assert partition_key(frame, "k") != partition_key(frame, "other task")
