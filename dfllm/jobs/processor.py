"""Ray Data LLM's ``build_processor(config, preprocess, postprocess)`` on Dask: the
:class:`Processor` maps a Dask (or pandas) DataFrame row by row through ``preprocess``, the
engine (``.llm`` tasks, Ray's engine columns added) and ``postprocess``, keeping failed rows
as error rows. The config classes are in :mod:`dfllm.jobs.ray_config`, the output typing in
:mod:`dfllm.accessors.arrow_schema`; how to use it, the output's columns and types, error
rows and resumable writes: docs/from_ray.md."""

from __future__ import annotations

import dataclasses
import inspect
import re
import uuid
import warnings
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa

from dfllm.accessors.arrow_schema import (
    STRING,
    Meta,
    infer_dtype,
    input_dtypes,
    join_errors,
    meta_dtypes,
    typed_column,
)
from dfllm.accessors.partitions import WritableFunction
from dfllm.accessors.placement import run_placed
from dfllm.errors import MAX_NESTING_DEPTH, nesting_depth, shown, value_text
from dfllm.jobs.fingerprint import FingerprintError, fingerprint
from dfllm.jobs.ray_config import RAY_ERROR, check_dict, vLLMEngineProcessorConfig
from dfllm.tasks.kinds import KINDS, LOGPROB_MAP
from dfllm.tasks.response_cache import ResponseCache, as_cache
from dfllm.tasks.schema import LLM_ERROR, error_text
from dfllm.tasks.task import make_task, repeated_columns
from dfllm.tasks.templates import is_null
from dfllm.tasks.write_key import canonical

SAMPLE_ROWS = 8
ERROR = LLM_ERROR


class RowFailedError(RuntimeError):
    """A row failed in a processor built with ``should_continue_on_error=False``: ``row`` is
    its index label, ``error`` the message it would have had in the error column, and
    ``position`` its place in its partition where the label does not tell it from another
    row of the partition (a repeated label; else None)."""

    def __init__(self, message: str, row=None, error: str | None = None, position: int | None = None):
        super().__init__(message)
        self.row, self.error, self.position = row, error, position

    def __reduce__(self):
        return type(self), (str(self), self.row, self.error, self.position)


class RowResult(NamedTuple):
    """One row through the pipeline: its input values, postprocess's output (None for an
    error row, which bypasses postprocess) and its error message (None if it succeeded)."""

    inputs: dict
    output: dict | None
    error: str | None


# ---- Ray Data LLM's engine columns ------------------------------------------------------------------
#: The engine columns (``dfllm.tasks.kinds.ENGINE_COLUMNS``) a processor's tasks ask for,
#: by task kind, and Ray's name of each (its ``prompt`` is the engine's ``rendered_prompt``).
RAY_COLUMNS: dict[str, dict[str, str]] = {
    "generate": {
        "rendered_prompt": "prompt",
        "prompt_token_ids": "prompt_token_ids",
        "generated_tokens": "generated_tokens",
        "logprobs": "logprobs",
        "prompt_logprobs": "prompt_logprobs",
        "time_taken_llm": "time_taken_llm",
    },
    "embed": {"embeddings": "embeddings", "time_taken_llm": "time_taken_llm"},
}
RAY_COLUMNS.update(chat=RAY_COLUMNS["generate"], classify=RAY_COLUMNS["embed"], score=RAY_COLUMNS["embed"])
_LOGPROBS = pd.ArrowDtype(pa.list_(LOGPROB_MAP))
#: The type of an engine column that is null in every sampled row (see ``_schema_from``).
_ENGINE_FALLBACK = {"logprobs": _LOGPROBS, "prompt_logprobs": _LOGPROBS}
#: What a row may hand the engine (from preprocess), besides the task's inputs.
_OPTIONAL_KEYS = ("tokenized_prompt", "sampling_params", "pooling_params", "chat_template_kwargs")
#: What a row may hand the engine as a dict (a mapping preprocess returns is read into one).
_MAPPING_KEYS = ("sampling_params", "pooling_params", "chat_template_kwargs")
_LORA_COLUMN = "__dfllm_lora__"  # Ray's multi-LoRA: each row's adapter name (None: the base model)


