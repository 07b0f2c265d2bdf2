"""Ray Data LLM's ``build_processor``, re-expressed on Dask.

``build_processor(config, preprocess, postprocess)`` returns a callable that maps a Dask
DataFrame (or a pandas one), row by row, through ``preprocess`` (a function of the row dict
returning the fields the engine reads, below), the engine, and ``postprocess`` (a function
of the row dict, with the engine's outputs added, returning the output row). As in Ray Data
LLM, the input row's columns are carried through to ``postprocess`` beside the engine's
columns (and ``llm_error``, None for every row ``postprocess`` sees):

- ``generate``: Ray's vLLM engine stage's ``generated_text``, ``prompt`` (the text sent, after
  the chat template for ``messages`` rows; for ``tokenized_prompt`` rows the row's
  ``prompt`` if it has one, else the token ids' text), ``prompt_token_ids``,
  ``generated_tokens`` (the generated token ids), ``num_input_tokens``,
  ``num_generated_tokens``, ``time_taken_llm`` (seconds of the engine call that generated the
  row's batch), ``logprobs`` and ``prompt_logprobs``, and dfllm's ``finish_reason``. Token id
  lists reach ``postprocess`` as numpy arrays (as Ray Data's rows do). ``logprobs`` is None
  unless the row's ``sampling_params`` ask ``logprobs=k``; then, as Ray gives it, a list with
  one dict per generated token mapping token id -> ``{"logprob": float, "rank": int,
  "decoded_token": str}`` (the sampled token and the top ``k``). ``prompt_logprobs`` (for
  ``prompt_logprobs=k``) likewise, one entry per prompt token, the first None. Ray's
  ``metrics``, ``request_id``, ``batch_uuid`` and ``params`` are not given. With
  ``engine_kwargs={"reasoning_parser": "qwen3"}`` (or ``"deepseek_r1"``, :mod:`dfllm.reasoning`)
  the row also gets ``reasoning_content`` (the reasoning; None if there is none) and
  ``generated_text`` only the answer.
- ``embed``, ``classify``, ``score``: Ray's ``embeddings`` (the vector; the class
  probabilities; ``[score]``) and ``time_taken_llm``, beside dfllm's ``embedding``,
  ``label``/``probs`` and ``score``.

**What preprocess returns**, by ``task_type`` (each row on its own; a partition may mix
them, and each ``batch_size`` rows run as one engine call per kind present: conversations,
prompts and token ids):

- ``generate``: ``messages`` (an OpenAI-style conversation, rendered with the chat template
  when the chat template stage is on), or ``prompt`` (text), or ``tokenized_prompt`` (token
  ids, generated from as they are; they win over the other two, as in Ray). A conversation
  whose last message is not the user's (an assistant prefill) is continued, not answered:
  the template's ``continue_final_message=True``, ``add_generation_prompt=False``, Ray's
  rule. The config's ``chat_template_kwargs`` are passed to the template, and a row's own
  ``chat_template_kwargs`` (a dfllm addition) over them. ``sampling_params``: a dict of
  :class:`dfllm.SamplingParams` fields (Ray's ``guided_decoding`` is read as
  ``structured_outputs``; with the detokenize stage on, ``detokenize=False`` still gives
  ``generated_text``, as Ray's detokenize stage does).
- ``embed``, ``classify``: ``prompt``; ``score``: ``text_1`` and ``text_2``; each optionally
  with ``pooling_params``, a dict of :class:`dfllm.PoolingParams` fields for that row
  (``normalize``, ``truncate_prompt_tokens``, ``use_activation``).

A row lacking what its task reads, or with bad values there, fails with a message naming
the field (see Failed rows).

``model_source=None`` is the task's default model: the bundled chat model for ``generate``,
the bundled ``all-minilm-l6-v2`` for ``embed`` and ``score``; ``classify`` needs one.

**Failed rows.** A row whose preprocess, inference or postprocess fails keeps going as an
error row: ``postprocess`` is not run on it (as Ray Data LLM's error rows bypass
postprocess), it holds its *input* row's values (its ``id`` and other input columns, so it
can be found and retried), ``llm_error`` holds the message (``"preprocess: KeyError: ..."``,
the engine's message, ``"postprocess: ..."``), and its other columns are null. Every other
row goes on. That is ``should_continue_on_error=None``. As in Ray Data LLM,
``should_continue_on_error=True`` does the same with the column named
``__inference_error__`` (in the rows ``postprocess`` sees too), and ``False`` makes the
first failed row fail the job: :class:`RowFailedError` naming the row (its index label)
and its error, raised when its partition is computed (or at call time, if it is among the
sampled rows); the output then has no error column. Everything below says ``llm_error``
for whichever error column there is. The defaults are those of each class:

- :class:`ProcessorConfig` (dfllm's): ``should_continue_on_error=None``, failed rows kept
  in ``llm_error``, the job goes on;
- :class:`vLLMEngineProcessorConfig` (Ray's name, Ray's defaults): ``False``, as in Ray
  Data LLM: a Ray script moved here fails on a bad row as it did on Ray.

**Output columns**, in order: the columns ``postprocess`` returns (the whole row when there
is no ``postprocess``), then each input column ``postprocess`` does not return, then
``llm_error`` (always present). Those extra input columns hold the input values on rows
that have an ``llm_error`` and are null on rows without one: a successful row is what
``postprocess`` made of it, a failed row still says which input row it was. An error row's
input values go into the output's columns, whichever type ``postprocess`` gave them,
through Arrow's safe casts: with ``postprocess`` returning ``id=str(row["id"])``, a failed
row's ``id`` 7 is ``"7"``; a value no safe cast converts (text in an integer column, a
fraction in an integer column...) is null, and the row's ``llm_error`` says so, naming the
column and showing the value.

**Output types** are Arrow-backed pandas dtypes, so Dask's ``to_parquet`` and
:func:`dfllm.write_parquet` work (see Writing resumably). They come from, in order of
precedence:

- ``meta=`` given to :func:`build_processor` or to the processor call: a pandas DataFrame
  (its columns and dtypes), a dict or list of ``(column, dtype)`` pairs, or a
  ``pyarrow.Schema``, describing the columns ``postprocess`` returns. dtypes may be pyarrow
  types, ``pd.ArrowDtype`` or pandas/numpy dtypes (converted to their Arrow equivalents, so
  that every column can hold the nulls of failed rows; ``object`` is a string); a pandas
  ``CategoricalDtype`` is kept. Input columns not in ``meta`` are added, typed from the
  input's dtypes (an ``object`` column is a string), and ``llm_error`` last. Nothing runs
  at call time.
- Otherwise, **the first real rows**: on Dask, at call time, the head (``sample_rows``
  rows) of the first non-empty partition(s) goes through the whole pipeline (preprocess,
  the engine, postprocess) where the partitions will run (on the cluster of the active
  ``distributed`` client, else locally), and the types are those of the values these rows
  produced (as ``pyarrow`` infers them). A column null in every successful sampled row is
  typed as the input column of that name if there is one, else as a string. These rows are
  computed again with their partition (and the upstream of the first partition once more:
  ``persist()`` an expensive input, or pass ``meta=``). If none of the sampled rows gets
  through postprocess, the call raises ``ValueError`` naming the first row's error. On
  pandas the types come from all of the frame's rows, so a processor gives the same
  frame on pandas and on Dask whenever the sample's types hold for the other rows.

Ray's ``logprobs`` and ``prompt_logprobs``, kept in the output (no postprocess, or
postprocess returning them), are Arrow lists of maps token id -> ``struct<logprob, rank,
decoded_token>`` (pandas shows a map as a list of ``(token id, fields)`` pairs); a column of
them null in every sampled row still gets that type.

**Nothing is dropped silently.** A row whose postprocess returns a column the schema does
not have, or a value that does not fit its column's type (a float with a fraction in an
integer column, text in a list column, a dict with a field the struct type lacks, an
integer in a string column...), gets an ``llm_error`` naming the column; the offending
value is null and the row keeps its other values (and its input columns, being an error
row). Columns ``postprocess`` does not return for a row are null in that row.

**Writing resumably.** ``dfllm.write_parquet(processor(ddf), path, resume=True)`` writes a
processor's Dask result as it writes an ``.llm`` accessor's (see
:mod:`dfllm.accessors.writer`): one part per input partition, every input row exactly once,
error rows included (their error column's messages counted in the summary's ``errors``);
a resumed write keeps or reuses the parts an earlier write made from the same rows *with
the same processor* and computes the rest. The same processor means the same write key:

- the config's fields that decide a row's output (``model_source``, ``engine_kwargs``,
  ``task_type``, ``batch_size``, the chat template settings, whether the detokenize stage
  is on, ``should_continue_on_error``...), but not those that only place or pace the work
  (``concurrency``, ``accelerator_type``, ``resources``, ``runtime_env``,
  ``max_concurrent_batches`` and the other Ray-cluster settings), which a resumed write
  may change;
- the output columns and their types (``meta=``, or those the sampled rows gave);
- ``preprocess`` and ``postprocess``, by a fingerprint of their code, closures and the
  module globals they read (see :mod:`dfllm.jobs.fingerprint`: a re-run of the same
  script gives the same fingerprint, an edited function another), or, when ``key=`` (a
  string, given to :func:`build_processor` or to the processor call) is set, by that key
  instead: name what the functions do, and change it whenever they change.

Anything else changed recomputes the partition, as a changed accessor task does. A
function that reads a value with no stable fingerprint (a lock, a client, an open file...)
makes ``write_parquet`` raise ``ValueError`` before any work, asking for ``key=``. The
fingerprint is best effort: a change inside another module's functions or a class's
methods is not noticed (set ``key=``, or write with ``resume=False``).
"""

