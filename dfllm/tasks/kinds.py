"""The accessor tasks (``generate``, ``chat``, ``embed``, ``score``, ``classify``), one
:class:`TaskKind` each, in one registry, :data:`KINDS`.

A kind says how many inputs it reads, its main output column's default name and dtype,
the other columns it adds (every task ends with ``llm_error``), whether it takes sampling
params and structured outputs (the generative kinds, which share the engine's continuous
batches), its default model, the key of the function that runs it on one partition (the
table names its runner; it never imports the code that runs it), and the engine
columns a task may ask for besides (:data:`ENGINE_COLUMNS`: what Ray Data LLM's engine stage
gives, which :mod:`dfllm.jobs.processor` asks for, and ``num_cached_tokens``; the accessors'
``engine_columns=``). The
accessors' signatures, the output schemas (pandas, Dask ``meta``, Polars), the processor
and the CLI all read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import pyarrow as pa

from dfllm.tasks.schema import (
    BEAMS,
    BEAMS_DTYPE,
    FINISH_REASON,
    FLOAT,
    INT,
    LLM_ERROR,
    NUM_GENERATED_TOKENS,
    NUM_INPUT_TOKENS,
    PROBS,
    REASONING_CONTENT,
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
    runner: str  # the key of the function that runs it in :data:`dfllm.tasks.runners.RUNNERS`
    default_model: str | None = None  # None: LLM's default (the bundled chat model), unless model_required
    model_required: str | None = None  # what to pass as model= when the kind has no default
    engine_columns: tuple[str, ...] = ()  # the ENGINE_COLUMNS a task of this kind may ask for

    def output_dtypes(
        self,
        output_column: str,
        structured: tuple = (),
        engine_columns: tuple[str, ...] = (),
        reasoning: bool = False,
        beams: bool = False,
    ) -> dict[str, pd.api.extensions.ExtensionDtype | str]:
        """Columns the task adds, in order, with their dtypes (``llm_error`` always last).

        ``structured`` is ``("json", schema_text)`` or ``("choice", (values...))`` for a
        constrained generation (its main column is typed from it), else empty.
        ``engine_columns`` (of this kind's) are added before ``llm_error``, and then, for a
        generative kind whose engine has a reasoning parser (``reasoning``), the string column
        ``reasoning_content`` (:mod:`dfllm.reasoning`). A generative task that runs a beam search
        (``beams``) adds the list column ``beams`` after the kind's own (:data:`BEAMS_DTYPE`)."""
        main = structured_dtype(structured) if structured else self.output_dtype
        extra = {BEAMS: BEAMS_DTYPE} if beams and self.generative else {}
        extra.update({name: engine_dtype(self.name, name) for name in engine_columns})
        if reasoning and self.generative:
            extra[REASONING_CONTENT] = STRING
        return {output_column: main, **dict(self.other_columns), **extra, LLM_ERROR: STRING}


_GENERATION_COLUMNS = ((NUM_INPUT_TOKENS, INT), (NUM_GENERATED_TOKENS, INT), (FINISH_REASON, STRING))

#: The type of one token's logprobs as Ray Data LLM gives them: token id -> its Logprob's fields.
LOGPROB_MAP = pa.map_(
    pa.int64(), pa.struct([("logprob", pa.float64()), ("rank", pa.int64()), ("decoded_token", pa.string())])
)
_INTS = pd.ArrowDtype(pa.list_(pa.int64()))
#: Columns a task adds when it asks for them (``LLMTask.engine_columns``), with the names and
#: values of Ray Data LLM's vLLM engine stage, and their dtypes:
#:
#: - ``rendered_prompt``: the prompt text sent (after the chat template) -- Ray's ``prompt``,
#:   renamed so that it cannot clash with an input column called ``prompt``;
#: - ``prompt_token_ids``, ``generated_tokens``: token id lists;
#: - ``logprobs`` (rows whose sampling params ask ``logprobs=k``): per generated token a dict
#:   token id -> ``{"logprob", "rank", "decoded_token"}``; ``prompt_logprobs`` likewise per
#:   prompt token (None for the first), for ``prompt_logprobs=k``; these two are Python
#:   objects (``object`` dtype), as Ray's rows hold them;
#: - ``time_taken_llm``: seconds of the engine call that ran the row;
#: - ``embeddings`` (pooling kinds): embed's vector, classify's probabilities, ``[score]``;
#: - ``num_cached_tokens`` (generative kinds; vLLM's ``RequestOutput.num_cached_tokens``, not
#:   one of Ray's columns): the row's prompt tokens that were not computed for it, served
#:   from the prefix cache or, for a copy of an identical request computed once
#:   (``deduplicate_requests``), every prompt token but the last; for a row answered from
#:   the response cache, every prompt token;
#: - ``from_cache`` (generative kinds, bool): whether the row was answered from the response
#:   cache (``cache=``, see :mod:`dfllm.tasks.response_cache`) without the engine; its
#:   ``time_taken_llm`` is then 0.
ENGINE_COLUMNS: dict[str, pd.api.extensions.ExtensionDtype | str] = {
    "rendered_prompt": STRING,
    "prompt_token_ids": _INTS,
    "generated_tokens": _INTS,
    "logprobs": "object",
    "prompt_logprobs": "object",
    "time_taken_llm": FLOAT,
    "embeddings": VECTOR,
    "num_cached_tokens": INT,
    "from_cache": pd.ArrowDtype(pa.bool_()),
}
#: Arrow types of the engine columns that pandas holds as Python objects (one entry per
#: token; the first prompt token's is null), for the parquet writer's schema.
ENGINE_ARROW_TYPES = {"logprobs": pa.list_(LOGPROB_MAP), "prompt_logprobs": pa.list_(LOGPROB_MAP)}
_GENERATION_ENGINE = (
    "rendered_prompt",
    "prompt_token_ids",
    "generated_tokens",
    "logprobs",
    "prompt_logprobs",
    "time_taken_llm",
    "num_cached_tokens",
    "from_cache",
)
_POOLING_ENGINE = ("embeddings", "time_taken_llm")


def engine_dtype(kind: str, name: str) -> pd.api.extensions.ExtensionDtype | str:
    """The dtype of engine column ``name`` for ``kind`` (score's ``embeddings`` are float64)."""
    if kind == "score" and name == "embeddings":
        return pd.ArrowDtype(pa.list_(pa.float64()))
    return ENGINE_COLUMNS[name]


KINDS: dict[str, TaskKind] = {
    k.name: k
    for k in (
        TaskKind(
            "generate",
            1,
            GENERATED_TEXT,
            STRING,
            _GENERATION_COLUMNS,
            True,
            "generate",
            engine_columns=_GENERATION_ENGINE,
        ),
        TaskKind(
            "chat", 1, GENERATED_TEXT, STRING, _GENERATION_COLUMNS, True, "chat", engine_columns=_GENERATION_ENGINE
        ),
        TaskKind(
            "embed", 1, "embedding", VECTOR, (), False, "embed", DEFAULT_EMBED_MODEL, engine_columns=_POOLING_ENGINE
        ),
        TaskKind("score", 2, "score", FLOAT, (), False, "score", DEFAULT_EMBED_MODEL, engine_columns=_POOLING_ENGINE),
        TaskKind(
            "classify",
            1,
            "label",
            STRING,
            ((PROBS, VECTOR),),
            False,
            "classify",
            model_required="a classifier model",
            engine_columns=_POOLING_ENGINE,
        ),
    )
}


def task_kind(name: str) -> TaskKind:
    """The task kind called ``name``; ``ValueError`` for an unknown one."""
    if name not in KINDS:
        raise ValueError(f"unknown task {name!r}")
    return KINDS[name]
