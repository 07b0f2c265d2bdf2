"""What a missing cell is, in one function (``dfllm.tasks.templates.is_null``) for templates,
schemas, the processor and the semantic operators: None, pandas' NA and NaT, every NaN
(Python, NumPy, decimal) and NumPy's NaT; never a container, whatever it holds, nor text."""

from __future__ import annotations

import datetime
import decimal

import numpy as np
import pandas as pd
from hypothesis import given
from hypothesis import strategies as st

from dfllm.tasks.templates import is_null

NULLS = [
    None,
    pd.NA,
    pd.NaT,
    float("nan"),
    np.float32("nan"),
    np.float64("nan"),
    decimal.Decimal("NaN"),
    np.datetime64("NaT"),
    np.timedelta64("NaT"),
]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(),
    st.binary(),
    st.decimals(allow_nan=True),
    st.dates(),
    st.sampled_from(NULLS),
)


def test_every_kind_of_missing_value_is_null():
    assert all(is_null(v) for v in NULLS)
    assert not any(is_null(v) for v in ("", b"", 0, 0.0, False, datetime.date(2020, 1, 1), decimal.Decimal(0)))


@given(st.lists(SCALARS, max_size=3))
def test_a_container_is_a_value_whatever_it_holds(items):
    for container in (items, tuple(items), {"k": items}, np.array(items, dtype=object)):
        assert not is_null(container)
