"""The arguments of :class:`dfllm.LLM`, each defined once, as one field of :class:`EngineArgs`:
its type, its default (vLLM's, for vLLM's arguments), its help text and, for vLLM's
compatibility arguments, what dfllm does with it and the check of a value. Everything else is
derived from the fields: ``LLM.__init__``'s keyword-only signature spells them out (a test
checks it), :meth:`dfllm.config.EngineConfig.create` resolves them, the dataframe methods'
keyword check reads :data:`ENGINE_ARG_NAMES`, the command line's engine flags come from
:func:`add_cli_args` and docs/from_vllm.md's table is :func:`markdown_table`.

vLLM's ``LLM(model, **kwargs)`` forwards its keyword arguments to ``EngineArgs``; offline
examples commonly pass some that concern machinery dfllm does not have (swap space, Ray) or
choices it does not offer (quantization, remote code). Each of those (:data:`VLLM_ARGS`) has
an ``effect``, and its field's check decides each value (:func:`check_engine_args`, the one
place every argument's value is checked):

- **maps**: the value changes what dfllm does (``tokenizer_mode="slow"``, ``max_logprobs``,
  ``scheduling_policy``, ``enforce_eager``, ``skip_tokenizer_init``, ``reasoning_parser``);
- **no-op**: any value of the right type is accepted and changes nothing (``swap_space``);
- **refuses**: a value dfllm cannot honour raises ``ValueError`` naming the argument and
  the value, instead of being ignored silently (``trust_remote_code=True``).

Names dfllm does not know still raise ``TypeError``, as in vLLM.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from dfllm.kernels.backend import check_attention_backend
from dfllm.models.quantization import QUANTIZATIONS
from dfllm.reasoning import check_reasoning_parser, reasoning_parser_names
from dfllm.structured_outputs import check_backend

RUNNERS = ("auto", "generate", "pooling")
DATAFRAME_MAX_LORAS = 4  # max_loras of a dataframe job naming adapters (see the field)
DATAFRAME_MAX_CPU_LORAS = 32  # at least: every adapter of a partition stays read
KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16}  # vLLM's kv_cache_dtype values dfllm serves
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")  # vLLM's logprobs_mode
MAX_CAPTURE_SIZE = 512  # vLLM's largest default capture size
CAPTURE_SIZES_FIELD = "compilation_config.cudagraph_capture_sizes"


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's buckets: 1, 2, 4, 8, then multiples of 8, up to the first one holding
    ``max_num_seqs`` sequences (at most :data:`MAX_CAPTURE_SIZE`)."""
    sizes = []
    for size in [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]:
        sizes.append(size)
        if size >= max_num_seqs:
            break
    return tuple(sizes)


def parse_capture_sizes(compilation_config: Any) -> tuple[int, ...] | None:
    """The ``cudagraph_capture_sizes`` of vLLM's ``compilation_config`` (sorted, unique), or None
    for the defaults. ``compilation_config`` may be None, an int (vLLM's compilation level:
    accepted, nothing to compile), a dict or an object with that attribute (vLLM's
    ``CompilationConfig``); its other fields are accepted and ignored. ``ValueError`` names the
    field for anything else; an empty list captures nothing."""
    if compilation_config is None or (isinstance(compilation_config, int) and not isinstance(compilation_config, bool)):
        return None
    if isinstance(compilation_config, str | bytes | bool | float):
        raise ValueError(
            "compilation_config must be None, an int (a compilation level), a dict or an object with "
            f"a cudagraph_capture_sizes attribute, got {compilation_config!r}"
        )
    if isinstance(compilation_config, dict):
        sizes = compilation_config.get("cudagraph_capture_sizes")
    else:
        sizes = getattr(compilation_config, "cudagraph_capture_sizes", None)
    if sizes is None:
        return None
    if isinstance(sizes, str | bytes) or not isinstance(sizes, Iterable):
        raise ValueError(f"{CAPTURE_SIZES_FIELD} must be a list of ints >= 1, got {sizes!r}")
    sizes = list(sizes)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"{CAPTURE_SIZES_FIELD} must be a list of ints >= 1, got {sizes!r}")
    return tuple(sorted(set(sizes)))