class ProcessorFunction(WritableFunction):
    """What a processor maps over a Dask frame's partitions: its pipeline into ``schema``
    (column -> dtype). Its write key (for :func:`dfllm.write_parquet`) is the config's
    output settings, the schema, and the fingerprints of preprocess and postprocess (or
    ``key``); see Writing resumably in docs/from_ray.md."""

    kind = "processor"

    def __init__(self, processor: Processor, schema: dict, key: str | None = None):
        self.processor, self.schema, self.key = processor, schema, key
        self.resources = processor.config.task_resources()
        self.error_column = processor.config.error_column
        self.__name__ = "llm-processor"
        self._token = uuid.uuid4().hex  # Dask's name for this call (the functions need not pickle the same twice)

    def run(self, df: pd.DataFrame) -> pd.DataFrame:
        return self.processor.process_partition(df, self.schema)

    def __dask_tokenize__(self):
        return (type(self).__name__, self._token)

    def response_cache(self) -> ResponseCache | None:
        return as_cache(self.processor.config.cache)  # only a generate config has one (its check)

    def model_sources(self) -> tuple:
        """The model the processor's engine loads, for the writer to put its content identity
        into a resumable write's key: ``model_source``, or the task's default model when it
        is None (``all-minilm-l6-v2`` for embed and score; None, the writer's default chat
        model, for generate), as the engine calls resolve it."""
        config = self.processor.config
        return (config.model_source or KINDS[config.task_type].default_model,)

    @property
    def write_key(self) -> str:
        p = self.processor
        if self.key is not None:
            functions: dict = {"key": self.key}
        else:
            try:
                functions = {"preprocess": fingerprint(p.preprocess), "postprocess": fingerprint(p.postprocess)}
            except FingerprintError as exc:
                raise ValueError(
                    f"write_parquet: {exc}, so a resumed write could not tell whether earlier parts came from "
                    "the same preprocess and postprocess; pass key= (a name for what they do, changed whenever "
                    "they change) to build_processor or to the processor call"
                ) from None
        try:
            return canonical({"processor": 2, "config": p.config.output_settings(), "schema": self.schema, **functions})
        except TypeError as exc:  # e.g. a callable in engine_kwargs
            raise ValueError(
                f"write_parquet: the processor's config has a value with no stable key ({exc}); "
                "a resumed write could not tell whether earlier parts came from the same config"
            ) from None


def _check_key(key) -> str | None:
    if key is not None and (not isinstance(key, str) or not key):
        raise ValueError(f"key= must be a non-empty string naming what preprocess and postprocess do, got {key!r}")
    return key


