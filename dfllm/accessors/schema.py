"""Output columns of each accessor task and their Arrow-backed pandas dtypes."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa

STRING = pd.ArrowDtype(pa.string())
INT = pd.ArrowDtype(pa.int64())
FLOAT = pd.ArrowDtype(pa.float64())
VECTOR = pd.ArrowDtype(pa.list_(pa.float32()))


def output_dtypes(kind: str, output_column: str) -> dict[str, pd.api.extensions.ExtensionDtype]:
    """Columns a task adds, in order, with their dtypes (``llm_error`` always last)."""
    if kind in ("generate", "chat"):
        cols = {output_column: STRING, "num_input_tokens": INT, "num_generated_tokens": INT, "finish_reason": STRING}
    elif kind == "embed":
        cols = {output_column: VECTOR}
    elif kind == "score":
        cols = {output_column: FLOAT}
    elif kind == "classify":
        cols = {output_column: STRING, "probs": VECTOR}
    else:
        raise ValueError(f"unknown task {kind!r}")
    return {**cols, "llm_error": STRING}


