"""vLLM engine arguments that :class:`dfllm.LLM` accepts for compatibility.

vLLM's ``LLM(model, **kwargs)`` forwards its keyword arguments to ``EngineArgs``; offline
examples commonly pass some that concern machinery dfllm does not have (swap space,
Ray) or choices it does not offer (quantization, remote code). ``dfllm.LLM``
takes the common ones as explicit keyword-only parameters, with vLLM's defaults, and
:func:`check_vllm_args` decides each one in one place, from :data:`VLLM_ARGS`:

- **maps**: the value changes what dfllm does (``tokenizer_mode="slow"``, ``max_logprobs``,
  ``scheduling_policy``, ``enforce_eager``, ``skip_tokenizer_init``, ``reasoning_parser``);
- **no-op**: any value of the right type is accepted and changes nothing (``swap_space``);
- **refuses**: a value dfllm cannot honour raises ``ValueError`` naming the argument and
  the value, instead of being ignored silently (``trust_remote_code=True``).

Names dfllm does not know still raise ``TypeError``, as in vLLM. The table in
docs/from_vllm.md is :func:`markdown_table`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dfllm.config import KV_CACHE_DTYPES, parse_capture_sizes
from dfllm.reasoning import check_reasoning_parser

_LOCAL = ("dfllm downloads nothing: a model is a local directory or the alias of a bundled model; "
          "check out the revision you want into a directory and pass its path")


@dataclass(frozen=True)
class VllmArg:
    """One vLLM engine argument: its vLLM default (also ``dfllm.LLM``'s), what dfllm does
    with it (``"maps"``, ``"no-op"`` or ``"refuses"`` values other than ``accepted``), the
    docs table's cell, and a check raising ``ValueError`` for a value dfllm cannot honour."""

    name: str
    default: Any
    effect: str
    doc: str
    check: Callable[[str, Any], None]


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


def _optional_int(minimum: int) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            raise ValueError(f"{name} must be None or an int >= {minimum}, got {value!r}")
    return check


def _structured_outputs_config(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be None or a dict such as {{'backend': 'xgrammar'}}, got {value!r}")
    unknown = sorted(set(value) - {"backend", "disable_fallback", "reasoning_parser", "enable_in_reasoning"})
    if unknown:
        raise _refuse(name, value, f"only 'backend', 'reasoning_parser' and 'enable_in_reasoning' can be set "
                                   f"(found {unknown}); dfllm's structured outputs follow xgrammar's defaults")
    _reasoning_parser(f"{name}['reasoning_parser']", value.get("reasoning_parser"))
    if "enable_in_reasoning" in value:
        _bool(f"{name}['enable_in_reasoning']", value["enable_in_reasoning"])
    backend = value.get("backend", "auto")
    if not _is(backend, ("auto", "xgrammar")):
        raise _refuse(name, value, f"backend {backend!r}: dfllm's only structured-outputs backend is xgrammar "
                                   "(use 'auto' or 'xgrammar')")


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


VLLM_ARGS: tuple[VllmArg, ...] = (
    VllmArg("enforce_eager", False, "maps", "`True` turns off the CUDA graphs of decode steps (captured per "
            "batch-size bucket on CUDA with the Triton kernels, as vLLM; prefill always runs eagerly)", _bool),
    VllmArg("compilation_config", None, "maps", "a dict or `CompilationConfig` whose `cudagraph_capture_sizes` "
            "sets the decode batch sizes captured (default 1, 2, 4, 8, then multiples of 8 up to `max_num_seqs`, "
            "at most 512; `[]` captures none); an int level and the other fields are accepted and ignored",
            _compilation_config),
    VllmArg("max_seq_len_to_capture", 8192, "no-op", "accepted, ignored: the decode graphs serve every context "
            "length up to `max_model_len`", _optional_int(1)),
    VllmArg("disable_log_stats", True, "no-op", "accepted: dfllm logs no periodic stats either way, and "
            "`get_metrics()` works whatever the value", _bool),
    VllmArg("max_logprobs", 20, "maps", "enforced as in vLLM: a request asking more `logprobs` or "
            "`prompt_logprobs` (-1 counts as the vocabulary size) raises `ValueError` (\"Requested sample logprobs "
            "of K, which is greater than max allowed: 20\"); `-1` allows the whole vocabulary", _optional_int(-1)),
    VllmArg("enable_chunked_prefill", None, "no-op", "accepted: chunked prefill is always on (as in vLLM V1); "
            "`False` changes nothing", _optional_bool),
    VllmArg("swap_space", 4, "no-op", "accepted, ignored: preempted requests are recomputed, never swapped",
            _number(0)),
    VllmArg("enable_sleep_mode", False, "no-op", "accepted: `sleep()`/`wake_up()` are always available",
            _bool),
    VllmArg("disable_custom_all_reduce", False, "no-op", "accepted, ignored: parallel ranks use "
            "torch.distributed collectives", _bool),
    VllmArg("tokenizer_mode", "auto", "maps", "`\"auto\"`, `\"hf\"`; `\"slow\"` asks transformers for "
            "`use_fast=False`; `\"mistral\"` and others refused",
            _only(("auto", "hf", "slow"), "dfllm uses Hugging Face tokenizers: 'auto', 'hf' or 'slow'")),
    VllmArg("skip_tokenizer_init", False, "maps", "`True` loads no tokenizer, as vLLM: prompts are token ids "
            "(`{\"prompt_token_ids\": [...]}`) and outputs carry token ids with empty text; what needs a tokenizer "
            "(text prompts, chat, stop strings, bad words, structured outputs) raises `ValueError` at `generate`",
            _bool),
    VllmArg("trust_remote_code", False, "refuses", "`True` refused: dfllm never runs remote code",
            _only((False,), "dfllm never runs remote code; it serves the architectures it implements")),
    VllmArg("load_format", "auto", "refuses", "`\"auto\"`, `\"safetensors\"`; others refused (safetensors only)",
            _only(("auto", "safetensors"), "dfllm reads safetensors weights only ('auto' or 'safetensors')")),
    VllmArg("revision", None, "refuses", "only `None`: models are local directories or bundled aliases",
            _only((None,), _LOCAL)),
    VllmArg("tokenizer_revision", None, "refuses", "only `None` (as `revision`)", _only((None,), _LOCAL)),
    VllmArg("download_dir", None, "refuses", "only `None`: nothing is downloaded", _only((None,), _LOCAL)),
    VllmArg("kv_cache_dtype", "auto", "maps", "`\"auto\"` (the model's dtype) or `\"bfloat16\"`: keys and "
            "values stored in bfloat16 under a float32/float16 model (half the cache memory and half the bytes "
            "decode attention reads); fp8 refused",
            _only(tuple(KV_CACHE_DTYPES), "dfllm stores the KV cache in the model's dtype ('auto') or in "
                                          "'bfloat16'")),
    VllmArg("quantization", None, "maps", "`None` or `\"int8\"`: dynamic int8 linear layers for a float32 "
            "decoder or a BERT-family encoder on CPU, one rank; quantized checkpoints and other methods refused",
            _only((None, "int8"), "dfllm quantizes float weights on CPU with quantization='int8' only "
                                  "(accepted: None, 'int8')")),
    VllmArg("cpu_offload_gb", 0, "refuses", "only `0`: weights live on the device",
            _only((0, 0.0), "dfllm keeps all weights on the device (cpu_offload_gb=0)")),
    VllmArg("structured_outputs_config", None, "refuses", "`None` or a dict of `backend` (`\"auto\"`/"
            "`\"xgrammar\"`; other backends refused, xgrammar only), `reasoning_parser` (as the argument) and "
            "`enable_in_reasoning` (`True`: the grammar constrains the reasoning too)", _structured_outputs_config),
    VllmArg("reasoning_parser", "", "maps", "`\"qwen3\"` or `\"deepseek_r1\"`: each completion's reasoning "
            "(`<think>`...`</think>`) goes to `CompletionOutput.reasoning_content` (a `reasoning_content` column "
            "on dataframes) and only the answer stays in `text`; structured outputs constrain the answer, as in "
            "vLLM; other names refused (see \"Reasoning models\")", _reasoning_parser),
    VllmArg("scheduling_policy", "fcfs", "maps", "`\"fcfs\"` (arrival order) or `\"priority\"`: the "
            "`priority=` of `generate`/`chat`/`enqueue`, lower first, then arrival (as vLLM); under `\"fcfs\"` any "
            "priority is accepted and changes nothing, as in vLLM; others refused",
            _only(("fcfs", "priority"), "dfllm schedules first come, first served ('fcfs') or by request "
                                        "priority ('priority')")),
    VllmArg("hf_overrides", None, "maps", "a dict of `config.json` fields (a nested dict updates a sub-config) "
            "or a callable taking and returning the Hugging Face config; applied before dfllm reads the config",
            _hf_overrides),
    VllmArg("enable_lora", False, "maps", "`True` serves LoRA adapters: `lora_request=LoRARequest(name, id, path)` "
            "on `generate`/`chat`/`enqueue` (one, or one per prompt), adapters of different requests sharing every "
            "step; `add_lora`/`remove_lora`/`list_loras`/`pin_lora` (see docs/lora.md)", _bool),
    VllmArg("max_loras", 1, "maps", "adapter slots: the most distinct adapters in one step", _optional_int(1)),
    VllmArg("max_lora_rank", 16, "maps", "the largest adapter rank accepted (a higher one is refused by name)",
            _optional_int(1)),
    VllmArg("max_cpu_loras", None, "maps", "adapters kept read in host memory (least recently used evicted; "
            "None: `max_loras`)", _optional_int(1)),
    VllmArg("distributed_executor_backend", None, "refuses", "`None`, `\"mp\"`; `\"ray\"` and others refused",
            _only((None, "mp"), "dfllm runs parallel ranks as local processes it spawns (None or 'mp')")),
)

BY_NAME: dict[str, VllmArg] = {a.name: a for a in VLLM_ARGS}
DEFAULTS: dict[str, Any] = {a.name: a.default for a in VLLM_ARGS}


def check_vllm_args(**kwargs: Any) -> dict[str, Any]:
    """Check vLLM engine arguments by name; return what dfllm uses of them.

    An unknown name raises ``TypeError``; a value dfllm cannot honour raises ``ValueError``
    naming the argument and the value. The result is ``{"use_fast": bool}`` (for the
    tokenizer); ``max_logprobs``, ``scheduling_policy``, ``hf_overrides``, ``quantization``,
    ``kv_cache_dtype``, ``enforce_eager``, ``compilation_config`` and the LoRA arguments go to
    :meth:`dfllm.config.EngineConfig.create`;
    everything else accepted is a no-op.
    """
    unknown = sorted(set(kwargs) - set(BY_NAME))
    if unknown:
        raise TypeError(f"unexpected vLLM engine argument(s) {unknown}")
    for name, value in kwargs.items():
        BY_NAME[name].check(name, value)
    return {"use_fast": kwargs.get("tokenizer_mode", "auto") != "slow"}


def _show(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def markdown_table() -> str:
    """The table of these arguments in docs/from_vllm.md: argument | vLLM default | in dfllm."""
    rows = ["| argument | vLLM default | in dfllm |", "|---|---|---|"]
    rows += [f"| `{a.name}` | `{_show(a.default)}` | {a.doc} |" for a in VLLM_ARGS]
    return "\n".join(rows)