class Processor:
    """Callable from a Dask (or pandas) DataFrame to the postprocessed results.

    See docs/from_ray.md for the output's columns, their types, error rows, and writing the
    result resumably.
    """

    def __init__(
        self,
        config: vLLMEngineProcessorConfig,
        preprocess: Callable[[dict], dict] | None,
        postprocess: Callable[[dict], dict] | None,
        *,
        meta: Meta | None = None,
        sample_rows: int = SAMPLE_ROWS,
        key: str | None = None,
    ):
        if sample_rows < 1:
            raise ValueError(f"sample_rows must be >= 1, got {sample_rows}")
        self.key = _check_key(key)
        self.config, self.preprocess, self.postprocess = config, preprocess, postprocess
        # the error column while rows run (with should_continue_on_error=False, dropped after
        # the check that no row failed)
        self._err = config.error_column or ERROR
        self.meta = None if meta is None else meta_dtypes(meta)
        self.sample_rows = sample_rows

    def __call__(self, df, *, meta: Meta | None = None, key: str | None = None):
        """Map ``df`` through the pipeline: a pandas DataFrame is processed now; a Dask
        DataFrame gives a lazy one whose columns and dtypes are known (from ``meta``, this
        call's or the processor's, else from running its first rows now), which
        :func:`dfllm.write_parquet` writes resumably (``key``, this call's or the
        processor's, stands in for the fingerprints of preprocess and postprocess)."""
        given = meta_dtypes(meta) if meta is not None else self.meta
        key = _check_key(key) if key is not None else self.key
        if isinstance(df, pd.DataFrame) or hasattr(df, "_meta"):
            _check_columns(df.columns)
        if isinstance(df, pd.DataFrame):
            return self.process_partition(df, None if given is None else self._with_inputs(given, df.iloc[:0]))
        if not hasattr(df, "map_partitions") or not hasattr(df, "_meta"):
            raise TypeError(f"a processor maps a pandas or Dask DataFrame, got {type(df).__name__}")
        schema = self._with_inputs(given, df._meta) if given is not None else self._sample_schema(df)
        if self.config.error_column is None:
            schema.pop(self._err, None)
        empty = pd.DataFrame({c: pd.Series([], dtype=t) for c, t in schema.items()}, index=df._meta.index[:0])
        return df.map_partitions(ProcessorFunction(self, schema, key), meta=empty)

    # ---- one partition ------------------------------------------------------------------------------
    def process_partition(self, df: pd.DataFrame, schema: dict | None = None) -> pd.DataFrame:
        """Run one pandas partition through preprocess, the engine and postprocess; with
        ``schema`` (column -> dtype) the result has exactly those columns and types, else
        they are taken from this partition's rows. With ``should_continue_on_error=False`` a
        failed row raises :class:`RowFailedError`."""
        rows = self.run_rows(df)
        if schema is None:
            schema, _ = self._schema_from(rows, df)
        source = "postprocess" if self.postprocess is not None else "preprocess"
        out = _frame(rows, schema, df.index, [c for c in df.columns if c != self._err], self._err, source)
        if self.config.error_column is not None:
            return out
        failed = out[self._err].notna().to_numpy()
        if failed.any():
            at = int(failed.argmax())
            repeated = bool(out.index.duplicated(keep=False)[at])  # the label alone does not name the row
            raise self._row_failed(out.index[at], out[self._err].iloc[at], at if repeated else None)
        return out.drop(columns=[self._err])

    def _row_failed(self, label, error: str, position: int | None = None) -> RowFailedError:
        """The error of the failed row labelled ``label``, named as the processor's other
        errors name rows (:func:`_label_text`), once: an error that starts by naming the
        row (``row 'r7': ...``) is not named again; ``position``: its place in its partition
        (given where the label is repeated there)."""
        label = _plain_label(label)
        row = f"row {_label_text(label)}"
        reason = error.removeprefix(f"{row}: ")
        if position is not None:
            row += f" (position {position} in its partition, which has more than one row labelled so)"
        return RowFailedError(
            f"build_processor: {row} failed: {reason} (should_continue_on_error=False; "
            f"set it to True to keep failed rows, with the error in {RAY_ERROR!r})",
            label,
            error,
            position,
        )

    def run_rows(self, df: pd.DataFrame) -> list[RowResult]:
        """Each row of ``df`` through preprocess, the engine (``batch_size`` rows per call)
        and postprocess, as :class:`RowResult`."""
        inputs = df.to_dict("records")
        labels = list(df.index)
        pre = [self._upstream(r) or self._pre(r) for r in inputs]
        engine_rows: list[tuple[dict, str | None]] = []
        for start in range(0, len(pre), self.config.batch_size):
            stop = start + self.config.batch_size
            engine_rows += self._infer(pre[start:stop], labels[start:stop], inputs[start:stop])
        return [self._post(inp, row, err) for inp, (row, err) in zip(inputs, engine_rows)]

    def _upstream(self, row: dict) -> tuple[dict, str | None] | None:
        """A row that failed in an earlier stage (its incoming error column, the one this
        processor writes, is set): it skips preprocess, the engine and postprocess and keeps
        that message as its error. None for the other rows."""
        earlier = error_text(row.get(self._err))  # as text the error column can hold
        if self._err not in row or earlier is None:
            return None
        return row, earlier

    def _pre(self, row: dict) -> tuple[dict, str | None]:
        """The row preprocess makes of ``row`` (its keys over the input's), and its error: one
        preprocess raised or returned in place of a dict, or the message preprocess wrote in
        the error column (a non-null value there fails the row, as postprocess's does)."""
        if self.preprocess is None:
            return row, None
        try:
            out = self.preprocess(dict(row))  # a copy: the input values stay as they were
            if not isinstance(out, Mapping):
                raise TypeError(f"preprocess must return a dict, got {type(out).__name__}")
            out = dict(out)
        except Exception as exc:  # a user function failing on one row
            return row, f"preprocess: {type(exc).__name__}: {value_text(exc)}"
        return {**row, **out}, error_text(out.get(self._err))

    def _infer(
        self, rows: list[tuple[dict, str | None]], labels: list, inputs: list[dict]
    ) -> list[tuple[dict, str | None]]:
        """Engine outputs added to the rows without an error; the engine's per-row errors,
        each naming its row by ``labels`` (the rows' index labels). Rows are grouped by the
        task they need (a chat, a prompt, token ids), one engine call per group; ``inputs``:
        the input rows they were made from (see :meth:`_run_group`)."""
        results = list(rows)
        groups: dict[tuple, list[int]] = {}
        for i, (row, err) in enumerate(rows):
            if err is not None:
                continue
            kind, fields, problem = self._row_task(row)
            if problem is not None:
                results[i] = (row, problem)
            else:
                groups.setdefault((kind, fields), []).append(i)
        for (kind, fields), members in groups.items():
            done = self._run_group(
                kind, fields, [rows[i][0] for i in members], [labels[i] for i in members], [inputs[i] for i in members]
            )
            for i, (row, err) in zip(members, done):
                results[i] = (row, err)
        return results

    def _row_task(self, row: dict) -> tuple[str, tuple[str, ...], str | None]:
        """The task kind and inputs a row needs, and what it lacks for them (or None)."""
        t = self.config.task_type
        has = lambda key: key in row and not is_null(row[key])  # noqa: E731
        if t == "score":
            missing = [c for c in ("text_1", "text_2") if c not in row]
            problem = f"no {' or '.join(map(repr, missing))} for the score task (preprocess must return both)"
            return "score", ("text_1", "text_2"), problem if missing else None
        if t == "generate":
            chat = self.config.apply_chat_template
            if has("tokenized_prompt"):
                return "generate", ("prompt",), None
            if chat and has("messages"):
                return "chat", ("messages",), None
            if "prompt" in row:
                return "generate", ("prompt",), None
            wanted = (
                "'messages', 'prompt' or 'tokenized_prompt'"
                if chat
                else "'prompt' or 'tokenized_prompt' (the chat template stage is off: 'messages' is not read)"
            )
            return t, (), f"no {wanted} for the generate task (preprocess must return one)"
        if "prompt" not in row:
            return t, (), f"no 'prompt' for the {t} task (preprocess must return it)"
        return t, ("prompt",), None

    def _run_group(
        self, kind: str, inputs: tuple[str, ...], rows: list[dict], labels: list, originals: list[dict]
    ) -> list[tuple[dict, str | None]]:
        """``rows`` (all needing the task ``kind`` of ``inputs``) through the engine: each
        row with the engine's columns (Ray's names) added, and its error, which names the
        row by its label in ``labels`` (see :func:`_name_row`). A value preprocess wrote in
        a column the engine writes (other than its inputs and ``prompt``), which the
        engine's would replace, fails its row naming the column (:func:`_overwritten`;
        ``originals``: the input rows, whose values passed through unchanged do not count)."""
        errors: list[str | None] = [None] * len(rows)
        optional = [k for k in _OPTIONAL_KEYS if any(k in r for r in rows)]
        # object columns: each value as it is reaches the task's own per-row checks (pandas
        # would make text an Arrow string column, which a lone surrogate fails as a whole)
        frame = pd.DataFrame({c: _objects([r.get(c) for r in rows]) for c in (*inputs, *optional)})
        for name in _MAPPING_KEYS:
            if name in frame:
                frame[name] = _objects([_as_dict(v, name, errors, j) for j, v in enumerate(frame[name])])
        if "sampling_params" in frame:
            frame["sampling_params"] = _objects(
                [self._sampling_params(v, errors, j) for j, v in enumerate(frame["sampling_params"])]
            )
        generative = KINDS[kind].generative
        model = self.config.model_source or KINDS[kind].default_model  # None: the task's default model
        ctk = self.config.chat_template_kwargs or None
        lora = self._lora(frame, rows, generative, model)  # a column of each row's adapter (Ray's multi-LoRA)
        task = make_task(
            kind,
            inputs,
            frame.columns,
            output_column=KINDS[kind].output_column,
            model=model,
            sampling_params="sampling_params" if generative and "sampling_params" in frame else None,
            engine_kwargs=self.config.engine_kwargs,
            engine_columns=tuple(RAY_COLUMNS[kind]),
            chat_template=self.config.chat_template if kind == "chat" else None,
            pooling_params="pooling_params" if not generative and "pooling_params" in frame else None,
            chat_template_kwargs=(ctk if "chat_template_kwargs" not in frame else "chat_template_kwargs")
            if kind == "chat"
            else None,
            continue_final_message=kind == "chat",
            prompt_token_ids="tokenized_prompt" if generative and "tokenized_prompt" in frame else None,
            cache=self.config.cache if generative else None,
            **lora,
        )
        if kind == "chat" and ctk and "chat_template_kwargs" in frame:  # the config's, a row's own over them
            frame["chat_template_kwargs"] = _objects(
                [
                    {**ctk, **v} if isinstance(v, Mapping) else ctk if is_null(v) else v
                    for v in frame["chat_template_kwargs"]
                ]
            )
        result = run_placed(
            frame.iloc[[j for j, e in enumerate(errors) if e is None]], task, self.config.task_resources()
        )
        cols = list(task.output_dtypes())
        outputs = iter(result[cols].astype(object).where(result[cols].notna(), None).to_dict("records"))
        names = {ERROR: self._err, **RAY_COLUMNS[kind]}
        done: list[tuple[dict, str | None]] = []
        position = 0  # the row's place in the engine call (which its error names)
        for row, error, label, original in zip(rows, errors, labels, originals):
            if error is not None:
                done.append((row, error))
                continue
            out = {names.get(k, k): v for k, v in next(outputs).items()}
            engine_error = error_text(out[self._err])
            if engine_error is not None:
                out[self._err] = engine_error = _name_row(engine_error, position, label)
            lost = _overwritten(row, original, [k for k in out if k != self._err and k not in (*inputs, "prompt")])
            if lost:
                engine_error = join_errors(
                    engine_error,
                    f"preprocess returned column(s) {lost} that the engine writes (its output would replace "
                    "them); rename them",
                )
            done.append(({**row, **out}, engine_error))
            position += 1
        return done

    def _lora(self, frame: pd.DataFrame, rows: list[dict], generative: bool, model) -> dict:
        """Ray's multi-LoRA: with ``dynamic_lora_loading_path``, each row's adapter (its ``model``
        when that differs from ``model_source``; else None, the base model) in a column of
        ``frame``, and ``make_task``'s arguments reading it."""
        root = self.config.dynamic_lora_loading_path
        if root is None or not generative:
            return {}
        frame[_LORA_COLUMN] = _objects(
            [
                None if is_null(r.get("model")) or str(r.get("model")) == str(model) else str(r.get("model"))
                for r in rows
            ]
        )
        return {"lora": _LORA_COLUMN, "lora_root": root}

    def _sampling_params(self, value, errors: list, j: int):
        """A row's ``sampling_params`` as the engine task reads them: Ray's ``guided_decoding``
        is dfllm's ``structured_outputs``; with the detokenize stage on, the text is always
        detokenized (as Ray's stage detokenizes ``generated_tokens`` even when the row's
        params say ``detokenize=False``)."""
        if not isinstance(value, Mapping):
            return value  # the task's check names it
        try:
            if nesting_depth(value) <= MAX_NESTING_DEPTH:  # deeper: as it is, for the task's check to name the field
                value = {k: _plain(v) for k, v in value.items()}  # arrays (from Arrow columns) as lists, as Ray does
            else:
                value = dict(value)
            if "guided_decoding" in value:
                guided = value.pop("guided_decoding")
                if value.get("structured_outputs") is not None and guided is not None:
                    errors[j] = "sampling_params: give guided_decoding or structured_outputs, not both"
                elif guided is not None:
                    value["structured_outputs"] = dict(guided) if isinstance(guided, Mapping) else guided
        except Exception as exc:  # noqa: BLE001  (a value of the row's own that cannot be read: its error)
            errors[j] = join_errors(errors[j], f"sampling_params: {type(exc).__name__}: {value_text(exc)}")
            return None
        if self.config.detokenize_enabled and value.get("detokenize") is False:
            value["detokenize"] = True
        return value

    def _post(self, inputs: dict, row: dict, error: str | None) -> RowResult:
        if error is not None:  # an error row bypasses postprocess
            return RowResult(inputs, None, error)
        if self.postprocess is None:
            return self._checked(inputs, row, "preprocess")
        try:
            out = self.postprocess(row)
            if not isinstance(out, Mapping):
                raise TypeError(f"postprocess must return a dict, got {type(out).__name__}")
            out = dict(out)
        except Exception as exc:  # a user function failing on one row
            return RowResult(inputs, None, f"postprocess: {type(exc).__name__}: {value_text(exc)}")
        return self._checked(inputs, out, "postprocess")

    def _checked(self, inputs: dict, out: dict, source: str) -> RowResult:
        """A row's output, or its error where ``source`` (the function whose keys the output
        has) gave a column a name that is not text (``1``, ``None``): a frame's other columns
        are text, and a file cannot hold ``1`` beside ``"1"`` (the input's own columns pass)."""
        bad = [k for k in out if not isinstance(k, str) and k not in inputs]
        if bad:
            names = ", ".join(f"{_label_text(k)} ({type(k).__name__})" for k in bad[:5])
            return RowResult(inputs, None, f"{source} returned column name(s) that are not text: {names}")
        return RowResult(inputs, out, error_text(out.get(self._err)))

    # ---- the output schema --------------------------------------------------------------------------
    def _schema_from(self, rows: list[RowResult], df: pd.DataFrame) -> tuple[dict, RowResult | None]:
        """Output column -> dtype from the values the rows produced (see Output types in
        docs/from_ray.md), and the first row without output (or None)."""
        ok = [r.output for r in rows if r.output is not None]
        names = list(dict.fromkeys(k for out in ok for k in out if k != self._err and _column_name(k)))
        inputs = _input_dtypes(df, self._err)
        schema = {}
        for name in names:
            values = [out.get(name) for out in ok]
            schema[name] = infer_dtype(values, name, inputs.get(name, _ENGINE_FALLBACK.get(name)))
        for name, dtype in inputs.items():
            schema.setdefault(name, dtype)
        schema[self._err] = STRING
        failed = next((r for r in rows if r.output is None), None)
        return schema, failed

    def _sample_rows(self, df: pd.DataFrame) -> tuple[dict | None, int, tuple | None]:
        """Run on the head of the input where partitions run: (schema or None when no row
        got through postprocess, the number of rows but those that failed in an earlier
        stage, (index label, error) of the first failed row)."""
        rows = self.run_rows(df)
        schema: dict | None
        schema, failed = self._schema_from(rows, df)
        first = None
        if failed is not None:
            label = df.index[[r is failed for r in rows].index(True)]
            first = (_plain_label(label), failed.error)
        if not any(r.output is not None for r in rows):
            schema = None
        # rows that failed in an earlier stage tell nothing of the output: with only those, look further
        count = sum(self._upstream(r) is None for r in df.to_dict("records"))
        return schema, count, first

    def _sample_schema(self, ddf) -> dict:
        """The output schema from the first rows of the first non-empty partitions of
        ``ddf``, run through the pipeline as one task (on the cluster when a distributed
        client is active)."""
        import dask

        start, step, n = 0, 1, self.sample_rows
        while start < ddf.npartitions:
            stop = min(start + step, ddf.npartitions)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Insufficient elements")
                head = ddf.partitions[start:stop].head(n, npartitions=stop - start, compute=False)
                sample = dask.delayed(self._sample_rows, pure=False)(
                    head, dask_key_name=f"llm-processor-sample-{uuid.uuid4().hex}"
                )
                schema, count, first = sample.compute()
            if first is not None and self.config.error_column is None:  # the job would fail: now
                raise self._row_failed(*first)
            if count:
                if schema is None:
                    label, error = first
                    raise ValueError(
                        f"build_processor: none of the {count} sampled rows (the first rows of the input) got "
                        f"through preprocess, the engine and postprocess, so the output columns cannot be "
                        f"taken from them; the first error, in row {_label_text(label)}: {error}. Fix the functions or "
                        "the config, or pass meta= (the output columns and their types) to build_processor "
                        "or to the processor call"
                    )
                return schema
            start, step = stop, step * 2
        raise ValueError(
            "build_processor: the input has no rows to take the output columns from; pass meta= "
            "(the output columns and their types) to build_processor or to the processor call"
        )

    def _with_inputs(self, given: dict, input_meta: pd.DataFrame) -> dict:
        """``meta=``'s columns, then the input's other columns (typed from the input), then
        the error column."""
        schema = {c: t for c, t in given.items() if c != self._err}
        for name, dtype in _input_dtypes(input_meta, self._err).items():
            schema.setdefault(name, dtype)
        schema[self._err] = STRING
        return schema


