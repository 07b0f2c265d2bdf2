"""What an accessor call asks for, checked at call time and run on one pandas partition.

A task is a small picklable description (columns, template, model, sampling settings);
``run_task`` turns one pandas frame into the same frame with the task's output columns.
Bad rows (null, empty or non-string input, a prompt past the context, a malformed
conversation, invalid per-row sampling params) get a null output and a message in
``llm_error``; every other row is processed. ``on_error="raise"`` raises instead.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import decimal
import json
import math
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pandas as pd
import pyarrow as pa

from dfllm.accessors.engines import OnDriver, generate_shared, get_engine
from dfllm.accessors.schema import output_dtypes, to_arrow_value
from dfllm.inputs import check_conversation, check_params_for_model, check_unicode
from dfllm.sampling_params import SamplingParams
from dfllm.structured_outputs import StructuredOutputsParams

KINDS = ("generate", "chat", "embed", "score", "classify")
ON_ERROR = ("null", "raise")


@dataclass(frozen=True)
class LLMTask:
    """One accessor call: which columns (or template) feed which task of which model."""

    kind: str
    inputs: tuple[str, ...]
    output_column: str
    model: str | None = None
    sampling: tuple = ()  # SamplingParams fields as sorted (key, value) pairs
    sampling_column: str | None = None
    system: str | None = None
    on_error: str = "null"
    engine_kwargs: tuple = field(default=())
    structured: tuple = ()  # ("json", schema text) or ("choice", values): a typed main column
    chat_template: str | None = None  # chat: a Jinja template replacing the tokenizer's

    @property
    def templates(self) -> list[str]:
        return [i for i in self.inputs if is_template(i)]

    def columns_needed(self) -> set[str]:
        cols = {c for i in self.inputs for c in (template_fields(i) if is_template(i) else [i])}
        return cols | ({self.sampling_column} if self.sampling_column else set())

    def output_dtypes(self) -> dict:
        return output_dtypes(self.kind, self.output_column, self.structured)

    def structured_params(self) -> StructuredOutputsParams | None:
        if not self.structured:
            return None
        kind, value = self.structured
        return StructuredOutputsParams(json=value) if kind == "json" else StructuredOutputsParams(choice=list(value))


def is_template(text: str) -> bool:
    return "{" in text


def template_fields(template: str) -> list[str]:
    """The ``{column}`` names a template uses, those nested in format specs (``{q:>{width}}``)
    included; malformed templates raise ``ValueError``. A field is a plain column name:
    attribute or index access (``{q.__class__}``, ``{q[0]}``) is refused, so a template
    can only ever read the row's values."""
    names: list[str] = []

    def walk(text: str, depth: int) -> None:
        for _, name, spec, conversion in string.Formatter().parse(text):
            if name is None:
                continue
            if conversion not in (None, "r", "s", "a"):
                raise ValueError(f"unknown conversion !{conversion}")
            names.append(name)
            if spec and depth < 2:
                walk(spec, depth + 1)

    try:
        walk(template, 0)
    except ValueError as exc:
        raise ValueError(f"bad template {template!r}: {exc}") from None
    if any(n == "" or n.isdigit() for n in names):
        raise ValueError(f"template {template!r}: placeholders must name columns, like {{question}}")
    for n in names:
        if "." in n or "[" in n:
            raise ValueError(f"template {template!r}: {{{n}}} is not a plain column name (attribute and index "
                             "access are not allowed; pass a column whose name has '.' or '[' directly)")
    return list(dict.fromkeys(names))


