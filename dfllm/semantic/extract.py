"""``.llm.extract``: typed fields from each row's text through structured outputs.

The schema (a pydantic model, a JSON schema, or a dict name -> Python type) becomes a JSON
schema; one greedy decode per row is constrained to it (``json_schema=`` of ``.llm.chat`` or
``.llm.generate``), which types the output as an Arrow struct. The struct is the output
column, or (``expand``) each of its fields a column of its own.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass

import pandas as pd

from dfllm.accessors.adapter import FrameAdapter
from dfllm.sampling_params import SamplingParams
from dfllm.semantic.frames import SemanticFunction, check_output_names, prompted_task, run_step, task_columns
from dfllm.semantic.prompts import instruction_fields
from dfllm.structured_outputs import StructuredOutputsParams
from dfllm.tasks.schema import LLM_ERROR, structured_dtype

EXTRACT_PREAMBLE = "You extract structured data from a record. Reply with one JSON object with these fields: {fields}."
ANSWER = "Reply with the JSON object only."
TEXT = "__dfllm_sem_struct__"  # the task's own output column (private, so that it clashes with no input)
DEFAULT_MAX_TOKENS = 256
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}
_NAMES = {
    "str": str,
    "string": str,
    "int": int,
    "integer": int,
    "float": float,
    "number": float,
    "bool": bool,
    "boolean": bool,
}


def type_schema(t, field: str = "") -> dict:
    """The JSON schema of a Python type annotation: ``str``, ``int``, ``float``, ``bool`` (or
    their names), ``list[T]``, ``T | None`` / ``Optional[T]``, ``Literal[...]``, a pydantic
    model, or a JSON schema dict; ``ValueError`` naming ``field`` otherwise."""
    if isinstance(t, str) and t in _NAMES:
        t = _NAMES[t]
    if t in _SCALARS:
        return {"type": _SCALARS[t]}
    if isinstance(t, dict):
        return t
    if isinstance(t, type) and hasattr(t, "model_json_schema"):
        return t.model_json_schema()
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is list and len(args) == 1:
        return {"type": "array", "items": type_schema(args[0], field)}
    if origin is typing.Literal and args and all(isinstance(a, (str, int, float, bool)) for a in args):
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return {"anyOf": [*(type_schema(a, field) for a in rest), {"type": "null"}]}
    raise ValueError(
        f"extract: field {field!r} has type {t!r}, which has no JSON schema; use str, int, float, "
        "bool, list[...], Literal[...], X | None, a pydantic model or a JSON schema dict"
    )


def as_json_schema(schema) -> dict:
    """``schema`` (a pydantic model, a JSON schema of an object, or a dict name -> type) as a
    JSON schema of an object with properties; ``ValueError`` naming what is wrong."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        out = schema.model_json_schema()
        out.setdefault("additionalProperties", False)  # only the model's fields become columns
    elif isinstance(schema, dict) and ("properties" in schema or isinstance(schema.get("type"), str)):
        out = schema
    elif isinstance(schema, dict) and schema and all(isinstance(k, str) for k in schema):
        props = {name: type_schema(t, name) for name, t in schema.items()}
        out = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    else:
        raise ValueError(
            "extract: schema must be a pydantic model, a JSON schema of an object, or a non-empty dict "
            f"of field name -> type, got {schema!r}"
        )
    if out.get("type") != "object" or not isinstance(out.get("properties"), dict) or not out["properties"]:
        raise ValueError(
            f"extract: the schema must describe an object with properties (its fields), got {json.dumps(out)[:200]}"
        )
    return out


def fields_text(schema: dict) -> str:
    """The schema's fields for the prompt: ``name (type: description)``, in order."""
    parts = []
    for name, prop in schema["properties"].items():
        kind = "one of " + ", ".join(map(json.dumps, prop["enum"])) if "enum" in prop else prop.get("type", "value")
        desc = prop.get("description")
        parts.append(f"{name} ({kind}{': ' + desc if desc else ''})")
    return "; ".join(parts)


@dataclass(frozen=True)
class ExtractStep:
    """From an extraction task's output to the operator's columns."""

    output_column: str
    fields: tuple[str, ...] | None  # expand: the struct's fields, each a column; None: the struct
    task_columns: tuple[str, ...]

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        struct = df[TEXT]
        out = df.drop(columns=[c for c in self.task_columns if c != LLM_ERROR], errors="ignore")
        errors = out.pop(LLM_ERROR)
        if self.fields is None:
            out[self.output_column] = struct
        else:
            for name in self.fields:
                out[name] = struct.struct.field(name)
        out[LLM_ERROR] = errors
        return out


def semantic_extract(
    frame: FrameAdapter,
    instruction: str,
    schema,
    *,
    model,
    output_column: str,
    expand: bool,
    chat: bool,
    sampling_params,
    on_error: str,
    resources,
    cache,
    engine_kwargs: dict,
):
    """``.llm.extract``: see its docstring."""
    fields = instruction_fields(instruction)
    columns = frame.columns
    missing = [f for f in fields if f not in columns]
    if missing:
        raise ValueError(
            f"extract: the instruction names column(s) {missing} that are not in the dataframe (columns: {columns})"
        )
    json_schema = as_json_schema(schema)
    try:
        dtype = structured_dtype(("json", StructuredOutputsParams(json=json_schema).key[1]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"extract: the schema has no Arrow type: {exc!r}") from None
    names = tuple(f.name for f in dtype.pyarrow_dtype) if expand else None
    new = list(names) if names is not None else [output_column]
    check_output_names("extract", new)
    clash = sorted(set(new) & (set(columns) - {LLM_ERROR}))
    if clash:
        raise ValueError(
            f"extract: output column(s) {clash} already exist; choose another output_column, or expand=False"
        )
    if sampling_params is None:
        sampling_params = SamplingParams(temperature=0.0, max_tokens=DEFAULT_MAX_TOKENS)
    task, shadow = prompted_task(
        frame,
        EXTRACT_PREAMBLE.format(fields=fields_text(json_schema)),
        instruction,
        fields,
        columns,
        answer=ANSWER,
        chat=chat,
        resources=resources,
        output_column=TEXT,
        model=model,
        sampling_params=sampling_params,
        json_schema=json_schema,
        on_error=on_error,
        engine_kwargs=engine_kwargs,
        cache=cache,
    )
    post = ExtractStep(output_column, names, tuple(task_columns(task.kind, TEXT)))
    return run_step(frame, SemanticFunction("extract", task, post, resources, shadow))