def _frame(
    rows: list[RowResult],
    schema: dict,
    index: pd.Index,
    input_columns: list,
    error: str = ERROR,
    source: str = "postprocess",
) -> pd.DataFrame:
    """The rows as a frame of exactly ``schema``'s columns (see docs/from_ray.md)."""
    n = len(rows)
    values = {c: [None] * n for c in schema if c != error}
    inputs: dict[str, set[int]] = {c: set() for c in values}  # the rows holding an input value, by column
    errors: list[str | None] = [r.error for r in rows]
    fill = []  # (row, columns) taking input values: error rows with an output
    for i, r in enumerate(rows):
        if r.output is None:
            for c in input_columns:
                if c in values:
                    values[c][i] = r.inputs.get(c)
                    inputs[c].add(i)
            continue
        extra = [k for k in r.output if k != error and k not in values]
        if extra:
            errors[i] = join_errors(
                errors[i],
                f"{source} returned column(s) {extra} that the output does not have "
                f"(its columns: {list(schema)}); pass meta= to set them",
            )
        for k, v in r.output.items():
            if k in values:
                values[k][i] = v
        fill.append((i, [c for c in input_columns if c in values and c not in r.output]))
    columns = {c: typed_column(values[c], schema[c], index, c, errors, inputs[c]) for c in values}
    refill = set()
    for i, cols in fill:  # error rows that had an output also say which input row they were
        if errors[i] is not None:
            for c in cols:
                values[c][i] = rows[i].inputs.get(c)
                inputs[c].add(i)
                refill.add(c)
    for c in refill:  # values that did not fit were set to null in the first pass
        columns[c] = typed_column(values[c], schema[c], index, c, errors, inputs[c])
    columns[error] = pd.Series([error_text(e) for e in errors], index=index, dtype=STRING)
    return pd.DataFrame(columns, index=index)