def make_task(kind: str, inputs: tuple[str, ...], columns, *, output_column: str, model=None,
              sampling_params=None, system: str | None = None, on_error: str = "null",
              engine_kwargs: dict | None = None, json_schema=None, choice=None,
              chat_template: str | None = None, model_check: Callable[[LLMTask], None] | None = None) -> LLMTask:
    """Check an accessor call against the frame's columns and build its task (raises ``ValueError``).

    ``model_check`` checks the task's model (default: :func:`check_model`, here and now)."""
    if kind not in KINDS:
        raise ValueError(f"unknown task {kind!r}")
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    for i in inputs:
        if not isinstance(i, str):
            raise ValueError(f"{kind}: expected a column name or a template string, got {type(i).__name__}")
        check_unicode(i, f"{kind}: the template or column name {i!r}")
    sampling, sampling_column = _sampling(sampling_params, columns, kind)
    structured = _structured(json_schema, choice, kind, sampling)
    task = LLMTask(kind, tuple(inputs), output_column, None if model is None else str(model), sampling,
                   sampling_column, system, on_error, tuple(sorted((engine_kwargs or {}).items())),
                   structured=structured, chat_template=chat_template)
    if chat_template is not None and (kind != "chat" or not isinstance(chat_template, str)):
        raise ValueError("chat_template must be a string (a Jinja template), and only chat takes one")
    missing = sorted(task.columns_needed() - set(map(str, columns)))
    if missing:
        raise ValueError(f"{kind}: column(s) {missing} not in the dataframe (columns: {list(columns)})")
    clash = sorted(set(task.output_dtypes()) & set(map(str, columns)))
    if clash:
        raise ValueError(f"{kind}: output column(s) {clash} already exist; choose another output_column")
    _check_engine_kwargs(kind, engine_kwargs or {})
    (model_check or check_model)(task)
    return task


def _check_engine_kwargs(kind: str, engine_kwargs: dict) -> None:
    """Extra keyword arguments go to ``LLM(...)``: unknown names fail now, not on a worker."""
    import inspect

    from dfllm.llm import LLM

    known = set(inspect.signature(LLM.__init__).parameters) - {"self", "model"}
    unknown = sorted(set(engine_kwargs) - known)
    if unknown:
        raise ValueError(f"{kind}: unknown argument(s) {unknown}: extra keyword arguments go to dfllm.LLM, "
                         f"which takes {sorted(known)}")


def _sampling(sampling_params, columns, kind: str) -> tuple[tuple, str | None]:
    if sampling_params is None:
        return (), None
    if isinstance(sampling_params, str):
        if sampling_params not in columns:
            raise ValueError(f"{kind}: sampling_params column {sampling_params!r} not in the dataframe")
        return (), sampling_params
    if isinstance(sampling_params, dict):
        sampling_params = SamplingParams.from_dict(sampling_params)
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError("sampling_params must be a SamplingParams, a dict, or the name of a column of dicts")
    if kind not in ("generate", "chat"):
        raise ValueError(f"{kind} takes no sampling_params")
    if sampling_params.n != 1:
        raise ValueError("sampling_params.n must be 1 in a dataframe (one output per row)")
    fields = {k: v for k, v in vars(sampling_params).items() if not k.startswith("_")}
    return tuple(sorted((k, _hashable(v)) for k, v in fields.items())), None


def _structured(json_schema, choice, kind: str, sampling: tuple) -> tuple:
    """``json_schema=`` / ``choice=`` as the task's hashable constraint (checked now)."""
    if json_schema is None and choice is None:
        return ()
    if kind not in ("generate", "chat"):
        raise ValueError(f"{kind} takes no json_schema or choice")
    if json_schema is not None and choice is not None:
        raise ValueError(f"{kind}: pass json_schema or choice, not both")
    if dict(sampling).get("structured_outputs") is not None:
        raise ValueError(f"{kind}: sampling_params already has structured_outputs; pass the constraint once")
    if choice is not None:
        so = StructuredOutputsParams(choice=choice)
        return ("choice", tuple(so.choice))
    so = StructuredOutputsParams(json=json_schema)
    structured = ("json", so.key[1])
    try:
        output_dtypes(kind, "x", structured)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{kind}: json_schema has no Arrow type: {exc!r}") from None
    return structured


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


def check_model(task: LLMTask) -> None:
    """Unknown names and unusable directories raise now, not in every partition at compute time."""
    from dfllm.models.bundled import resolve_model
    from dfllm.models.loader import check_model_dir

    check_model_dir(resolve_model(task.model))