from __future__ import annotations

import dataclasses
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import pandas as pd
import pyarrow as pa

from dfllm.accessors.partitions import WritableFunction
from dfllm.accessors.placement import check_resources, run_placed
from dfllm.jobs.fingerprint import FingerprintError, fingerprint
from dfllm.tasks.kinds import KINDS, LOGPROB_MAP
from dfllm.tasks.response_cache import as_cache
from dfllm.tasks.schema import LLM_ERROR
from dfllm.tasks.task import make_task
from dfllm.tasks.write_key import canonical

TASK_TYPES = ("generate", "embed", "classify", "score")
SAMPLE_ROWS = 8
ERROR = LLM_ERROR
_STRING = pd.ArrowDtype(pa.string())
#: How much of an ``accelerator_type:<name>`` resource a task asks for: a label, as in Ray.
ACCELERATOR_LABEL = 0.001

#: What ``meta=`` accepts: a DataFrame, a dict or list of (column, dtype) pairs, a pyarrow schema.
Meta: TypeAlias = pd.DataFrame | Mapping[str, Any] | Sequence[tuple[str, Any]] | pa.Schema


#: Config fields left out of a write's key: they place or pace the work (or, for stages, are
#: read through the fields they set) and do not change a row's output.
_NOT_OUTPUT_FIELDS = {"concurrency", "accelerator_type", "resources", "runtime_env", "placement_group_config",
                      "resources_per_bundle", "max_concurrent_batches", "max_tasks_in_flight_per_actor",
                      "max_pending_requests", "log_engine_metrics", "experimental", "chat_template_stage",
                      "tokenize_stage", "detokenize_stage", "prepare_multimodal_stage", "prepare_image_stage",
                      "tokenize", "detokenize", "has_image", "cache"}
_STAGE_KEYS = {"enabled", "batch_size", "concurrency", "num_cpus", "num_gpus", "memory", "runtime_env", "model_source"}
_CHAT_STAGE_KEYS = _STAGE_KEYS | {"chat_template", "chat_template_kwargs"}
RAY_ERROR = "__inference_error__"


@dataclass
class StageConfig:
    """Ray Data LLM's per-stage config (``ray.data.llm.ChatTemplateStageConfig`` and the
    others below): whether the stage is on, and its Ray-cluster settings (``batch_size``,
    ``concurrency``, ``num_cpus``, ``memory``, ``runtime_env``: accepted, no effect on Dask).
    A stage field of :class:`vLLMEngineProcessorConfig` takes one, a bool, or the same as a dict."""

    enabled: bool = True
    batch_size: int | None = None
    concurrency: int | tuple[int, int] | None = None
    num_cpus: float | None = None
    memory: float | None = None
    runtime_env: dict | None = None
    model_source: str | None = None

    def settings(self) -> dict:
        """The fields that are set, as the dict form of the stage config."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class ChatTemplateStageConfig(StageConfig):
    """Ray's chat template stage config: also ``chat_template`` and ``chat_template_kwargs``."""

    chat_template: str | None = None
    chat_template_kwargs: dict | None = None


class TokenizerStageConfig(StageConfig):
    """Ray's tokenize stage config."""


class DetokenizeStageConfig(StageConfig):
    """Ray's detokenize stage config."""


class PrepareMultimodalStageConfig(StageConfig):
    """Ray's multimodal stage config: accepted on or off (the engine reads the image parts of
    ``messages`` on the workers either way)."""


class PrepareImageStageConfig(StageConfig):
    """Ray's image stage config: accepted on or off (as :class:`PrepareMultimodalStageConfig`)."""


def _stage(name: str, value, keys: set) -> tuple[bool | None, dict]:
    """A Ray stage field (``bool``, a :class:`StageConfig`, a dict with ``enabled`` and the
    stage's settings, or None: not given) as (enabled or None, its settings); ``ValueError``
    on anything else."""
    if isinstance(value, StageConfig):
        value = value.settings()
    if value is None or isinstance(value, bool):
        return value, {}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - keys)
        if unknown:
            raise ValueError(f"{name}: unknown key(s) {unknown}; a stage config takes {sorted(keys)}")
        enabled = value.get("enabled", True)
        if not isinstance(enabled, bool):
            raise ValueError(f"{name}: 'enabled' must be a bool, got {enabled!r}")
        return enabled, dict(value)
    raise ValueError(f"{name} must be a bool or a dict with 'enabled', got {type(value).__name__}")