#: the field an engine error starts with (``messages: ...``, ``chat_template_kwargs: ...``)
_FIELD = re.compile(r"[A-Za-z_]\w*|chat template")


def _plain_label(label):
    """A row's index label as Python values: a numpy scalar as its Python value, in a
    MultiIndex's tuple too (``('x', 2)``, not ``('x', np.int64(2))``)."""
    if isinstance(label, np.generic):
        return label.item()
    if isinstance(label, tuple):
        return tuple(_plain_label(v) for v in label)
    return label


def _label_text(label) -> str:
    """A row's index label as an error shows it (:func:`dfllm.errors.shown`: its ``repr``,
    a lone surrogate escaped, cut at :data:`~dfllm.errors.MAX_SHOWN` characters); never
    an exception (an int past Python's digit limit)."""
    return shown(_plain_label(label))


def _name_row(error: str, position: int, label) -> str:
    """The engine's error for a row, naming the row by its index label where the engine
    named it by its place in the call (``conversation 2``), which is not the row's, as its
    conversation (``the conversation, message 0``), or not at all; the field it starts with
    stays first. From the row labelled ``'r7'`` (the third of the call): ``messages: the
    conversation, message 0: x`` is ``messages: the conversation of row 'r7', message 0:
    x``; ``messages: the conversation is null`` is
    ``messages: in row 'r7', the conversation is null``; an error with no field first is
    ``row 'r7': <error>``."""
    row = f"row {_label_text(label)}"
    field, sep, rest = error.partition(": ")
    if not sep or not _FIELD.fullmatch(field):
        return f"{row}: {error}"
    place = re.match(rf"(?:conversation|row) {position}(?!\d)|the conversation(?= must|,)", rest)
    if place is not None:
        return f"{field}: the conversation of {row}{rest[place.end() :]}"
    return f"{field}: in {row}, {rest}"


