"""Ray Data LLM's ``build_processor``, re-expressed on Dask.

``build_processor(config, preprocess, postprocess)`` returns a callable that maps a Dask
DataFrame, row by row, through ``preprocess`` (a function of the row dict returning the
fields ``messages`` or ``prompt``, and optionally ``sampling_params``), the engine, and
``postprocess`` (a function of the row dict, with the engine's outputs added, returning the
output row). As in Ray Data LLM, the input row's columns are carried through to
``postprocess`` beside ``generated_text`` (or ``embedding``, ``probs``, ``score``),
``num_input_tokens`` and ``num_generated_tokens``. A row whose preprocessing, inference
or postprocessing fails carries the message in ``llm_error`` (its engine outputs are None
when ``postprocess`` sees it) and every other row goes on. The output always has an
``llm_error`` column, added after ``postprocess``'s columns if it does not keep one.

Task inputs by ``task_type``: ``generate`` reads ``messages`` (with
``apply_chat_template``) or ``prompt``; ``embed`` and ``classify`` read ``prompt``;
``score`` reads ``text_1`` and ``text_2``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pandas as pd
import pyarrow as pa

from dfllm.accessors.schema import output_dtypes
from dfllm.accessors.task import make_task, run_task

TASK_TYPES = ("generate", "embed", "classify", "score")
_SAMPLE_VALUES = {"generated_text": "", "num_input_tokens": 0, "num_generated_tokens": 0, "finish_reason": "length",
                  "embedding": [0.0], "probs": [0.0], "label": "", "score": 0.0, "llm_error": None}


@dataclass
class ProcessorConfig:
    """Ray Data LLM's ``vLLMEngineProcessorConfig`` fields that apply to dfllm.

    ``model_source`` is a model directory or bundled alias (None: the default model of the
    task); ``engine_kwargs`` go to :class:`dfllm.LLM`; ``batch_size`` rows of a partition
    go to the engine per call. ``chat_template`` (Jinja text, rendered sandboxed) replaces
    the tokenizer's template for ``messages`` rows. ``concurrency`` is accepted for parity:
    on Dask the cluster's workers, one engine each, set the parallelism.
    """

    model_source: str | None = None
    engine_kwargs: dict = field(default_factory=dict)
    batch_size: int = 32
    concurrency: int | tuple[int, int] = 1
    task_type: str = "generate"
    apply_chat_template: bool = True
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.task_type not in TASK_TYPES:
            raise ValueError(f"task_type must be one of {TASK_TYPES}, got {self.task_type!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError("chat_template must be a Jinja template string")


class Processor:
    """Callable from a Dask (or pandas) DataFrame to the postprocessed results."""

    def __init__(self, config: ProcessorConfig, preprocess: Callable | None, postprocess: Callable | None):
        self.config, self.preprocess, self.postprocess = config, preprocess, postprocess

    def __call__(self, df):
        if isinstance(df, pd.DataFrame):
            return self.process_partition(df)
        meta = self._meta(df._meta_nonempty.iloc[:1])
        return df.map_partitions(self.process_partition, dict(meta.dtypes), meta=meta)

    def process_partition(self, df: pd.DataFrame, dtypes: dict | None = None) -> pd.DataFrame:
        """Run one pandas partition through preprocess, the engine and postprocess
        (with ``dtypes``: exactly those columns, as those Arrow-backed types)."""
        rows = [self._pre(r) for r in df.to_dict("records")]
        out_rows = []
        for start in range(0, len(rows), self.config.batch_size):
            out_rows += self._infer(rows[start : start + self.config.batch_size])
        result = pd.DataFrame([self._post(r) for r in out_rows], index=df.index)
        if dtypes is None:
            return result
        return pd.DataFrame({c: _typed(result[c] if c in result else [None] * len(result), t, result.index)
                             for c, t in dtypes.items()}, index=result.index)

    def _post(self, row: dict) -> dict:
        error = row.get("llm_error")
        out = row
        if self.postprocess is not None:
            try:
                out = dict(self.postprocess(row))
            except Exception as exc:  # a user function failing on one row
                out, error = {}, error or f"postprocess: {type(exc).__name__}: {exc}"
        out.setdefault("llm_error", error)
        if out["llm_error"] is None:
            out["llm_error"] = error
        return out

    def _pre(self, row: dict) -> dict:
        if self.preprocess is None:
            return row
        try:
            return {**row, **self.preprocess(row)}
        except Exception as exc:  # a user function failing on one row
            return {**row, "llm_error": f"preprocess: {type(exc).__name__}: {exc}"}

    def _infer(self, rows: list[dict]) -> list[dict]:
        failed = [r.get("llm_error") is not None for r in rows]
        if all(failed):
            return [self._no_outputs(r) for r in rows]
        frame = pd.DataFrame([{} if bad else r for r, bad in zip(rows, failed)])
        kind, inputs = self._task_inputs(frame)
        sampling = "sampling_params" if "sampling_params" in frame and kind in ("generate", "chat") else None
        task = make_task(kind, inputs, frame.columns, output_column=_main_output(kind), model=self.config.model_source,
                         sampling_params=sampling, engine_kwargs=self.config.engine_kwargs,
                         chat_template=self.config.chat_template if kind == "chat" else None)
        result = run_task(frame.drop(columns=[c for c in task.output_dtypes() if c in frame]), task)
        outputs = result[list(task.output_dtypes())].astype(object).where(result.notna(), None).to_dict("records")
        return [self._no_outputs(r) if bad else {**r, **o} for r, o, bad in zip(rows, outputs, failed)]

    def _no_outputs(self, row: dict) -> dict:
        """A failed row with its engine outputs set to None."""
        kind, _ = self._task_inputs(row)
        return {**row, **{c: None for c in output_dtypes(kind, _main_output(kind))}, "llm_error": row["llm_error"]}

    def _task_inputs(self, columns) -> tuple[str, tuple[str, ...]]:
        t = self.config.task_type
        if t == "score":
            return "score", ("text_1", "text_2")
        if t == "generate" and self.config.apply_chat_template and "messages" in columns:
            return "chat", ("messages",)
        return t, ("prompt",)

    def _meta(self, sample: pd.DataFrame) -> pd.DataFrame:
        """Output columns, from preprocess and postprocess run on a sample row with stand-in
        engine outputs (no model runs)."""
        rows = [self._pre(r) for r in sample.to_dict("records")]
        kind, _ = self._task_inputs(rows[0] if rows else {})
        outputs = {c: _SAMPLE_VALUES[c] for c in output_dtypes(kind, _main_output(kind))}
        fake = [{**r, **outputs} for r in rows]
        table = pa.Table.from_pylist([self._post(r) for r in fake])
        # columns postprocess left empty on the sample row (like llm_error) are strings
        schema = pa.schema([pa.field(f.name, pa.string() if pa.types.is_null(f.type) else f.type) for f in table.schema])
        return table.cast(schema).to_pandas(types_mapper=pd.ArrowDtype).iloc[:0]


def _typed(values, dtype, index) -> pd.Series:
    """``values`` as a column of ``dtype`` (Arrow-backed types built through pyarrow)."""
    values = list(values)
    if isinstance(dtype, pd.ArrowDtype):
        return pd.Series(pa.array(values, type=dtype.pyarrow_dtype, from_pandas=True), index=index, dtype=dtype)
    return pd.Series(values, index=index).astype(dtype)


def _main_output(kind: str) -> str:
    return {"generate": "generated_text", "chat": "generated_text", "embed": "embedding", "classify": "label",
            "score": "score"}[kind]


def build_processor(config: ProcessorConfig, preprocess: Callable | None = None,
                    postprocess: Callable | None = None) -> Processor:
    """A processor mapping a Dask DataFrame through ``preprocess``, the engine and ``postprocess``."""
    return Processor(config, preprocess, postprocess)