def _positive(name: str, value, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1{' or None' if optional else ''}, got {value!r}")


def _optional_dict(name: str, value) -> None:
    if value is not None and not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a dict or None, got {type(value).__name__}")


@dataclass
class vLLMEngineProcessorConfig:  # noqa: N801  (Ray Data LLM's name)
    """Ray Data LLM's ``vLLMEngineProcessorConfig``, on Dask, with Ray's defaults (a failed row
    fails the job: ``should_continue_on_error=False``). :class:`ProcessorConfig` is dfllm's
    subclass, the same but for that default (None: failed rows kept, with ``llm_error``).
    Every field of Ray's is accepted; what each means here:

    - ``model_source``: a model directory or bundled alias (None: the task's default model:
      the bundled chat model for generate, ``all-minilm-l6-v2`` for embed and score;
      classify has none, so None is a ``ValueError``).
      ``engine_kwargs`` go to :class:`dfllm.LLM`. ``task_type``: ``generate``, ``embed``,
      ``classify`` or ``score``. ``batch_size`` (32, as Ray): rows of a partition per engine
      call.
    - ``chat_template_stage`` (default True; a bool, a :class:`ChatTemplateStageConfig` or a
      dict with ``enabled``, and ``chat_template`` as in Ray's stage config): whether
      ``messages`` rows are rendered with the chat template; False sends ``prompt`` instead.
      The older ``apply_chat_template`` is the same switch (a conflicting pair is a
      ``ValueError``); ``chat_template`` (Jinja text, rendered sandboxed) replaces the
      tokenizer's template.
    - ``tokenize_stage``, ``detokenize_stage`` (and the older ``tokenize``/``detokenize``; a
      bool, a dict or a :class:`TokenizerStageConfig`/:class:`DetokenizeStageConfig`):
      accepted, on or off: dfllm's engine tokenizes the prompt and detokenizes the output
      itself, so the rows are the same either way (with the detokenize stage on, a row whose
      ``sampling_params`` say ``detokenize=False`` still gets ``generated_text``, as Ray's
      stage decodes it).
    - ``prepare_multimodal_stage``, ``prepare_image_stage``, ``has_image``: accepted, on or
      off: the image parts of a row's ``messages`` (``{"type": "image", "image": ...}``,
      ``{"type": "image_url", "image_url": {"url": ...}}``, ``image_pil``; bytes, paths, URLs,
      PIL images) are decoded on the workers and given to a vision-language model; one that
      cannot be read is the row's error (docs/images.md).
    - ``should_continue_on_error``: False (Ray's default, and this class's): the first
      failed row fails the job (``RowFailedError`` naming the row and its error, when the
      partition is computed), and the output has no error column. True: failed rows are
      kept, with the message in the column ``__inference_error__``, as in Ray. None
      (:class:`ProcessorConfig`'s default): failed rows are kept, with the message in
      ``llm_error`` (see :mod:`dfllm.jobs.processor`).
    - ``accelerator_type`` (e.g. ``"H100"``): the engine calls run on Dask workers declaring
      the resource ``accelerator_type:H100`` (``dask worker --resources
      accelerator_type:H100=1``), as Ray's nodes label theirs; with ``resources`` (dfllm's
      own, e.g. ``{"GPU": 1}``), on workers declaring those (see
      :mod:`dfllm.accessors.placement`). A task whose resources no worker declares waits.
    - ``concurrency``: an int >= 1 or an ``(m, n)`` pair, 1 <= m <= n, checked as Ray does;
      on Dask the cluster's workers (one engine each) set the parallelism.
    - Ray-cluster-only, accepted and checked, no effect on Dask: ``max_concurrent_batches``
      (int >= 1), ``max_tasks_in_flight_per_actor`` (also as Ray's ``experimental=
      {"max_tasks_in_flight_per_actor": n}``), ``max_pending_requests`` (int >= 1 or None),
      ``log_engine_metrics`` (bool), ``runtime_env``, ``placement_group_config``,
      ``resources_per_bundle`` (dicts), and the stages' ``batch_size``/``concurrency``/
      ``num_cpus``/``memory``/``runtime_env``.
    - ``dynamic_lora_loading_path`` (Ray's multi-LoRA): a generate row whose ``model`` differs
      from ``model_source`` runs the LoRA adapter of that name, the folder ``<path>/<model>``
      (a local folder or an fsspec URL, fetched once per worker); rows of different adapters
      share batches, and a row whose adapter cannot be read gets its error (docs/lora.md).
    - ``chat_template_kwargs`` (here, in ``chat_template_stage`` or in ``build_processor``'s
      ``builder_kwargs``): extra variables for the chat template (e.g. ``{"enable_thinking":
      False}``), passed to its rendering; a row's own ``chat_template_kwargs`` (from
      preprocess, a dfllm addition) are merged over them.
    - ``cache`` (dfllm's): a response cache for generate (a path or fsspec URL, a
      :class:`dfllm.ResponseCache` or a dict of its fields; see
      :mod:`dfllm.tasks.response_cache`): deterministic rows asked before with the same
      model, prompt tokens and sampling params are answered from it without the engine. It
      decides no output, so it is not part of a resumed write's key.
    """

    model_source: str | None = None
    engine_kwargs: dict = field(default_factory=dict)
    batch_size: int = 32
    concurrency: int | tuple[int, int] = 1
    task_type: str = "generate"
    apply_chat_template: bool = True
    chat_template: str | None = None
    chat_template_stage: bool | dict | None = None
    tokenize_stage: bool | dict | None = None
    detokenize_stage: bool | dict | None = None
    prepare_multimodal_stage: bool | dict | None = None
    prepare_image_stage: bool | dict | None = None
    tokenize: bool = True
    detokenize: bool = True
    has_image: bool = False
    chat_template_kwargs: dict | None = None
    should_continue_on_error: bool | None = False  # Ray's default; ProcessorConfig's is None
    accelerator_type: str | None = None
    resources: dict | None = None
    runtime_env: dict | None = None
    placement_group_config: dict | None = None
    resources_per_bundle: dict | None = None
    max_concurrent_batches: int = 8
    max_tasks_in_flight_per_actor: int | None = None
    max_pending_requests: int | None = None
    log_engine_metrics: bool = True
    dynamic_lora_loading_path: str | None = None
    experimental: dict | None = None
    cache: Any = None  # dfllm's response cache (None: none)

    def __post_init__(self) -> None:
        if self.task_type not in TASK_TYPES:
            raise ValueError(f"task_type must be one of {TASK_TYPES}, got {self.task_type!r}")
        _positive("batch_size", self.batch_size)
        required = KINDS[self.task_type].model_required
        if self.model_source is None and required:
            raise ValueError(f"task_type={self.task_type!r} needs {required}: set model_source (None is the "
                             "default model only of generate, embed and score)")
        c = self.concurrency
        if isinstance(c, (tuple, list)):
            if len(c) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in c) or not 1 <= c[0] <= c[1]:
                raise ValueError(f"concurrency must be an int >= 1 or a pair (m, n) of ints, 1 <= m <= n, got {c!r}")
            self.concurrency = (c[0], c[1])
        else:
            _positive("concurrency", c)
        for name in ("apply_chat_template", "tokenize", "detokenize", "has_image", "log_engine_metrics"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.should_continue_on_error is not None and not isinstance(self.should_continue_on_error, bool):
            raise ValueError(f"should_continue_on_error must be a bool (or None: dfllm's llm_error column), "
                             f"got {self.should_continue_on_error!r}")
        for name in ("runtime_env", "placement_group_config", "resources_per_bundle", "chat_template_kwargs",
                     "experimental"):
            _optional_dict(name, getattr(self, name))
        unknown = sorted(set(self.experimental or {}) - {"max_tasks_in_flight_per_actor"})
        if unknown:
            raise ValueError(f"experimental: unknown key(s) {unknown}; it takes 'max_tasks_in_flight_per_actor'")
        if (self.experimental or {}).get("max_tasks_in_flight_per_actor") is not None:
            self.max_tasks_in_flight_per_actor = (self.experimental or {})["max_tasks_in_flight_per_actor"]
        _positive("max_concurrent_batches", self.max_concurrent_batches)
        _positive("max_tasks_in_flight_per_actor", self.max_tasks_in_flight_per_actor, optional=True)
        _positive("max_pending_requests", self.max_pending_requests, optional=True)
        enabled, settings = _stage("chat_template_stage", self.chat_template_stage, _CHAT_STAGE_KEYS)
        if enabled is not None:
            if enabled != self.apply_chat_template and not self.apply_chat_template:
                raise ValueError("apply_chat_template=False and chat_template_stage enabled disagree; set one")
            self.apply_chat_template = enabled
        for key in ("chat_template", "chat_template_kwargs"):
            if settings.get(key) is not None:
                if getattr(self, key) is not None and getattr(self, key) != settings[key]:
                    raise ValueError(f"{key} is given twice (in chat_template_stage too), with different values")
                setattr(self, key, settings[key])
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError("chat_template must be a Jinja template string")
        if self.chat_template_kwargs and not all(isinstance(k, str) for k in self.chat_template_kwargs):
            raise ValueError(f"chat_template_kwargs must map template variable names (strings) to values, "
                             f"got {self.chat_template_kwargs!r}")
        _stage("tokenize_stage", self.tokenize_stage, _STAGE_KEYS)
        _stage("detokenize_stage", self.detokenize_stage, _STAGE_KEYS)
        for name in ("prepare_multimodal_stage", "prepare_image_stage"):  # images: read from messages either way
            _stage(name, getattr(self, name), _STAGE_KEYS)
        if self.dynamic_lora_loading_path is not None and (not isinstance(self.dynamic_lora_loading_path, str)
                                                           or not self.dynamic_lora_loading_path):
            raise ValueError("dynamic_lora_loading_path must be a folder path or URL (of LoRA adapter folders), "
                             f"got {self.dynamic_lora_loading_path!r}")
        if self.accelerator_type is not None and (not isinstance(self.accelerator_type, str)
                                                  or not self.accelerator_type):
            raise ValueError(f"accelerator_type must be a non-empty string like 'H100', got {self.accelerator_type!r}")
        self.resources = check_resources(self.resources)
        self.cache = as_cache(self.cache, "cache")
        if self.cache is not None and not KINDS[self.task_type].generative:
            raise ValueError(f"cache: the response cache is for task_type='generate', not {self.task_type!r}")

    def task_resources(self) -> dict | None:
        """The Dask worker resources the engine calls ask for (None: any worker)."""
        out = dict(self.resources or {})
        if self.accelerator_type is not None:
            out.setdefault(f"accelerator_type:{self.accelerator_type}", ACCELERATOR_LABEL)
        return out or None

    @property
    def detokenize_enabled(self) -> bool:
        """Whether Ray's detokenize stage is on (``detokenize_stage``, else ``detokenize``)."""
        enabled = _stage("detokenize_stage", self.detokenize_stage, _STAGE_KEYS)[0]
        return self.detokenize if enabled is None else enabled

    @property
    def error_column(self) -> str | None:
        """The output's error column: ``llm_error``, ``__inference_error__`` (with
        ``should_continue_on_error=True``) or None (``False``: a failed row raises)."""
        if self.should_continue_on_error is None:
            return ERROR
        return RAY_ERROR if self.should_continue_on_error else None

    def output_settings(self) -> dict:
        """The fields that decide a row's output (all but placement and pacing), as a
        resumable write's key reads them."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_OUTPUT_FIELDS}
        out["detokenize"] = self.detokenize_enabled
        return out


@dataclass
class ProcessorConfig(vLLMEngineProcessorConfig):
    """dfllm's processor config: :class:`vLLMEngineProcessorConfig`'s fields, with dfllm's
    default ``should_continue_on_error=None``: a failed row is kept, with its message in
    ``llm_error``, and the job goes on (Ray's class, and Ray, default to False: the first
    failed row fails the job). ``False`` and ``True`` mean what they mean there."""

    should_continue_on_error: bool | None = None


class RowFailedError(RuntimeError):
    """A row failed in a processor built with ``should_continue_on_error=False``: ``row`` is
    its index label, ``error`` the message it would have had in the error column."""

    def __init__(self, message: str, row=None, error: str | None = None):
        super().__init__(message)
        self.row, self.error = row, error

    def __reduce__(self):
        return type(self), (str(self), self.row, self.error)


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
    "generate": {"rendered_prompt": "prompt", "prompt_token_ids": "prompt_token_ids",
                 "generated_tokens": "generated_tokens", "logprobs": "logprobs", "prompt_logprobs": "prompt_logprobs",
                 "time_taken_llm": "time_taken_llm"},
    "embed": {"embeddings": "embeddings", "time_taken_llm": "time_taken_llm"},
}
RAY_COLUMNS.update(chat=RAY_COLUMNS["generate"], classify=RAY_COLUMNS["embed"], score=RAY_COLUMNS["embed"])
_LOGPROBS = pd.ArrowDtype(pa.list_(LOGPROB_MAP))
#: The type of an engine column that is null in every sampled row (see ``_schema_from``).
_ENGINE_FALLBACK = {"logprobs": _LOGPROBS, "prompt_logprobs": _LOGPROBS}
#: What a row may hand the engine (from preprocess), besides the task's inputs.
_OPTIONAL_KEYS = ("tokenized_prompt", "sampling_params", "pooling_params", "chat_template_kwargs")
_LORA_COLUMN = "__dfllm_lora__"  # Ray's multi-LoRA: each row's adapter name (None: the base model)


class ProcessorFunction(WritableFunction):
    """What a processor maps over a Dask frame's partitions: its pipeline into ``schema``
    (column -> dtype). Its write key (for :func:`dfllm.write_parquet`) is the config's
    output settings, the schema, and the fingerprints of preprocess and postprocess (or
    ``key``); see Writing resumably in the module docstring."""

    kind = "processor"

    def __init__(self, processor: Processor, schema: dict, key: str | None = None):
        self.processor, self.schema, self.key = processor, schema, key
        self.resources = processor.config.task_resources()
        self.error_column = processor.config.error_column
        self.__name__ = "llm-processor"
        self._token = uuid.uuid4().hex  # Dask's name for this call (the functions need not pickle the same twice)

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        return self.processor.process_partition(df, self.schema)

    def __dask_tokenize__(self):
        return (type(self).__name__, self._token)

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
                    "they change) to build_processor or to the processor call") from None
        try:
            return canonical({"processor": 2, "config": p.config.output_settings(), "schema": self.schema,
                              **functions})
        except TypeError as exc:  # e.g. a callable in engine_kwargs
            raise ValueError(f"write_parquet: the processor's config has a value with no stable key ({exc}); "
                             "a resumed write could not tell whether earlier parts came from the same config") from None


def _check_key(key) -> str | None:
    if key is not None and (not isinstance(key, str) or not key):
        raise ValueError(f"key= must be a non-empty string naming what preprocess and postprocess do, got {key!r}")
    return key


class Processor:
    """Callable from a Dask (or pandas) DataFrame to the postprocessed results.

    See the module docstring for the output's columns, their types, error rows, and
    writing the result resumably.
    """

    def __init__(self, config: vLLMEngineProcessorConfig, preprocess: Callable[[dict], dict] | None,
                 postprocess: Callable[[dict], dict] | None, *, meta: Meta | None = None,
                 sample_rows: int = SAMPLE_ROWS, key: str | None = None):
        if sample_rows < 1:
            raise ValueError(f"sample_rows must be >= 1, got {sample_rows}")
        self.key = _check_key(key)
        self.config, self.preprocess, self.postprocess = config, preprocess, postprocess
        # the error column while rows run (with should_continue_on_error=False, dropped after
        # the check that no row failed)
        self._err = config.error_column or ERROR
        self.meta = None if meta is None else _meta_dtypes(meta)
        self.sample_rows = sample_rows

    def __call__(self, df, *, meta: Meta | None = None, key: str | None = None):
        """Map ``df`` through the pipeline: a pandas DataFrame is processed now; a Dask
        DataFrame gives a lazy one whose columns and dtypes are known (from ``meta``, this
        call's or the processor's, else from running its first rows now), which
        :func:`dfllm.write_parquet` writes resumably (``key``, this call's or the
        processor's, stands in for the fingerprints of preprocess and postprocess)."""
        given = _meta_dtypes(meta) if meta is not None else self.meta
        key = _check_key(key) if key is not None else self.key
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
        out = _frame(rows, schema, df.index, [c for c in df.columns if c != self._err], self._err)
        if self.config.error_column is not None:
            return out
        failed = out[self._err].notna().to_numpy()
        if failed.any():
            raise self._row_failed(out.index[failed.argmax()], out[self._err][failed].iloc[0])
        return out.drop(columns=[self._err])

    def _row_failed(self, label, error: str) -> RowFailedError:
        label = label.item() if isinstance(label, np.generic) else label
        return RowFailedError(f"build_processor: row {label!r} failed: {error} (should_continue_on_error=False; "
                              f"set it to True to keep failed rows, with the error in {RAY_ERROR!r})", label, error)

    def run_rows(self, df: pd.DataFrame) -> list[RowResult]:
        """Each row of ``df`` through preprocess, the engine (``batch_size`` rows per call)
        and postprocess, as :class:`RowResult`."""
        inputs = df.to_dict("records")
        pre = [self._pre(r) for r in inputs]
        engine_rows: list[tuple[dict, str | None]] = []
        for start in range(0, len(pre), self.config.batch_size):
            engine_rows += self._infer(pre[start : start + self.config.batch_size])
        return [self._post(inp, row, err) for inp, (row, err) in zip(inputs, engine_rows)]

    def _pre(self, row: dict) -> tuple[dict, str | None]:
        if self.preprocess is None:
            return row, None
        try:
            out = self.preprocess(dict(row))  # a copy: the input values stay as they were
            return {**row, **out}, None
        except Exception as exc:  # a user function failing on one row
            return row, f"preprocess: {type(exc).__name__}: {exc}"

    def _infer(self, rows: list[tuple[dict, str | None]]) -> list[tuple[dict, str | None]]:
        """Engine outputs added to the rows without an error; the engine's per-row errors.
        Rows are grouped by the task they need (a chat, a prompt, token ids), one engine
        call per group."""
        results = list(rows)
        groups: dict[tuple, list[int]] = {}
        for i, (row, err) in enumerate(rows):
            if err is not None:
                continue
            kind, inputs, problem = self._row_task(row)
            if problem is not None:
                results[i] = (row, problem)
            else:
                groups.setdefault((kind, inputs), []).append(i)
        for (kind, inputs), members in groups.items():
            for i, (row, err) in zip(members, self._run_group(kind, inputs, [rows[i][0] for i in members])):
                results[i] = (row, err)
        return results

    def _row_task(self, row: dict) -> tuple[str, tuple[str, ...], str | None]:
        """The task kind and inputs a row needs, and what it lacks for them (or None)."""
        t = self.config.task_type
        has = lambda key: key in row and not _is_null(row[key])  # noqa: E731
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
            wanted = "'messages', 'prompt' or 'tokenized_prompt'" if chat else \
                "'prompt' or 'tokenized_prompt' (the chat template stage is off: 'messages' is not read)"
            return t, (), f"no {wanted} for the generate task (preprocess must return one)"
        if "prompt" not in row:
            return t, (), f"no 'prompt' for the {t} task (preprocess must return it)"
        return t, ("prompt",), None

    def _run_group(self, kind: str, inputs: tuple[str, ...], rows: list[dict]) -> list[tuple[dict, str | None]]:
        """``rows`` (all needing the task ``kind`` of ``inputs``) through the engine: each
        row with the engine's columns (Ray's names) added, and its error."""
        errors: list[str | None] = [None] * len(rows)
        optional = [k for k in _OPTIONAL_KEYS if any(k in r for r in rows)]
        frame = pd.DataFrame({c: [r.get(c) for r in rows] for c in (*inputs, *optional)})
        if "sampling_params" in frame:
            frame["sampling_params"] = [self._sampling_params(v, errors, j)
                                        for j, v in enumerate(frame["sampling_params"])]
        generative = KINDS[kind].generative
        model = self.config.model_source or KINDS[kind].default_model  # None: the task's default model
        ctk = self.config.chat_template_kwargs or None
        lora = self._lora(frame, rows, generative, model)  # a column of each row's adapter (Ray's multi-LoRA)
        task = make_task(
            kind, inputs, frame.columns, output_column=KINDS[kind].output_column, model=model,
            sampling_params="sampling_params" if generative and "sampling_params" in frame else None,
            engine_kwargs=self.config.engine_kwargs, engine_columns=tuple(RAY_COLUMNS[kind]),
            chat_template=self.config.chat_template if kind == "chat" else None,
            pooling_params="pooling_params" if not generative and "pooling_params" in frame else None,
            chat_template_kwargs=(ctk if "chat_template_kwargs" not in frame else "chat_template_kwargs")
            if kind == "chat" else None,
            continue_final_message=kind == "chat",
            prompt_token_ids="tokenized_prompt" if generative and "tokenized_prompt" in frame else None,
            cache=self.config.cache if generative else None, **lora)
        if kind == "chat" and ctk and "chat_template_kwargs" in frame:  # the config's, a row's own over them
            frame["chat_template_kwargs"] = [{**ctk, **v} if isinstance(v, Mapping) else ctk if _is_null(v) else v
                                             for v in frame["chat_template_kwargs"]]
        result = run_placed(frame.iloc[[j for j, e in enumerate(errors) if e is None]], task,
                            self.config.task_resources())
        cols = list(task.output_dtypes())
        outputs = iter(result[cols].astype(object).where(result[cols].notna(), None).to_dict("records"))
        names = {ERROR: self._err, **RAY_COLUMNS[kind]}
        done: list[tuple[dict, str | None]] = []
        for row, error in zip(rows, errors):
            if error is not None:
                done.append((row, error))
                continue
            out = {names.get(k, k): v for k, v in next(outputs).items()}
            done.append(({**row, **out}, out[self._err]))
        return done

    def _lora(self, frame: pd.DataFrame, rows: list[dict], generative: bool, model) -> dict:
        """Ray's multi-LoRA: with ``dynamic_lora_loading_path``, each row's adapter (its ``model``
        when that differs from ``model_source``; else None, the base model) in a column of
        ``frame``, and ``make_task``'s arguments reading it."""
        root = self.config.dynamic_lora_loading_path
        if root is None or not generative:
            return {}
        frame[_LORA_COLUMN] = [None if _is_null(r.get("model")) or str(r.get("model")) == str(model)
                               else str(r.get("model")) for r in rows]
        return {"lora": _LORA_COLUMN, "lora_root": root}

    def _sampling_params(self, value, errors: list, j: int):
        """A row's ``sampling_params`` as the engine task reads them: Ray's ``guided_decoding``
        is dfllm's ``structured_outputs``; with the detokenize stage on, the text is always
        detokenized (as Ray's stage detokenizes ``generated_tokens`` even when the row's
        params say ``detokenize=False``)."""
        if not isinstance(value, Mapping):
            return value  # the task's check names it
        value = {k: _plain(v) for k, v in value.items()}  # arrays (from Arrow columns) as lists, as Ray does
        if "guided_decoding" in value:
            guided = value.pop("guided_decoding")
            if value.get("structured_outputs") is not None and guided is not None:
                errors[j] = "sampling_params: give guided_decoding or structured_outputs, not both"
            elif guided is not None:
                value["structured_outputs"] = dict(guided) if isinstance(guided, Mapping) else guided
        if self.config.detokenize_enabled and value.get("detokenize") is False:
            value["detokenize"] = True
        return value

    def _post(self, inputs: dict, row: dict, error: str | None) -> RowResult:
        if error is not None:  # an error row bypasses postprocess
            return RowResult(inputs, None, error)
        if self.postprocess is None:
            return RowResult(inputs, row, row.get(self._err))
        try:
            out = self.postprocess(row)
            if not isinstance(out, Mapping):
                raise TypeError(f"postprocess must return a dict, got {type(out).__name__}")
            out = dict(out)
        except Exception as exc:  # a user function failing on one row
            return RowResult(inputs, None, f"postprocess: {type(exc).__name__}: {exc}")
        return RowResult(inputs, out, out.get(self._err))

    # ---- the output schema --------------------------------------------------------------------------
    def _schema_from(self, rows: list[RowResult], df: pd.DataFrame) -> tuple[dict, RowResult | None]:
        """Output column -> dtype from the values the rows produced (see the module
        docstring), and the first row without output (or None)."""
        ok = [r.output for r in rows if r.output is not None]
        names = list(dict.fromkeys(k for out in ok for k in out if k != self._err))
        inputs = _input_dtypes(df, self._err)
        schema = {}
        for name in names:
            values = [out.get(name) for out in ok]
            schema[name] = _infer_dtype(values, name, inputs.get(name, _ENGINE_FALLBACK.get(name)))
        for name, dtype in inputs.items():
            schema.setdefault(name, dtype)
        schema[self._err] = _STRING
        failed = next((r for r in rows if r.output is None), None)
        return schema, failed

    def _sample_rows(self, df: pd.DataFrame) -> tuple[dict | None, int, tuple | None]:
        """Run on the head of the input where partitions run: (schema or None when no row
        got through postprocess, the number of rows, (index label, error) of the first
        failed row)."""
        rows = self.run_rows(df)
        schema: dict | None
        schema, failed = self._schema_from(rows, df)
        first = None
        if failed is not None:
            label = df.index[[r is failed for r in rows].index(True)]
            first = (label.item() if isinstance(label, np.generic) else label, failed.error)
        if not any(r.output is not None for r in rows):
            schema = None
        return schema, len(rows), first

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
                    head, dask_key_name=f"llm-processor-sample-{uuid.uuid4().hex}")
                schema, count, first = sample.compute()
            if first is not None and self.config.error_column is None:  # the job would fail: now
                raise self._row_failed(*first)
            if count:
                if schema is None:
                    label, error = first
                    raise ValueError(
                        f"build_processor: none of the {count} sampled rows (the first rows of the input) got "
                        f"through preprocess, the engine and postprocess, so the output columns cannot be "
                        f"taken from them; the first error, in row {label!r}: {error}. Fix the functions or "
                        "the config, or pass meta= (the output columns and their types) to build_processor "
                        "or to the processor call")
                return schema
            start, step = stop, step * 2
        raise ValueError("build_processor: the input has no rows to take the output columns from; pass meta= "
                         "(the output columns and their types) to build_processor or to the processor call")

    def _with_inputs(self, given: dict, input_meta: pd.DataFrame) -> dict:
        """``meta=``'s columns, then the input's other columns (typed from the input), then
        the error column."""
        schema = {c: t for c, t in given.items() if c != self._err}
        for name, dtype in _input_dtypes(input_meta, self._err).items():
            schema.setdefault(name, dtype)
        schema[self._err] = _STRING
        return schema


# ---- types ------------------------------------------------------------------------------------------
def _meta_dtypes(meta: Meta) -> dict:
    """``meta=`` as column -> dtype (``pd.ArrowDtype`` or ``pd.CategoricalDtype``)."""
    if isinstance(meta, pa.Schema):
        pairs = [(f.name, f.type) for f in meta]
    elif isinstance(meta, pd.DataFrame):
        pairs = list(meta.dtypes.items())
    elif isinstance(meta, Mapping):
        pairs = list(meta.items())
    elif isinstance(meta, (list, tuple)) and all(isinstance(p, tuple) and len(p) == 2 for p in meta):
        pairs = list(meta)
    else:
        raise TypeError("meta= must be a pandas DataFrame, a dict or list of (column, dtype) pairs, or a "
                        f"pyarrow schema, got {type(meta).__name__}")
    out = {}
    for name, dtype in pairs:
        try:
            out[name] = _as_dtype(dtype)
        except (TypeError, ValueError, pa.ArrowException) as exc:
            raise ValueError(f"meta=: column {name!r}: {dtype!r} is not a dtype dfllm can hold ({exc})") from None
    return out


def _as_dtype(dtype) -> pd.api.extensions.ExtensionDtype:
    if isinstance(dtype, pa.DataType):
        return pd.ArrowDtype(_nullable(dtype))
    dtype = pd.api.types.pandas_dtype(dtype)
    if isinstance(dtype, pd.CategoricalDtype):
        return dtype
    if isinstance(dtype, pd.ArrowDtype):
        return pd.ArrowDtype(_nullable(dtype.pyarrow_dtype))
    arrow = pa.Schema.from_pandas(pd.DataFrame({"x": pd.Series([], dtype=dtype)}), preserve_index=False).field("x").type
    return pd.ArrowDtype(_nullable(arrow))


def _nullable(t: pa.DataType) -> pa.DataType:
    """``t`` with a null type (nothing known) read as a string, and large strings as strings."""
    if pa.types.is_null(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_list(t) or pa.types.is_list(t):
        return pa.list_(_nullable(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, _nullable(f.type)) for f in t])
    return t


def _input_dtypes(df: pd.DataFrame, error: str = ERROR) -> dict:
    """The input's columns (but ``llm_error``) as Arrow-backed dtypes, from the column's
    dtype and values (an ``object`` column without values, or of values with no Arrow type,
    is a string)."""
    out = {}
    for name in df.columns:
        if name == error:
            continue
        series = df[name]
        if isinstance(series.dtype, pd.CategoricalDtype):  # as its values (Dask's may be unknown)
            series = pd.Series(series.dtype.categories[:0] if not len(series) else series.astype(object))
        try:
            t = pa.Array.from_pandas(series).type
        except (pa.ArrowException, TypeError, ValueError):
            t = pa.string()
        if pa.types.is_dictionary(t):
            t = t.value_type
        out[name] = pd.ArrowDtype(_nullable(t))
    return out


def _infer_dtype(values: list, column, fallback) -> pd.api.extensions.ExtensionDtype:
    """The Arrow-backed dtype of postprocess's ``values`` for ``column`` (``fallback``, else
    a string, when they are all null)."""
    try:
        t = _infer_type(values)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        t = None
        for v in values:
            try:
                t = _infer_type([v])
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                raise ValueError(f"build_processor: postprocess's column {column!r} has a value of type "
                                 f"{type(v).__name__} with no Arrow type ({exc}); return plain values "
                                 "(str, int, float, bool, list, dict...), or pass meta=") from None
            if not pa.types.is_null(t):
                break
    if t is None or pa.types.is_null(t):
        return fallback if fallback is not None else _STRING
    return pd.ArrowDtype(_nullable(t))


def _infer_type(values: list) -> pa.DataType:
    """The Arrow type of ``values`` as pyarrow infers it, except that dicts whose keys are
    not strings (token id -> logprob, as in Ray's ``logprobs``) are maps, at any depth."""
    try:
        return pa.array(values, from_pandas=True).type
    except (pa.ArrowException, TypeError) as exc:
        present = [v for v in values if not _is_null(v)]
        if present and all(isinstance(v, Mapping) for v in present) and any(
                not isinstance(k, str) for v in present for k in v):
            keys = _infer_type([k for v in present for k in v])
            items = _infer_type([x for v in present for x in v.values()])
            return pa.map_(keys, items)
        if present and all(isinstance(v, (list, tuple, np.ndarray)) for v in present):
            return pa.list_(_infer_type([x for v in present for x in v]))
        if present and all(isinstance(v, Mapping) for v in present):
            names = list(dict.fromkeys(k for v in present for k in v))
            return pa.struct([(n, _infer_type([v.get(n) for v in present])) for n in names])
        raise exc


def _compatible(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether values inferred as ``src`` may go into a ``dst`` column (a safe cast then
    checks the values themselves: fractions, ranges). No change of kind: a number is no
    string, a string no list, and a struct takes no field it lacks."""
    if src == dst or pa.types.is_null(src):
        return True
    t = pa.types
    numeric = lambda x: t.is_integer(x) or t.is_floating(x) or t.is_decimal(x)  # noqa: E731
    for kind in (numeric, lambda x: t.is_string(x) or t.is_large_string(x) or t.is_string_view(x),
                 lambda x: t.is_binary(x) or t.is_large_binary(x) or t.is_fixed_size_binary(x),
                 t.is_timestamp, t.is_date, t.is_time, t.is_duration, t.is_boolean):
        if kind(src) and kind(dst):
            return True
    if (t.is_list(src) or t.is_large_list(src) or t.is_fixed_size_list(src)) and (
            t.is_list(dst) or t.is_large_list(dst) or t.is_fixed_size_list(dst)):
        return _compatible(src.value_type, dst.value_type)
    if t.is_struct(src) and t.is_struct(dst):
        fields = {f.name: f.type for f in dst}
        return all(f.name in fields and _compatible(f.type, fields[f.name]) for f in src)
    return False


def _to_arrow(values: list, dtype, cast: bool = False) -> pa.Array:
    """``values`` as an Arrow array of ``dtype``'s type; ``ValueError`` saying why a value
    does not fit. Only values of the column's kind fit (see :func:`_compatible`), unless
    ``cast``: then any value Arrow's safe cast converts does (an int in a string column is
    its text, a string of digits in an integer column its number)."""
    target = dtype.pyarrow_dtype
    try:
        arr = pa.array(values, from_pandas=True)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        try:  # e.g. dicts keyed by token id, for a map column
            return pa.array(values, type=target, from_pandas=True)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            pass
        raise ValueError(f"has no Arrow type ({type(exc).__name__}: {exc})") from None
    if not cast and not _compatible(arr.type, target):
        raise ValueError(f"is {arr.type}, not {target}")
    try:
        return arr.cast(target, safe=True)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"does not fit {target} ({type(exc).__name__}: {exc})") from None


def _column(values: list, dtype, index: pd.Index, column, errors: list, inputs: set | frozenset = frozenset()
            ) -> pd.Series:
    """A typed column; values that do not fit are null, with a message in ``errors``. The
    values of the rows in ``inputs`` are an error row's input values: they go in through
    Arrow's safe casts (see :func:`_to_arrow`), so that the row still says which input row it
    was, and one that cannot be converted is named in the row's error."""
    if isinstance(dtype, pd.CategoricalDtype):
        for i, v in enumerate(values):
            if not _is_null(v) and v not in dtype.categories and i in inputs:
                v = values[i] = _category(v, dtype)
            if not _is_null(v) and v not in dtype.categories:
                what = "the input value" if i in inputs else ""
                errors[i] = _join(errors[i], f"column {column!r}: {what}{' ' if what else ''}{_show(v)} is not one "
                                             f"of the categories {list(dtype.categories)}")
                values[i] = None
        return pd.Series(values, index=index, dtype=dtype)
    try:
        arr = _to_arrow(values, dtype)
    except ValueError:  # find the rows, one value at a time
        cells = []
        for i, v in enumerate(values):
            try:
                cells.append(_to_arrow([v], dtype, cast=i in inputs))
            except ValueError as exc:
                what = "input value" if i in inputs else "value"
                errors[i] = _join(errors[i], f"column {column!r}: the {what} {_show(v)} {exc}")
                values[i] = None
                cells.append(pa.nulls(1, dtype.pyarrow_dtype))
        arr = pa.concat_arrays(cells)
    return pd.Series(arr, index=index, dtype=dtype)


def _category(value, dtype: pd.CategoricalDtype):
    """An input value as the category Arrow's safe cast makes of it (7 as "7" among string
    categories), or the value itself when none matches."""
    try:
        kind = pd.ArrowDtype(pa.array(dtype.categories, from_pandas=True).type)
        cast = _to_arrow([value], kind, cast=True)[0].as_py()
    except (ValueError, pa.ArrowException, TypeError):
        return value
    return cast if cast in dtype.categories else value


def _frame(rows: list[RowResult], schema: dict, index: pd.Index, input_columns: list,
           error: str = ERROR) -> pd.DataFrame:
    """The rows as a frame of exactly ``schema``'s columns (see the module docstring)."""
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
            errors[i] = _join(errors[i], f"postprocess returned column(s) {extra} that the output does not have "
                                         f"(its columns: {list(schema)}); pass meta= to set them")
        for k, v in r.output.items():
            if k in values:
                values[k][i] = v
        fill.append((i, [c for c in input_columns if c in values and c not in r.output]))
    columns = {c: _column(values[c], schema[c], index, c, errors, inputs[c]) for c in values}
    refill = set()
    for i, cols in fill:  # error rows that had an output also say which input row they were
        if errors[i] is not None:
            for c in cols:
                values[c][i] = rows[i].inputs.get(c)
                inputs[c].add(i)
                refill.add(c)
    for c in refill:  # values that did not fit were set to null in the first pass
        columns[c] = _column(values[c], schema[c], index, c, errors, inputs[c])
    columns[error] = pd.Series(errors, index=index, dtype=_STRING)
    return pd.DataFrame(columns, index=index)


def _plain(value):
    """``value`` with numpy arrays (a list column read back from Arrow) as lists, at any depth."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _is_null(value) -> bool:
    try:
        return value is None or bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def _join(first: str | None, second: str | None) -> str | None:
    if first is None:
        return second
    return first if second is None else f"{first}; {second}"


def _show(value) -> str:
    text = repr(value)
    return f"{text[:80]}... ({type(value).__name__})" if len(text) > 80 else f"{text} ({type(value).__name__})"


def build_processor(config: vLLMEngineProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None,
                    preprocess_map_kwargs: dict | None = None, postprocess_map_kwargs: dict | None = None,
                    builder_kwargs: dict | None = None, *, meta: Meta | None = None,
                    sample_rows: int = SAMPLE_ROWS, key: str | None = None, cache=None) -> Processor:
    """A processor mapping a Dask (or pandas) DataFrame through ``preprocess``, the engine
    and ``postprocess``.

    ``meta`` describes the columns ``postprocess`` returns (a pandas DataFrame, a dict or
    list of ``(column, dtype)`` pairs, or a ``pyarrow.Schema``); without it the output's
    types come from running the first ``sample_rows`` rows of a Dask input through the
    whole pipeline when the processor is called. ``key`` (a string) names what
    ``preprocess`` and ``postprocess`` do for :func:`dfllm.write_parquet` with
    ``resume=True``, in place of their fingerprints. ``cache`` (a path or URL, a
    :class:`dfllm.ResponseCache` or a dict of its fields) sets the config's response cache
    (see :mod:`dfllm.tasks.response_cache`). See :mod:`dfllm.jobs.processor`.

    Ray Data LLM's other arguments are accepted: ``preprocess_map_kwargs`` and
    ``postprocess_map_kwargs`` (Ray's ``map`` options: Ray-cluster-only, no effect on Dask;
    dicts or None) and ``builder_kwargs`` (only ``chat_template_kwargs``, as the config's).
    """
    for name, value in (("preprocess_map_kwargs", preprocess_map_kwargs),
                        ("postprocess_map_kwargs", postprocess_map_kwargs), ("builder_kwargs", builder_kwargs)):
        _optional_dict(name, value)
    if builder_kwargs:
        unknown = sorted(set(builder_kwargs) - {"chat_template_kwargs"})
        if unknown:
            raise TypeError(f"builder_kwargs: unknown key(s) {unknown}; dfllm takes only 'chat_template_kwargs'")
        config = dataclasses.replace(config, chat_template_kwargs=builder_kwargs["chat_template_kwargs"])
    if cache is not None:
        config = dataclasses.replace(config, cache=cache)
    return Processor(config, preprocess, postprocess, meta=meta, sample_rows=sample_rows, key=key)


def build_llm_processor(config: vLLMEngineProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                        postprocess: Callable[[dict], dict] | None = None,
                        preprocess_map_kwargs: dict | None = None, postprocess_map_kwargs: dict | None = None,
                        builder_kwargs: dict | None = None, *, meta: Meta | None = None,
                        sample_rows: int = SAMPLE_ROWS, key: str | None = None) -> Processor:
    """Ray Data LLM's older name of :func:`build_processor` (deprecated there, and here:
    a ``DeprecationWarning``, then the same processor)."""
    warnings.warn("build_llm_processor is deprecated (as in Ray Data LLM); use build_processor",
                  DeprecationWarning, stacklevel=2)
    return build_processor(config, preprocess, postprocess, preprocess_map_kwargs, postprocess_map_kwargs,
                           builder_kwargs, meta=meta, sample_rows=sample_rows, key=key)