def _overwritten(row: dict, original: dict, columns: list) -> list:
    """The names of ``columns`` (the engine's output columns) that hold, in ``row``, a value
    preprocess wrote: one the input row ``original`` has not, or has as another object (an
    input value preprocess returned as it got it is the input's, which the output keeps)."""
    missing = object()
    return [c for c in columns if c in row and row[c] is not original.get(c, missing)]


def _column_name(key) -> bool:
    """Whether a key postprocess returns can name an output column: not text with no UTF-8
    form (a lone surrogate), which no frame or file can hold (the row's error names it)."""
    return not isinstance(key, str) or value_text(key) == key


def _check_columns(columns: pd.Index) -> None:
    """``ValueError`` naming the input's repeated column names (a row is a dict of them)."""
    repeated = repeated_columns(columns)
    if repeated:
        raise ValueError(f"build_processor: the input has more than one column named {repeated}; rename them")


def _as_dict(value, name: str, errors: list, j: int):
    """Row ``j``'s ``name`` (a dict-valued field: ``sampling_params``...) with a mapping that
    is not a dict as a dict (its values as they are); None, with the row's error naming the
    field, for a mapping that cannot be read (its keys or items raise). Any other value as it
    is: the task's check names it."""
    if not isinstance(value, Mapping) or type(value) is dict:
        return value
    try:
        return dict(value)
    except Exception as exc:  # noqa: BLE001  (a mapping of the row's own: its error)
        errors[j] = join_errors(
            errors[j], f"{name}: cannot be read as a dict ({type(exc).__name__}: {value_text(exc)})"
        )
        return None


