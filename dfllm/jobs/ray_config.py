"""Ray Data LLM's processor configs on Dask: :class:`vLLMEngineProcessorConfig` (Ray's
fields and defaults, each checked as Ray checks it), dfllm's :class:`ProcessorConfig`, and
Ray's per-stage configs. What each field does here: docs/from_ray.md."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dfllm.accessors.placement import check_resources
from dfllm.tasks.kinds import KINDS
from dfllm.tasks.response_cache import as_cache
from dfllm.tasks.schema import LLM_ERROR

TASK_TYPES = ("generate", "embed", "classify", "score")
#: How much of an ``accelerator_type:<name>`` resource a task asks for: a label, as in Ray.
ACCELERATOR_LABEL = 0.001
RAY_ERROR = "__inference_error__"

#: Config fields left out of a write's key: they place or pace the work (or, for stages, are
#: read through the fields they set) and do not change a row's output.
_NOT_OUTPUT_FIELDS = {
    "concurrency",
    "accelerator_type",
    "resources",
    "runtime_env",
    "placement_group_config",
    "resources_per_bundle",
    "max_concurrent_batches",
    "max_tasks_in_flight_per_actor",
    "max_pending_requests",
    "log_engine_metrics",
    "experimental",
    "chat_template_stage",
    "tokenize_stage",
    "detokenize_stage",
    "prepare_multimodal_stage",
    "prepare_image_stage",
    "tokenize",
    "detokenize",
    "has_image",
    "cache",
}
_STAGE_KEYS = {"enabled", "batch_size", "concurrency", "num_cpus", "num_gpus", "memory", "runtime_env", "model_source"}
_CHAT_STAGE_KEYS = _STAGE_KEYS | {"chat_template", "chat_template_kwargs"}


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


def check_dict(name: str, value) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is a dict or None."""
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
      ``llm_error`` (docs/from_ray.md).
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
            raise ValueError(
                f"task_type={self.task_type!r} needs {required}: set model_source (None is the "
                "default model only of generate, embed and score)"
            )
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
            raise ValueError(
                f"should_continue_on_error must be a bool (or None: dfllm's llm_error column), "
                f"got {self.should_continue_on_error!r}"
            )
        for name in (
            "runtime_env",
            "placement_group_config",
            "resources_per_bundle",
            "chat_template_kwargs",
            "experimental",
        ):
            check_dict(name, getattr(self, name))
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
            raise ValueError(
                f"chat_template_kwargs must map template variable names (strings) to values, "
                f"got {self.chat_template_kwargs!r}"
            )
        # the other stages: checked, on or off (images are read from messages either way)
        for name in ("tokenize_stage", "detokenize_stage", "prepare_multimodal_stage", "prepare_image_stage"):
            _stage(name, getattr(self, name), _STAGE_KEYS)
        for name, what in (
            ("dynamic_lora_loading_path", "a folder path or URL (of LoRA adapter folders)"),
            ("accelerator_type", "a non-empty string like 'H100'"),
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be {what}, got {value!r}")
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
            return LLM_ERROR
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
