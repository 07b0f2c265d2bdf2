"""Output columns of each accessor task and their Arrow-backed pandas dtypes.

With structured outputs the main column is typed from the constraint: a JSON schema gives an
Arrow struct (see :func:`arrow_type`), a choice a pandas categorical of exactly those values.
"""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa

STRING = pd.ArrowDtype(pa.string())
INT = pd.ArrowDtype(pa.int64())
FLOAT = pd.ArrowDtype(pa.float64())
VECTOR = pd.ArrowDtype(pa.list_(pa.float32()))


def output_dtypes(kind: str, output_column: str, structured: tuple = ()) -> dict[str, pd.api.extensions.ExtensionDtype]:
    """Columns a task adds, in order, with their dtypes (``llm_error`` always last).

    ``structured`` is ``("json", schema_text)`` or ``("choice", (values...))`` for a
    constrained generation, else empty.
    """
    if kind in ("generate", "chat"):
        cols = {output_column: structured_dtype(structured) if structured else STRING, "num_input_tokens": INT, "num_generated_tokens": INT, "finish_reason": STRING}
    elif kind == "embed":
        cols = {output_column: VECTOR}
    elif kind == "score":
        cols = {output_column: FLOAT}
    elif kind == "classify":
        cols = {output_column: STRING, "probs": VECTOR}
    else:
        raise ValueError(f"unknown task {kind!r}")
    return {**cols, "llm_error": STRING}




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
    return _SCALARS.get(kind, pa.string())


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
