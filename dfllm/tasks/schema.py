"""The accessors' output column names and Arrow-backed pandas dtypes, and structured-output types.

Which columns each task adds is in :mod:`dfllm.tasks.kinds`. With structured outputs
the main column is typed from the constraint: a JSON schema gives an Arrow struct (see
:func:`arrow_type`), a choice a pandas categorical of exactly those values;
:func:`structured_value` turns a constrained completion into that column's value.
"""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa

from dfllm.errors import value_text
from dfllm.tasks.templates import is_null

STRING = pd.ArrowDtype(pa.string())
INT = pd.ArrowDtype(pa.int64())
FLOAT = pd.ArrowDtype(pa.float64())
VECTOR = pd.ArrowDtype(pa.list_(pa.float32()))


def error_text(value) -> str | None:
    """A cell of an error column (``llm_error``, an earlier step's or a user function's) as
    its message: None where null (no error), else the value as text (:func:`value_text`:
    ``{"a": 1}`` is ``"{'a': 1}"``, ``5`` is ``"5"``, ``""`` an empty message)."""
    return None if is_null(value) else value_text(value)


# columns beside a task's main output (whose default name is its TaskKind's output_column)
LLM_ERROR = "llm_error"  # every task's last column: why the row has no output (null if it has one)
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_GENERATED_TOKENS = "num_generated_tokens"
FINISH_REASON = "finish_reason"
PROBS = "probs"
#: generate's and chat's reasoning, when the engine has a reasoning parser (``reasoning_parser=``)
REASONING_CONTENT = "reasoning_content"
#: generate's and chat's beams, with ``sampling_params=BeamSearchParams(...)``: every beam of the
#: row's search, best first (the output column holds the first one's text)
BEAMS = "beams"
#: One beam: its text (the continuation, without the end-of-sequence token), vLLM's
#: length-penalised score, its cumulative log-probability and finish reason.
BEAM_TYPE = pa.struct(
    [
        ("text", pa.string()),
        ("score", pa.float64()),
        ("cumulative_logprob", pa.float64()),
        ("finish_reason", pa.string()),
    ]
)
BEAMS_DTYPE = pd.ArrowDtype(pa.list_(BEAM_TYPE))
#: ``sort_by``'s name for a row's rendered prompt (its token ids) as a sort key (see
#: :func:`dfllm.tasks.runners.request_order`)
SORT_BY_PROMPT = "prompt"


# ---- structured outputs: column types from the constraint ------------------------------------------------
def structured_dtype(structured: tuple):
    """The dtype of a constrained generation's main column."""
    kind, value = structured
    if kind == "choice":
        return pd.CategoricalDtype(list(value), ordered=False)
    return pd.ArrowDtype(arrow_type(json.loads(value)))


def arrow_type(schema: dict, root: dict | None = None, _refs: tuple = ()) -> pa.DataType:
    """The Arrow type of values matching a JSON schema; every field nullable.

    string -> string, integer -> int64, number -> float64, boolean -> bool, array -> list of
    its items' type, object with properties -> struct of them in order; an enum or const of
    strings -> string (of integers: int64). ``$ref`` to ``$defs``/``definitions`` is followed,
    and ``anyOf``/``oneOf``/``type`` lists lose their ``null`` branch (pydantic's Optional).
    Whatever has no single Arrow type (a union of different types, an object without
    properties, a tuple, a recursive ``$ref``) is a string: the value itself when it is a
    string, else its JSON text.
    """
    root = schema if root is None else root
    if isinstance(schema, dict) and "$ref" in schema:
        if schema["$ref"] in _refs:
            return pa.string()
        _refs = _refs + (schema["$ref"],)
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return pa.string()
    for union in ("anyOf", "oneOf"):
        if union in schema:
            branches = [b for b in schema[union] if _resolve(b, root).get("type") != "null"]
            types = {arrow_type(b, root, _refs) for b in branches}
            return types.pop() if len(types) == 1 else pa.string()
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return arrow_type(schema["allOf"][0], root, _refs)
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        if all(isinstance(v, str) for v in values):
            return pa.string()
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return pa.int64()
        return pa.string()
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind == "object" and schema.get("properties"):
        return pa.struct([pa.field(name, arrow_type(sub, root, _refs)) for name, sub in schema["properties"].items()])
    if kind == "array" and isinstance(schema.get("items"), dict) and "prefixItems" not in schema:
        return pa.list_(arrow_type(schema["items"], root, _refs))
    return _SCALARS.get(kind, pa.string()) if isinstance(kind, str) else pa.string()


_SCALARS = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}


def _resolve(schema: dict, root: dict) -> dict:
    seen = 0
    while isinstance(schema, dict) and "$ref" in schema and seen < 64:  # a $ref to a $ref...
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            raise ValueError(f"json_schema: only local $ref (#/...) are supported, got {ref!r}")
        target = root
        for part in ref[2:].split("/"):
            target = target[part.replace("~1", "/").replace("~0", "~")]
        schema, seen = target, seen + 1
    return schema


def to_arrow_value(value, type_: pa.DataType):
    """A parsed JSON value shaped for ``type_`` (as built by :func:`arrow_type`)."""
    if value is None:
        return None
    if pa.types.is_struct(type_):
        return {f.name: to_arrow_value(value.get(f.name), f.type) for f in type_}
    if pa.types.is_list(type_):
        return [to_arrow_value(v, type_.value_type) for v in value]
    if pa.types.is_string(type_):
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if pa.types.is_floating(type_):
        return float(value)
    if pa.types.is_integer(type_):
        return int(value)
    return value


# ---- structured outputs: a completion's typed value --------------------------------------------------------
def structured_value(structured: tuple, completion, dtype):
    """The typed value of a constrained completion (a ``CompletionOutput``) for the main
    column of ``dtype``; ``ValueError`` when it did not complete or does not fit.
    ``structured`` is the task's ``("json", schema_text)`` or ``("choice", values)``."""
    kind = structured[0]
    what = "JSON" if kind == "json" else "choice"
    if not completion.structured_output_complete:
        raise ValueError(
            f"structured output incomplete: generation stopped (finish_reason="
            f"{completion.finish_reason!r}, {len(completion.token_ids)} tokens) before the {what} "
            f"was complete; raise max_tokens (partial output: {completion.text[:200]!r})"
        )
    if kind == "choice":
        if completion.text not in structured[1]:
            raise ValueError(f"structured output {completion.text!r} is not one of the choices")
        return completion.text
    # a schema that lets the model nest arrays or objects without end can give JSON nested
    # deeper than Python reads (RecursionError, which would fail the partition)
    try:
        value = json.loads(completion.text)
        typed = to_arrow_value(value, dtype.pyarrow_dtype)
    except RecursionError:
        raise ValueError(
            f"structured output nested too deeply to read ({len(completion.text)} characters): "
            f"{completion.text[:200]!r}"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"structured output is not valid JSON ({exc}): {completion.text[:200]!r}") from None
    try:  # e.g. an integer past int64: this row's error, not the partition's
        pa.array([typed], type=dtype.pyarrow_dtype)
    except (pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
        raise ValueError(
            f"structured output does not fit the column type {dtype.pyarrow_dtype} "
            f"({type(exc).__name__}: {exc}): {completion.text[:200]!r}"
        ) from None
    return typed