def _objects(values: list) -> pd.Series:
    """``values`` as an ``object`` column, each as it is (no inference of a type they must share)."""
    return pd.Series(values, dtype=object)


def _input_dtypes(df: pd.DataFrame, error: str) -> dict:
    """:func:`input_dtypes`, with a column whose values Arrow cannot hold (an integer beyond
    64 bits, which ``input_dtypes`` lets through as ``OverflowError``) typed as text: its
    values then go into the output as any value that does not fit, null with an error naming
    the column."""
    try:
        return input_dtypes(df, error)
    except OverflowError:
        out = {}
        for name in df.columns:
            try:
                out.update(input_dtypes(df[[name]], error))
            except OverflowError:
                out[name] = STRING
        return out


def _plain(value):
    """``value`` with numpy arrays (a list column read back from Arrow) as lists, at any depth."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def build_processor(
    config: vLLMEngineProcessorConfig,
    preprocess: Callable[[dict], dict] | None = None,
    postprocess: Callable[[dict], dict] | None = None,
    preprocess_map_kwargs: dict | None = None,
    postprocess_map_kwargs: dict | None = None,
    builder_kwargs: dict | None = None,
    *,
    meta: Meta | None = None,
    sample_rows: int = SAMPLE_ROWS,
    key: str | None = None,
    cache=None,
) -> Processor:
    """A processor mapping a Dask (or pandas) DataFrame through ``preprocess``, the engine
    and ``postprocess``.

    ``meta`` describes the columns ``postprocess`` returns (a pandas DataFrame, a dict or
    list of ``(column, dtype)`` pairs, or a ``pyarrow.Schema``); without it the output's
    types come from running the first ``sample_rows`` rows of a Dask input through the
    whole pipeline when the processor is called. ``key`` (a string) names what
    ``preprocess`` and ``postprocess`` do for :func:`dfllm.write_parquet` with
    ``resume=True``, in place of their fingerprints. ``cache`` (a path or URL, a
    :class:`dfllm.ResponseCache` or a dict of its fields) sets the config's response cache
    (see :mod:`dfllm.tasks.response_cache`). See docs/from_ray.md.

    Ray Data LLM's other arguments are accepted: ``preprocess_map_kwargs`` and
    ``postprocess_map_kwargs`` (Ray's ``map`` options: Ray-cluster-only, no effect on Dask;
    dicts or None) and ``builder_kwargs`` (only ``chat_template_kwargs``, as the config's).
    """
    for name, value in (
        ("preprocess_map_kwargs", preprocess_map_kwargs),
        ("postprocess_map_kwargs", postprocess_map_kwargs),
        ("builder_kwargs", builder_kwargs),
    ):
        check_dict(name, value)
    if builder_kwargs:
        unknown = sorted(set(builder_kwargs) - {"chat_template_kwargs"})
        if unknown:
            raise TypeError(f"builder_kwargs: unknown key(s) {unknown}; dfllm takes only 'chat_template_kwargs'")
        config = dataclasses.replace(config, chat_template_kwargs=builder_kwargs["chat_template_kwargs"])
    if cache is not None:
        config = dataclasses.replace(config, cache=cache)
    return Processor(config, preprocess, postprocess, meta=meta, sample_rows=sample_rows, key=key)


def build_llm_processor(*args, **kwargs) -> Processor:
    """Ray Data LLM's older name of :func:`build_processor`, with its arguments (deprecated
    there, and here: a ``DeprecationWarning``, then the same processor)."""
    warnings.warn(
        "build_llm_processor is deprecated (as in Ray Data LLM); use build_processor", DeprecationWarning, stacklevel=2
    )
    return build_processor(*args, **kwargs)


# one signature, build_processor's (for help() and editors; the arguments are passed through)
build_llm_processor.__signature__ = inspect.signature(build_processor)  # type: ignore[attr-defined]
