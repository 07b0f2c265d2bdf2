"""The accessor tasks (``generate``, ``chat``, ``embed``, ``score``, ``classify``), one
:class:`TaskKind` each, in one registry, :data:`KINDS`.

A kind says how many inputs it reads, its main output column's default name and dtype,
the other columns it adds (every task ends with ``llm_error``), whether it takes sampling
params and structured outputs (the generative kinds, which share the engine's continuous
batches), its default model, and the function that runs it on one partition. The
accessors' signatures, the output schemas (pandas, Dask ``meta``, Polars), the processor
and the CLI all read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from dfllm.accessors.runners import run_chat, run_classify, run_embed, run_generate, run_score
from dfllm.accessors.schema import (
    FINISH_REASON,
    FLOAT,
    INT,
    LLM_ERROR,
    NUM_GENERATED_TOKENS,
    NUM_INPUT_TOKENS,
    PROBS,
    STRING,
    VECTOR,
    structured_dtype,
)

DEFAULT_EMBED_MODEL = "all-minilm-l6-v2"  # bundled: embed's and score's default model
GENERATED_TEXT = "generated_text"


@dataclass(frozen=True)
class TaskKind:
    """One accessor task: what it reads, what it adds, and how it runs."""

    name: str
    inputs: int  # input columns or templates (score: 2)
    output_column: str  # the main output column's default name
    output_dtype: pd.api.extensions.ExtensionDtype  # the main column's dtype (unconstrained)
    other_columns: tuple[tuple[str, pd.api.extensions.ExtensionDtype], ...]  # after the main one
    generative: bool  # takes sampling_params, json_schema and choice; rows share the engine's batches
    runner: Callable  # runner(df, task, out, engine): fills ``out`` (see dfllm.accessors.runners)
    default_model: str | None = None  # None: LLM's default (the bundled chat model), unless model_required
    model_required: str | None = None  # what to pass as model= when the kind has no default

    def output_dtypes(self, output_column: str, structured: tuple = ()) -> dict[str, pd.api.extensions.ExtensionDtype]:
        """Columns the task adds, in order, with their dtypes (``llm_error`` always last).

        ``structured`` is ``("json", schema_text)`` or ``("choice", (values...))`` for a
        constrained generation (its main column is typed from it), else empty."""
        main = structured_dtype(structured) if structured else self.output_dtype
        return {output_column: main, **dict(self.other_columns), LLM_ERROR: STRING}


_GENERATION_COLUMNS = ((NUM_INPUT_TOKENS, INT), (NUM_GENERATED_TOKENS, INT), (FINISH_REASON, STRING))

KINDS: dict[str, TaskKind] = {k.name: k for k in (
    TaskKind("generate", 1, GENERATED_TEXT, STRING, _GENERATION_COLUMNS, True, run_generate),
    TaskKind("chat", 1, GENERATED_TEXT, STRING, _GENERATION_COLUMNS, True, run_chat),
    TaskKind("embed", 1, "embedding", VECTOR, (), False, run_embed, DEFAULT_EMBED_MODEL),
    TaskKind("score", 2, "score", FLOAT, (), False, run_score, DEFAULT_EMBED_MODEL),
    TaskKind("classify", 1, "label", STRING, ((PROBS, VECTOR),), False, run_classify,
             model_required="a classifier model"),
)}


def task_kind(name: str) -> TaskKind:
    """The task kind called ``name``; ``ValueError`` for an unknown one."""
    if name not in KINDS:
        raise ValueError(f"unknown task {name!r}")
    return KINDS[name]