# ---- running on one partition ----------------------------------------------------------------------
def run_task(df: pd.DataFrame, task: LLMTask, progress: bool = False) -> pd.DataFrame:
    """``df`` with the task's output columns; rows in the same order. ``progress`` shows a
    bar over the rows being generated (pandas and Polars calls; Dask shows its own)."""
    dtypes = task.output_dtypes()
    out: dict[str, list] = {c: [None] * len(df) for c in dtypes}
    if len(df):
        llm, lock = get_engine(task.model, dict(task.engine_kwargs))
        if task.kind in ("generate", "chat"):
            RUNNERS[task.kind](df, task, _SharedGenerate(llm, lock, progress), out)
        else:
            with lock:
                RUNNERS[task.kind](df, task, OnDriver(llm), out)
    cols = {c: pd.Series(v, index=df.index, dtype=dtypes[c]) for c, v in out.items()}
    return pd.concat([df, pd.DataFrame(cols, index=df.index)], axis=1)


class _SharedGenerate:
    """The engine as generation tasks see it: ``generate`` shares batches with other tasks."""

    def __init__(self, llm, lock, progress: bool = False):
        self.llm, self.lock, self.progress = llm, lock, progress
        self.config = llm.config

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    def render_chat(self, conv, chat_template: str | None = None):
        with self.lock:
            (p,), _ = self.llm._render_chats([conv], None, chat_template)
        return p.token_ids

    def generate(self, prompts, params, use_tqdm=False):
        return generate_shared(self.llm, self.lock, prompts, params, progress=self.progress)


def _row_error(task: LLMTask, out: dict, i: int, message: str) -> None:
    if task.on_error == "raise":
        raise ValueError(f"row {i} of the partition: {message}")
    out["llm_error"][i] = message


def _is_null(value) -> bool:
    return value is None or value is pd.NA or value is pd.NaT or (isinstance(value, float) and math.isnan(value))