# ---- the checks of vLLM's arguments ------------------------------------------------------------------------------

_LOCAL = (
    "dfllm downloads nothing: a model is a local directory or the alias of a bundled model; "
    "check out the revision you want into a directory and pass its path"
)


def _refuse(name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not supported by dfllm: {why}")


def _is(value: Any, allowed: tuple) -> bool:
    """``value`` among ``allowed``, with bools and ints kept apart (``1`` is not ``True``)."""
    return any(type(value) is type(a) and value == a for a in allowed)


def _only(allowed: tuple, why: str) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if not _is(value, allowed):
            raise _refuse(name, value, why)

    return check


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _optional_bool(name: str, value: Any) -> None:
    if value is not None:
        _bool(name, value)


def _number(minimum: float) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
            raise ValueError(f"{name} must be a number >= {minimum}, got {value!r}")

    return check


def _int(minimum: int) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")

    return check


def _choice(allowed: tuple) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if not _is(value, allowed):
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")

    return check


def _power_of_two(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value!r}")


def _fraction(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def _attention_backend(name: str, value: Any) -> None:
    check_attention_backend(value)


def _optional_int(minimum: int) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}")

    return check


STRUCTURED_OUTPUTS_KEYS = (
    "backend",
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "reasoning_parser",
    "enable_in_reasoning",
)


def _structured_outputs_config(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be None or a dict such as {{'backend': 'xgrammar'}}, got {value!r}")
    unknown = sorted(set(value) - set(STRUCTURED_OUTPUTS_KEYS), key=repr)  # keys of any type
    if unknown:
        raise _refuse(name, value, f"only {list(STRUCTURED_OUTPUTS_KEYS)} can be set (found {unknown})")
    _reasoning_parser(f"{name}['reasoning_parser']", value.get("reasoning_parser"))
    for key in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties", "enable_in_reasoning"):
        if key in value:
            _bool(f"{name}['{key}']", value[key])
    try:
        check_backend(value.get("backend", "auto"))
    except ValueError as exc:
        raise _refuse(name, value, str(exc)) from None


def _attention_config(name: str, value: Any) -> None:
    backend = value.get("backend") if isinstance(value, dict) else getattr(value, "backend", None)
    if backend is not None:
        raise _refuse(
            name,
            value,
            f"backend {backend!r}: dfllm runs its own attention kernels, chosen with attention_backend= "
            "('auto', 'torch', 'cpu' or 'triton'); leave attention_config's backend unset",
        )


def _reasoning_parser(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} must be a reasoning parser's name (a str), got {value!r}")
    try:
        check_reasoning_parser(value)
    except ValueError as exc:  # name the argument as given
        raise ValueError(str(exc).replace("reasoning_parser=", f"{name}=", 1)) from None


def _compilation_config(name: str, value: Any) -> None:
    try:
        parse_capture_sizes(value)
    except ValueError as exc:
        raise ValueError(f"{name}={value!r} is not supported by dfllm: {exc}") from None


def _hf_overrides(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, dict) and not callable(value):
        raise _refuse(name, value, "give a dict of config.json fields or a callable taking and returning the config")


def _arg(
    default: Any,
    help: str,
    effect: str | None = None,
    check: Callable[[str, Any], None] | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """One engine argument: its default, its help text and the ``check`` of a value (raising
    ``ValueError`` naming the argument; :func:`check_engine_args` runs it, the one place a value
    is checked); vLLM's compatibility arguments add what dfllm does with them (``effect``:
    "maps", "no-op" or "refuses"; the help is the docs table's cell)."""
    return field(default=default, metadata={"help": help, "effect": effect, "check": check, "choices": choices})


@dataclass(frozen=True)
class EngineArgs:
    """The arguments of :class:`dfllm.LLM`, one field each (see :func:`_arg` for a field's metadata),
    in the order of ``LLM.__init__``'s signature, which spells them out for users and IDEs;
    :mod:`dfllm.engine_args` derives vLLM's table, the keyword check and the command line's
    flags from them, and :meth:`EngineConfig.create` resolves them."""

    model: str | Path | None = _arg(
        None, "model directory or the alias of a bundled model (default: the bundled chat model, SmolLM2-135M-Instruct)"
    )
    tokenizer: str | Path | None = _arg(
        None, "tokenizer directory or the alias of a bundled model, resolved as `model` is (default: the model's)"
    )
    dtype: str | torch.dtype = _arg(
        "auto",
        "auto (float32 on CPU; on CUDA the checkpoint's, bfloat16 for float32 "
        "checkpoints), float32, float16 or bfloat16",
    )
    device: str | torch.device = _arg("auto", "auto (CUDA when available, else CPU), cpu or cuda")
    max_model_len: int | None = _arg(
        None, "the engine's context length (default: the model's max_position_embeddings)", check=_optional_int(1)
    )
    max_num_seqs: int = _arg(256, "the most sequences in one step", check=_int(1))
    max_num_batched_tokens: int | None = _arg(
        None,
        "tokens per step (default 8192 on CUDA, 2048 on CPU, padded tokens for pooling; never below max_num_seqs)",
        check=_optional_int(1),
    )
    block_size: int = _arg(16, "tokens per KV cache block (a power of two)", check=_power_of_two)
    enable_prefix_caching: bool = _arg(
        True, "keep the KV cache blocks of prompts' shared prefixes for reuse", check=_bool
    )
    kv_cache_memory_bytes: int | None = _arg(
        None, "the KV cache's size in bytes (default: from free memory)", check=_optional_int(1)
    )
    gpu_memory_utilization: float = _arg(
        0.9, "the share of the GPU's memory the engine may use, in (0, 1]", check=_fraction
    )
    seed: int = _arg(0, "the engine's random seed")
    tensor_parallel_size: int = _arg(1, "ranks each layer is split over (processes this one spawns)", check=_int(1))
    pipeline_parallel_size: int = _arg(1, "ranks the layers are split over (processes this one spawns)", check=_int(1))
    attention_backend: str = _arg(
        "auto", "the attention kernels (auto: the fastest for the device)", check=_attention_backend
    )
    runner: str = _arg(
        "auto",
        "auto, generate or pooling (auto: pooling for encoders and sentence-transformers directories)",
        check=_choice(RUNNERS),
    )
    deduplicate_requests: bool = _arg(True, "compute identical deterministic requests once (dfllm's)", check=_bool)
    prefix_aware_scheduling: bool = _arg(
        True, "admit waiting requests longest cached prefix first (dfllm's)", check=_bool
    )
    profiler_dir: str | Path = _arg("./dfllm_traces", "where start_profile() writes its traces")
    # vLLM engine arguments, with vLLM's defaults: the table of docs/from_vllm.md
    enforce_eager: bool = _arg(
        False,
        "`True` turns off the CUDA graphs of decode steps (captured per batch-size bucket on CUDA with the "
        "Triton kernels, as vLLM; prefill always runs eagerly)",
        "maps",
        _bool,
    )
    compilation_config: Any = _arg(
        None,
        "a dict or `CompilationConfig` whose `cudagraph_capture_sizes` sets the decode batch sizes captured "
        "(default 1, 2, 4, 8, then multiples of 8 up to `max_num_seqs`, at most 512; `[]` captures none); an int "
        "level and the other fields are accepted and ignored",
        "maps",
        _compilation_config,
    )
    max_seq_len_to_capture: int | None = _arg(
        8192,
        "accepted, ignored: the decode graphs serve every context length up to `max_model_len`",
        "no-op",
        _optional_int(1),
    )
    disable_log_stats: bool = _arg(
        True,
        "accepted: dfllm logs no periodic stats either way, and `get_metrics()` works whatever the value",
        "no-op",
        _bool,
    )
    max_logprobs: int | None = _arg(
        20,
        "enforced as in vLLM: a request asking more `logprobs` or `prompt_logprobs` (-1 counts as the vocabulary "
        'size) raises `ValueError` ("Requested sample logprobs of K, which is greater than max allowed: 20"); '
        "`-1` allows the whole vocabulary",
        "maps",
        _optional_int(-1),
    )
    logprobs_mode: str = _arg(
        "raw_logprobs",
        'what `logprobs` hand back, as vLLM: `"raw_logprobs"` (the model\'s distribution), `"raw_logits"`, '
        '`"processed_logprobs"` or `"processed_logits"` (after the structured-output mask, logit bias, '
        "allowed/bad words, penalties, and for a sampled row temperature, top-k, top-p and min-p: -inf where "
        "they rule a token out); the sampled token first, then the top-k by rank; prompt logprobs are never "
        "processed: the model's distribution, or its logits under the `*_logits` modes",
        "maps",
        _only(LOGPROBS_MODES, f"vLLM's logprobs modes are {list(LOGPROBS_MODES)}"),
        LOGPROBS_MODES,
    )
    enable_chunked_prefill: bool | None = _arg(
        None, "accepted: chunked prefill is always on (as in vLLM V1); `False` changes nothing", "no-op", _optional_bool
    )
    swap_space: float = _arg(
        4, "accepted, ignored: preempted requests are recomputed, never swapped", "no-op", _number(0)
    )
    enable_sleep_mode: bool = _arg(False, "accepted: `sleep()`/`wake_up()` are always available", "no-op", _bool)
    disable_custom_all_reduce: bool = _arg(
        False, "accepted, ignored: parallel ranks use torch.distributed collectives", "no-op", _bool
    )
    tokenizer_mode: str = _arg(
        "auto",
        '`"auto"`, `"hf"`; `"slow"` asks transformers for `use_fast=False`; `"mistral"` and others refused',
        "maps",
        _only(("auto", "hf", "slow"), "dfllm uses Hugging Face tokenizers: 'auto', 'hf' or 'slow'"),
    )
    skip_tokenizer_init: bool = _arg(
        False,
        '`True` loads no tokenizer, as vLLM: prompts are token ids (`{"prompt_token_ids": [...]}`) and '
        "outputs carry token ids with empty text; what needs a tokenizer (text prompts, chat, stop strings, bad "
        "words, structured outputs) raises `ValueError` at `generate`",
        "maps",
        _bool,
    )
    trust_remote_code: bool = _arg(
        False,
        "`True` refused: dfllm never runs remote code",
        "refuses",
        _only((False,), "dfllm never runs remote code; it serves the architectures it implements"),
    )
    load_format: str = _arg(
        "auto",
        '`"auto"`, `"safetensors"`; others refused (safetensors only)',
        "refuses",
        _only(("auto", "safetensors"), "dfllm reads safetensors weights only ('auto' or 'safetensors')"),
    )
    revision: str | None = _arg(
        None, "only `None`: models are local directories or bundled aliases", "refuses", _only((None,), _LOCAL)
    )
    tokenizer_revision: str | None = _arg(None, "only `None` (as `revision`)", "refuses", _only((None,), _LOCAL))
    download_dir: str | None = _arg(None, "only `None`: nothing is downloaded", "refuses", _only((None,), _LOCAL))
    kv_cache_dtype: str = _arg(
        "auto",
        '`"auto"` (the model\'s dtype) or `"bfloat16"`: keys and values stored in bfloat16 under a '
        "float32/float16 model (half the cache memory and half the bytes decode attention reads); fp8 refused",
        "maps",
        _only(tuple(KV_CACHE_DTYPES), "dfllm stores the KV cache in the model's dtype ('auto') or in 'bfloat16'"),
    )
    quantization: str | None = _arg(
        None,
        '`None` or `"int8"`: dynamic int8 linear layers for a float32 decoder or a BERT-family encoder on '
        "CPU, one rank; quantized checkpoints and other methods refused",
        "maps",
        _only(
            (None, *QUANTIZATIONS),
            "dfllm quantizes float weights on CPU only (accepted: "
            + ", ".join(repr(q) for q in (None, *QUANTIZATIONS))
            + ")",
        ),
    )
    cpu_offload_gb: float = _arg(
        0,
        "only `0`: weights live on the device",
        "refuses",
        _only((0, 0.0), "dfllm keeps all weights on the device (cpu_offload_gb=0)"),
    )
    structured_outputs_config: dict | None = _arg(
        None,
        '`None` or a dict of `backend` (`"auto"`/`"xgrammar"`; `"guidance"`, `"outlines"`, '
        '`"lm-format-enforcer"` refused by name: dfllm ships xgrammar only), `disable_any_whitespace` and '
        "`disable_additional_properties` (the default of every request's `StructuredOutputsParams` field of "
        "that name: `True` compact JSON, `False` any whitespace; `True` closes JSON schemas' objects), "
        "`disable_fallback` (accepted: there is no fallback), `reasoning_parser` (as the argument) and "
        "`enable_in_reasoning` (`True`: the grammar constrains the reasoning too)",
        "maps",
        _structured_outputs_config,
    )
    reasoning_parser: str | None = _arg(
        "",
        '`"qwen3"` or `"deepseek_r1"`: each completion\'s reasoning (`<think>`...`</think>`) goes to '
        "`CompletionOutput.reasoning_content` (a `reasoning_content` column on dataframes) and only the answer "
        "stays in `text`; structured outputs constrain the answer, as in vLLM; other names refused (see "
        '"Reasoning models")',
        "maps",
        _reasoning_parser,
        tuple(reasoning_parser_names()),
    )
    scheduling_policy: str = _arg(
        "fcfs",
        '`"fcfs"` (arrival order) or `"priority"`: the `priority=` of `generate`/`chat`/`enqueue`, '
        'lower first, then arrival (as vLLM); under `"fcfs"` any priority is accepted and changes nothing, as in '
        "vLLM; others refused",
        "maps",
        _only(
            ("fcfs", "priority"),
            "dfllm schedules first come, first served ('fcfs') or by request priority ('priority')",
        ),
    )
    hf_overrides: dict[str, Any] | Callable | None = _arg(
        None,
        "a dict of `config.json` fields (a nested dict updates a sub-config) or a callable taking and "
        "returning the Hugging Face config; applied before dfllm reads the config",
        "maps",
        _hf_overrides,
    )
    enable_lora: bool = _arg(
        False,
        "`True` serves LoRA adapters: `lora_request=LoRARequest(name, id, path)` on `generate`/`chat`/"
        "`enqueue` (one, or one per prompt), adapters of different requests sharing every step; `add_lora`/"
        "`remove_lora`/`list_loras`/`pin_lora` (see docs/lora.md)",
        "maps",
        _bool,
    )
    max_loras: int = _arg(
        1,
        "adapter slots: the most distinct adapters in one step (the dataframe methods and `dfllm run` make it "
        f"{DATAFRAME_MAX_LORAS} when a job names adapters: a partition's rows may name several)",
        "maps",
        _int(1),
    )
    max_lora_rank: int = _arg(
        16, "the largest adapter rank accepted (a higher one is refused by name)", "maps", _int(1)
    )
    max_cpu_loras: int | None = _arg(
        None,
        "adapters kept read in host memory (least recently used evicted; None: `max_loras`)",
        "maps",
        _optional_int(1),
    )
    distributed_executor_backend: str | None = _arg(
        None,
        '`None`, `"mp"`; `"ray"` and others refused',
        "refuses",
        _only((None, "mp"), "dfllm runs parallel ranks as local processes it spawns (None or 'mp')"),
    )
    async_scheduling: bool | None = _arg(
        None,
        "`True` schedules and launches each step before the last one's tokens reach the host (the device reads "
        "them itself), overlapping the host's work with the device's, the same tokens either way; `None`: off "
        "until measured on a GPU; one rank and text models only",
        "maps",
        _optional_bool,
    )
    attention_config: Any = _arg(
        None,
        "a dict or `AttentionConfig`: its tuning fields are accepted and ignored (they tune vLLM's kernels); "
        "a `backend` is refused by name (dfllm's kernels are chosen with `attention_backend`)",
        "refuses",
        _attention_config,
    )
    config_format: str = _arg(
        "auto",
        '`"auto"`, `"hf"` (a Hugging Face `config.json`, the only format dfllm reads); `"mistral"` refused',
        "refuses",
        _only(("auto", "hf"), "dfllm reads Hugging Face config.json files only ('auto' or 'hf')"),
    )
    # vLLM's multimodal arguments (docs/images.md)
    limit_mm_per_prompt: dict[str, int] | None = _arg(
        None, 'the most items of each modality in one prompt, e.g. {"image": 2}'
    )
    mm_processor_kwargs: dict[str, Any] | None = _arg(None, "keyword arguments of the model's image processor")


# ---- what is derived from the fields ------------------------------------------------------------
ENGINE_ARGS: tuple[Field, ...] = fields(EngineArgs)
#: the keyword arguments of ``LLM(model, **engine_kwargs)``: every field but ``model``
ENGINE_ARG_NAMES: tuple[str, ...] = tuple(a.name for a in ENGINE_ARGS if a.name != "model")
#: vLLM's compatibility arguments: the fields with an effect, the table of docs/from_vllm.md
VLLM_ARGS: tuple[Field, ...] = tuple(a for a in ENGINE_ARGS if a.metadata["effect"])
DEFAULTS: dict[str, Any] = {a.name: a.default for a in ENGINE_ARGS}


BY_NAME: dict[str, Field] = {a.name: a for a in ENGINE_ARGS}


def as_kwargs(args: EngineArgs) -> dict[str, Any]:
    """Every argument of ``args``, by name."""
    return {a.name: getattr(args, a.name) for a in ENGINE_ARGS}


def check_engine_args(**kwargs: Any) -> None:
    """Check engine arguments by name, each by its field's check: the one place a value is
    checked (:meth:`dfllm.config.EngineConfig.create` runs it on all of them; the jobs run it
    on their flags before a cluster starts). An unknown name raises ``TypeError``, as in vLLM;
    a value dfllm cannot honour raises ``ValueError`` naming the argument and the value.
    What depends on the model or on several arguments at once is checked by ``create``."""
    unknown = sorted(set(kwargs) - set(BY_NAME))
    if unknown:
        raise TypeError(f"unexpected engine argument(s) {unknown}")
    for name, value in kwargs.items():
        check = BY_NAME[name].metadata["check"]
        if check is not None:
            check(name, value)


def _show(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def markdown_table() -> str:
    """The table of vLLM's arguments in docs/from_vllm.md: argument | vLLM default | in dfllm."""
    rows = ["| argument | vLLM default | in dfllm |", "|---|---|---|"]
    rows += [f"| `{a.name}` | `{_show(a.default)}` | {a.metadata['help']} |" for a in VLLM_ARGS]
    return "\n".join(rows)


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None


def add_cli_args(parser: Any, prefix: str = "", **helps: str) -> None:
    """One flag per engine argument (:data:`ENGINE_ARG_NAMES`, in the fields' order: ``dfllm run``'s and
    ``dfllm run-batch``'s), in vLLM's spelling (``max_model_len`` -> ``--max-model-len``), stored as
    ``prefix + name``, helped by the field's text (or ``helps[name]``): a bool takes ``--x``/``--no-x``,
    an int, float or str its value (one of the field's choices, if it has them), anything else JSON.
    Each defaults to None: unset, ``LLM``'s default."""
    for arg in (a for a in ENGINE_ARGS if a.name in ENGINE_ARG_NAMES):
        kind = str(arg.type).replace(" ", "")
        options: dict[str, Any] = {
            "default": None,
            "dest": prefix + arg.name,
            "help": helps.get(arg.name, arg.metadata["help"]).replace("%", "%%"),
        }
        if kind.startswith("bool"):
            options["action"] = argparse.BooleanOptionalAction
        elif arg.metadata["choices"]:
            options.update(choices=arg.metadata["choices"], metavar="NAME")
        elif kind.startswith("int"):
            options.update(type=int, metavar="N")
        elif kind.startswith("float"):
            options.update(type=float, metavar="X")
        elif kind.startswith("str"):
            options["metavar"] = "TEXT"
        else:
            options.update(type=_json_value, metavar="JSON")
        parser.add_argument("--" + arg.name.replace("_", "-"), **options)


def cli_kwargs(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The engine flags of :func:`add_cli_args` given on the command line, as ``LLM(...)`` keyword arguments."""
    return {k.removeprefix(prefix): v for k, v in vars(args).items() if k.startswith(prefix) and v is not None}
