"""A partition's rows as a task's inputs: texts from columns and templates, conversations,
per-row sampling params, each checked.

A bad row (null, empty or non-string input, a malformed template value or conversation,
invalid per-row sampling params) gets a message in ``llm_error`` (:func:`row_error`) and is
left out of what these functions return; ``on_error="raise"`` raises instead. A value is
only ever text for the model: a string that names a file is never opened.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pandas as pd

from dfllm.errors import value_repr, value_text
from dfllm.inputs import check_conversation, check_nesting, check_unicode
from dfllm.pooling_params import PoolingParams
from dfllm.sampling_params import SamplingParams
from dfllm.tasks.schema import LLM_ERROR
from dfllm.tasks.templates import cell_text, is_null, is_template, template_fields, template_value

if TYPE_CHECKING:
    from dfllm.tasks.task import LLMTask


def row_error(task: LLMTask, out: dict, i: int, message: str) -> None:
    """Row ``i``'s error: its ``llm_error`` (the task's output columns ``out``), or with
    ``on_error="raise"`` a ``ValueError`` naming the row."""
    if task.on_error == "raise":
        raise ValueError(f"row {i} of the partition: {message}")
    out[LLM_ERROR][i] = message


def cell_texts(df: pd.DataFrame, spec: str, task: LLMTask, out: dict, skip=()) -> dict[int, str]:
    """Row position -> text, from a column or a ``{column}`` template; bad rows get errors.
    Rows in ``skip`` are not read."""
    texts: dict[int, str] = {}
    records: list[dict] | None = df.to_dict("records") if is_template(spec) else None
    values: list = [] if records is not None else df[spec].tolist()
    for i in range(len(df)):
        if i in skip:
            continue
        try:
            if records is not None:
                row = {k: template_value(records[i][k], f"column {k!r}") for k in template_fields(spec)}
                try:
                    texts[i] = spec.format_map(row)
                # a format spec this row's value does not fit ({x:c} past U+10FFFF, {x:.2f} of 10**400),
                # or a width no memory holds (``{q:>{w}}`` with a row's w of 10**14)
                except (ValueError, TypeError, OverflowError, MemoryError) as exc:
                    raise ValueError(f"template {spec!r}: {exc}") from None
                check_unicode(texts[i], f"template {spec!r}")
            else:
                texts[i] = cell_text(values[i], f"column {spec!r}")
        except ValueError as exc:
            row_error(task, out, i, str(exc))
    return texts


def conversations(df: pd.DataFrame, task: LLMTask, out: dict, skip=()) -> dict[int, list[dict]]:
    """Row position -> conversation for a chat task (the task's system message first): a
    template's text as one user turn, or a column of conversations (lists of messages, or
    their JSON or Python-literal text); bad rows get errors. Rows in ``skip`` are not read."""
    spec = task.inputs[0]
    system = [{"role": "system", "content": task.system}] if task.system else []
    if is_template(spec):
        return {
            i: system + [{"role": "user", "content": text}] for i, text in cell_texts(df, spec, task, out, skip).items()
        }
    convs: dict[int, list] = {}
    for i, conv in enumerate(df[spec].tolist()):
        if i in skip:
            continue
        try:
            if is_null(conv):
                raise ValueError("the conversation is null")
            if isinstance(conv, str):
                conv = _conversation_text(conv)
            if hasattr(conv, "__iter__") and not isinstance(conv, (str, bytes, Mapping)):
                conv = [dict(m) if isinstance(m, Mapping) else m for m in conv]
            check_conversation(conv, "the conversation")  # not its place in the partition: the row's own error
            convs[i] = system + conv
        except (ValueError, TypeError) as exc:
            row_error(task, out, i, f"messages: {exc}")
    return convs


def row_params(df: pd.DataFrame, task: LLMTask, rows, out: dict) -> dict[int, SamplingParams]:
    """Row position -> its SamplingParams, for ``rows``: the task's, or with a sampling
    column the row's own dict of fields (a null cell: the task's); bad rows get errors."""
    fields: dict[str, Any] = {k: list(v) if isinstance(v, tuple) else v for k, v in task.sampling}
    base = SamplingParams(**fields)
    return _per_row(df, task, rows, out, task.sampling_column, base, "SamplingParams", "sampling_params", _one_output)


def _one_output(fields: dict) -> SamplingParams:
    # null fields are unset (a parquet struct column has every field in every row): _fields dropped them
    params = SamplingParams.from_dict(fields)
    if params.n != 1:
        raise ValueError("n must be 1 in a dataframe (one output per row)")
    return params


def row_pooling_params(df: pd.DataFrame, task: LLMTask, rows, out: dict) -> dict[int, PoolingParams]:
    """Row position -> its PoolingParams, for ``rows``: the task's, or with a pooling column
    the row's own dict of fields (a null cell: the task's); bad rows get errors."""
    from dfllm.tasks.task import pooling_params_from

    base = task.pooling_params()
    return _per_row(
        df, task, rows, out, task.pooling_column, base, "PoolingParams", "pooling_params", pooling_params_from
    )


def row_chat_template_kwargs(df: pd.DataFrame, task: LLMTask, rows, out: dict) -> dict[int, dict]:
    """Row position -> the chat template variables of ``rows``: the task's, with a row's own
    (a dict in the task's column; null: none) merged over them; bad rows get errors."""
    from dfllm.tasks.task import thawed

    base = {k: thawed(v) for k, v in task.chat_template_kwargs}

    def merged(value: dict) -> dict:
        if not all(isinstance(k, str) for k in value):
            raise ValueError("template variable names must be strings")
        check_nesting(value, f"column {column!r}", "variable")
        return {**base, **value}

    column = task.chat_template_kwargs_column
    return _per_row(df, task, rows, out, column, base, "template variables", "chat_template_kwargs", merged)


def _per_row(df: pd.DataFrame, task: LLMTask, rows, out: dict, column, base, what: str, argument: str, make) -> dict:
    """Row position -> ``base`` for ``rows``, or with a ``column`` each row's own: ``make`` of
    the row's dict of ``what`` fields (a null cell: ``base``); a bad row gets the error
    ``"<argument>: <why>"``."""
    if not column:
        return {i: base for i in rows}
    values, cells = {}, df[column].tolist()
    for i in rows:
        try:
            value = _fields(cells[i], what)
            values[i] = base if value is None else make(value)
        except (ValueError, TypeError) as exc:
            row_error(task, out, i, f"{argument}: {exc}")
    return values


def token_id_prompts(df: pd.DataFrame, task: LLMTask, out: dict) -> dict[int, list[int]]:
    """Row position -> token ids, for the rows of the task's token id column that are not
    null (a list or array of ints, checked against the vocabulary later); bad rows get
    errors. No column: none."""
    if not task.prompt_token_ids_column:
        return {}
    ids: dict[int, list[int]] = {}
    for i, value in enumerate(df[task.prompt_token_ids_column].tolist()):
        if value is None or (not hasattr(value, "__len__") and is_null(value)):
            continue
        try:
            if isinstance(value, str):
                value = literal_text(value, list, "a list of token ids")
            if isinstance(value, (bytes, Mapping)) or not hasattr(value, "__iter__"):
                raise ValueError(f"must be a list of token ids, got {type(value).__name__}")
            value = [v.item() if hasattr(v, "item") else v for v in value]
            if not value:
                raise ValueError("is empty")
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                bad = next(v for v in value if not isinstance(v, int) or isinstance(v, bool))
                raise ValueError(f"must hold ints, got {value_repr(bad)} ({type(bad).__name__})")
            ids[i] = value
        except ValueError as exc:
            row_error(task, out, i, f"{task.prompt_token_ids_column}: {exc}")
    return ids


def _fields(value, what: str) -> dict | None:
    """A cell holding a dict of fields (or its JSON/literal text) as a dict with its null
    fields left out; None for a null cell."""
    if isinstance(value, str):
        value = literal_text(value, dict, f"a dict of {what} fields")
    if is_null(value):
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"must be a dict of {what} fields, got {type(value).__name__}")
    try:
        fields = dict(value)
    except Exception as exc:  # noqa: BLE001  (a mapping whose items cannot be read)
        raise ValueError(
            f"a dict of {what} fields that cannot be read ({type(exc).__name__}: {value_text(exc)})"
        ) from None
    return {k: v for k, v in fields.items() if v is not None and v is not pd.NA}


def literal_text(text: str, kind: type, what: str):
    """A value stored as text: JSON (CSV and JSON inputs), or the Python literal Dask's
    ``dataframe.convert-string`` leaves of a column of lists or dicts (read as data with
    ``ast.literal_eval``: literals only, nothing is evaluated). ``ValueError`` unless it
    holds a ``kind``."""
    try:
        value = json.loads(text)
    except RecursionError:  # valid JSON, maybe, but nested deeper than Python reads
        raise ValueError(f"a string nested too deeply to read as {what}") from None
    except ValueError:
        try:
            value = ast.literal_eval(text)
        # TypeError: a literal Python cannot build ("{{}}": a set holding a dict)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise ValueError(
                f"a string that is neither JSON nor {what} (on Dask, 'dataframe.convert-string' "
                "turns an object column of lists or dicts into strings)"
            ) from None
    if not isinstance(value, kind):
        raise ValueError(f"a string holding {type(value).__name__}, not {what}")
    return value


def _conversation_text(text: str) -> list:
    """A conversation stored as text (see :func:`literal_text`)."""
    try:
        return literal_text(text, list, "a list of messages")
    except ValueError as exc:
        raise ValueError(f"the conversation is {exc}") from None