def _text(value, what: str) -> str:
    """The value as a non-empty string, or raise ``ValueError`` saying what is wrong.

    Bytes (a binary column) are read as UTF-8. The value is only ever text for the model:
    a string that names a file is never opened."""
    if _is_null(value):
        raise ValueError(f"{what} is null")
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{what} is not valid UTF-8: byte {value[exc.start]:#04x} at offset {exc.start}") from None
    if not isinstance(value, str):
        raise ValueError(f"{what} is not a string ({type(value).__name__})")
    if not value.strip():
        raise ValueError(f"{what} is empty")
    return check_unicode(value, what)


def _cell_texts(df: pd.DataFrame, spec: str, task: LLMTask, out: pd.DataFrame) -> dict[int, str]:
    """Row position -> text, from a column or a ``{column}`` template; bad rows get errors."""
    texts = {}
    records = df.to_dict("records") if is_template(spec) else None
    values = None if records is not None else df[spec].tolist()
    for i in range(len(df)):
        try:
            if records is not None:
                row = {k: _template_value(records[i][k], f"column {k!r}") for k in template_fields(spec)}
                try:
                    texts[i] = spec.format_map(row)
                except (ValueError, TypeError) as exc:  # a format spec this row's value does not fit
                    raise ValueError(f"template {spec!r}: {exc}") from None
                check_unicode(texts[i], f"template {spec!r}")
            else:
                texts[i] = _text(values[i], f"column {spec!r}")
        except ValueError as exc:
            _row_error(task, out, i, str(exc))
    return texts


TEMPLATE_SCALARS = (str, bool, int, float, decimal.Decimal, datetime.date, datetime.time, datetime.timedelta)


def _template_value(value, what: str):
    """A row's value for a template field, formatted later exactly as ``str.format`` would:
    text (bytes read as UTF-8) and scalars (ints, floats, bools, dates, times, decimals)
    pass as they are, so ``{price:.2f}`` works; a null (None, NA, NaN, NaT) is the row's
    error naming the column, and so is a nested value (a list, a dict) or an empty text."""
    if _is_null(value):
        raise ValueError(f"{what} is null")
    if isinstance(value, (str, bytes, bytearray)):
        return _text(value, what)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a numpy scalar
        value = value.item()
    if not isinstance(value, TEMPLATE_SCALARS):
        raise ValueError(f"{what} holds a {type(value).__name__}; templates format text, numbers, booleans, "
                         "dates and decimals (pass a column of text for anything else)")
    return value


def _row_params(df: pd.DataFrame, task: LLMTask, rows, out: dict) -> dict[int, SamplingParams]:
    base = SamplingParams(**{k: list(v) if isinstance(v, tuple) else v for k, v in task.sampling})
    if not task.sampling_column:
        return {i: base for i in rows}
    params, column = {}, df[task.sampling_column].tolist()
    for i in rows:
        try:
            value = column[i]
            if isinstance(value, str):  # Dask's convert-string, or JSON text from CSV
                value = literal_text(value, dict, "a dict of SamplingParams fields")
            if _is_null(value):
                params[i] = base
            elif not isinstance(value, Mapping):
                raise ValueError(f"must be a dict of SamplingParams fields, got {type(value).__name__}")
            else:
                # null fields are unset (a parquet struct column has every field in every row)
                row = SamplingParams.from_dict({k: v for k, v in dict(value).items() if v is not None and v is not pd.NA})
                if row.n != 1:
                    raise ValueError("n must be 1 in a dataframe (one output per row)")
                params[i] = row
        except (ValueError, TypeError) as exc:
            _row_error(task, out, i, f"sampling_params: {exc}")
    return params


def _generate(df, task, llm, out, prompts: dict[int, list[int]]) -> None:
    params = _row_params(df, task, list(prompts), out)
    limit = llm.config.max_model_len
    rows = []
    for i in sorted(params):
        if not prompts[i]:
            _row_error(task, out, i, "the prompt is empty (no tokens; a chat template rendered nothing)")
            continue
        if len(prompts[i]) > limit:
            _row_error(task, out, i, f"prompt has {len(prompts[i])} tokens, longer than max_model_len={limit}")
            continue
        try:
            check_params_for_model(params[i], i, llm.config.hf_config.vocab_size)
        except ValueError as exc:
            _row_error(task, out, i, f"sampling_params: {str(exc).split(': ', 1)[1]}")
            continue
        rows.append(i)
    if not rows:
        return
    so = task.structured_params()
    if so is not None:  # the accessor's constraint replaces any a row's own sampling_params carry
        params = {i: dataclasses.replace(params[i], structured_outputs=so) for i in rows}
    results = llm.generate([{"prompt_token_ids": prompts[i]} for i in rows], [params[i] for i in rows],
                           use_tqdm=False)
    arrow = task.output_dtypes()[task.output_column] if task.structured else None
    for i, r in zip(rows, results):
        c = r.outputs[0]
        out["num_input_tokens"][i] = len(r.prompt_token_ids)
        out["num_generated_tokens"][i] = len(c.token_ids)
        out["finish_reason"][i] = c.finish_reason
        if c.finish_reason == "error":  # e.g. non-finite logits: this row's error, not the batch's
            _row_error(task, out, i, c.error or "generation failed")
            continue
        if not task.structured:
            out[task.output_column][i] = c.text
            continue
        try:
            out[task.output_column][i] = _structured_value(task, c, arrow)
        except ValueError as exc:
            _row_error(task, out, i, str(exc))


def _structured_value(task: LLMTask, c, dtype):
    """The typed value of a constrained completion; ``ValueError`` when it did not complete."""
    kind = task.structured[0]
    what = "JSON" if kind == "json" else "choice"
    if not c.structured_output_complete:
        raise ValueError(f"structured output incomplete: generation stopped (finish_reason={c.finish_reason!r}, "
                         f"{len(c.token_ids)} tokens) before the {what} was complete; raise max_tokens "
                         f"(partial output: {c.text[:200]!r})")
    if kind == "choice":
        if c.text not in task.structured[1]:
            raise ValueError(f"structured output {c.text!r} is not one of the choices")
        return c.text
    try:
        value = json.loads(c.text)
    except ValueError as exc:
        raise ValueError(f"structured output is not valid JSON ({exc}): {c.text[:200]!r}") from None
    typed = to_arrow_value(value, dtype.pyarrow_dtype)
    try:  # e.g. an integer past int64: this row's error, not the partition's
        pa.array([typed], type=dtype.pyarrow_dtype)
    except (pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
        raise ValueError(f"structured output does not fit the column type {dtype.pyarrow_dtype} "
                         f"({type(exc).__name__}: {exc}): {c.text[:200]!r}") from None
    return typed


def _run_generate(df, task, llm, out) -> None:
    texts = _cell_texts(df, task.inputs[0], task, out)
    ids = llm.get_tokenizer()(list(texts.values()))["input_ids"] if texts else []
    _generate(df, task, llm, out, dict(zip(texts, ids)))


def _run_chat(df, task, llm, out) -> None:
    spec = task.inputs[0]
    convs: dict[int, list] = {}
    if is_template(spec):
        for i, text in _cell_texts(df, spec, task, out).items():
            system = [{"role": "system", "content": task.system}] if task.system else []
            convs[i] = system + [{"role": "user", "content": text}]
    else:
        for i, conv in enumerate(df[spec].tolist()):
            try:
                if _is_null(conv):
                    raise ValueError("the conversation is null")
                if isinstance(conv, str):
                    conv = _conversation_text(conv)
                if hasattr(conv, "__iter__") and not isinstance(conv, (str, bytes, Mapping)):
                    conv = [dict(m) if isinstance(m, Mapping) else m for m in conv]
                check_conversation(conv, i)
                convs[i] = ([{"role": "system", "content": task.system}] if task.system else []) + conv
            except (ValueError, TypeError) as exc:
                _row_error(task, out, i, f"messages: {exc}")
    prompts = {}
    for i, conv in convs.items():
        try:
            prompts[i] = llm.render_chat(conv, task.chat_template)
        except Exception as exc:  # a template that cannot render this conversation
            _row_error(task, out, i, f"chat template: {exc}")
    _generate(df, task, llm, out, prompts)


def literal_text(text: str, kind: type, what: str):
    """A value stored as text: JSON (CSV and JSON inputs), or the Python literal Dask's
    ``dataframe.convert-string`` leaves of a column of lists or dicts (read as data with
    ``ast.literal_eval``: literals only, nothing is evaluated). ``ValueError`` unless it
    holds a ``kind``."""
    try:
        value = json.loads(text)
    except ValueError:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise ValueError(f"a string that is neither JSON nor {what} (on Dask, 'dataframe.convert-string' "
                             "turns an object column of lists or dicts into strings)") from None
    if not isinstance(value, kind):
        raise ValueError(f"a string holding {type(value).__name__}, not {what}")
    return value


def _conversation_text(text: str) -> list:
    """A conversation stored as text (see :func:`literal_text`)."""
    try:
        return literal_text(text, list, "a list of messages")
    except ValueError as exc:
        raise ValueError(f"the conversation is {exc}") from None


def _run_embed(df, task, llm, out) -> None:
    texts = _cell_texts(df, task.inputs[0], task, out)
    if texts:
        embs = llm.embed(list(texts.values()), use_tqdm=False)
        for i, e in zip(texts, embs):
            out[task.output_column][i] = e.outputs.embedding


def _run_classify(df, task, llm, out) -> None:
    texts = _cell_texts(df, task.inputs[0], task, out)
    if texts:
        results = llm.classify(list(texts.values()), use_tqdm=False)
        for i, r in zip(texts, results):
            out[task.output_column][i] = r.outputs.label
            out["probs"][i] = r.outputs.probs


def _run_score(df, task, llm, out) -> None:
    left = _cell_texts(df, task.inputs[0], task, out)
    right = _cell_texts(df, task.inputs[1], task, out)
    rows = [i for i in left if i in right]
    if rows:
        scores = llm.score([left[i] for i in rows], [right[i] for i in rows], use_tqdm=False)
        for i, s in zip(rows, scores):
            out[task.output_column][i] = s.outputs.score


RUNNERS = {"generate": _run_generate, "chat": _run_chat, "embed": _run_embed, "classify": _run_classify,
           "score": _run_score}
