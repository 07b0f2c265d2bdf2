"""Engine configuration: the arguments of :class:`dfllm.LLM` (:class:`dfllm.engine_args.EngineArgs`)
resolved and checked against the model into one frozen :class:`EngineConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from dfllm.engine_args import (
    DEFAULTS,
    KV_CACHE_DTYPES,
    EngineArgs,
    as_kwargs,
    check_engine_args,
    default_capture_sizes,
    parse_capture_sizes,
)
from dfllm.models.bundled import resolve_model
from dfllm.models.families import unsupported_architecture_message
from dfllm.models.loader import load_config
from dfllm.models.quantization import quantized_engine
from dfllm.models.registry import (
    is_generative,
    is_pooling_only,
    model_class,
    pooling_model_class,
)
from dfllm.models.seq_cls import adapt_seq_cls_config
from dfllm.models.sliding_window import honours_windows
from dfllm.models.spec import ModelSpec, check_parallel_config
from dfllm.reasoning import make_reasoning_parser, reasoning_settings

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class EngineConfig:
    """One engine instance's settings; build it with :meth:`create`.

    ``args`` are :class:`dfllm.LLM`'s arguments as given (checked); the fields below are the
    settings resolved against the model and the device, and any other argument reads through
    unchanged (``config.max_num_seqs`` is ``config.args.max_num_seqs``), so each argument is
    named once, in :class:`~dfllm.engine_args.EngineArgs`. ``model`` describes the checkpoint
    (the model code reads it, never ``hf_config``); ``runner_type`` is "generate" or "pooling".
    """

    args: EngineArgs
    model_path: Path
    tokenizer_path: Path  # the tokenizer's directory: the model's, or `tokenizer` resolved as `model` is
    use_fast_tokenizer: bool  # vLLM's tokenizer_mode: "slow" asks transformers for use_fast=False
    hf_config: PretrainedConfig
    model: ModelSpec
    runner_type: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_batched_tokens: int
    max_logprobs: int  # -1: the whole vocabulary (checked by the input processor)
    # CUDA graphs of decode steps (dfllm.engine.cuda_graphs): the batch-size buckets captured
    # (vLLM's compilation_config.cudagraph_capture_sizes; enforce_eager turns them off)
    cudagraph_capture_sizes: tuple[int, ...]
    # the KV cache's element type when it differs from the model's (vLLM's kv_cache_dtype)
    kv_cache_dtype: torch.dtype | None
    max_cpu_loras: int  # LoRA adapters read in host memory (see dfllm.lora)
    # the reasoning parser's name (the argument, else structured_outputs_config's) and whether
    # structured outputs constrain the reasoning too (see dfllm.reasoning)
    reasoning_parser: str | None
    enable_in_reasoning: bool
    # vLLM's structured_outputs_config defaults for every request's StructuredOutputsParams
    disable_any_whitespace: bool | None
    disable_additional_properties: bool
    # whether each step is scheduled and launched before the last one's tokens reach the host
    # (vLLM's async_scheduling; see dfllm.engine.llm_engine)
    async_scheduling: bool

    def __getattr__(self, name: str) -> Any:
        """An argument the engine uses as given: ``args``' value."""
        if name == "args" or name.startswith("__"):  # while unpickling, before ``args`` is set
            raise AttributeError(name)
        return getattr(self.args, name)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The element type of the KV cache: ``kv_cache_dtype``, else the model's dtype."""
        return self.kv_cache_dtype or self.dtype

    @property
    def world_size(self) -> int:
        """The number of ranks the model is split over."""
        return self.args.tensor_parallel_size * self.args.pipeline_parallel_size

    @classmethod
    def create(cls, args: EngineArgs) -> EngineConfig:
        """Check :class:`dfllm.LLM`'s engine arguments (:class:`dfllm.engine_args.EngineArgs`; each
        value by :func:`~dfllm.engine_args.check_engine_args`) and resolve them against the model
        they name, before anything is loaded but its ``config.json``: bad arguments, a model that
        cannot be found, an architecture, quantization or sliding windows dfllm does not support,
        and sizes the model cannot be split by raise ``ValueError`` (``runner="generate"`` for
        an encoder too; ``NotImplementedError`` for a parallel pooling model).
        ``max_logprobs=None`` is vLLM's default, 20; ``quantization="int8"`` is
        :mod:`dfllm.models.quantization`; ``kv_cache_dtype="bfloat16"`` rounds each key and
        value once, when written."""
        check_engine_args(**as_kwargs(args))
        reasoning, enable_in_reasoning = reasoning_settings(args.reasoning_parser, args.structured_outputs_config)
        if reasoning is not None and args.skip_tokenizer_init:
            make_reasoning_parser(reasoning, None)  # ValueError: a parser reads text and needs the tokenizer
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        path = resolve_model(args.model)
        hf_config = adapt_seq_cls_config(apply_hf_overrides(load_config(path), args.hf_overrides), path)
        spec = ModelSpec.from_hf(hf_config)
        dev = resolve_device(args.device)
        max_len = resolve_max_model_len(args.max_model_len, spec)
        runner_type = _resolve_runner(args.runner, spec, path)
        _check_parallel(spec, runner_type, tp, pp)
        max_num_batched_tokens = args.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = _default_token_budget(dev, args.max_num_seqs)
        resolved_dtype = resolve_dtype(args.dtype, spec, dev)
        _check_model(spec, runner_type, max_len)
        _check_quantization(args.quantization, dev, resolved_dtype, runner_type, tp, pp, spec)
        kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
        max_cpu_loras = _check_lora_args(args, spec, runner_type)
        capture_sizes = parse_capture_sizes(args.compilation_config)
        if capture_sizes is None:
            capture_sizes = default_capture_sizes(args.max_num_seqs)
        structured = args.structured_outputs_config or {}
        return cls(
            args=args,
            model_path=path,
            tokenizer_path=path if args.tokenizer is None else resolve_model(args.tokenizer),
            use_fast_tokenizer=args.tokenizer_mode != "slow",
            hf_config=hf_config,
            model=spec,
            runner_type=runner_type,
            dtype=resolved_dtype,
            device=dev,
            max_model_len=max_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_logprobs=DEFAULTS["max_logprobs"] if args.max_logprobs is None else args.max_logprobs,
            cudagraph_capture_sizes=capture_sizes,
            kv_cache_dtype=None if kv_dtype == resolved_dtype else kv_dtype,
            max_cpu_loras=max_cpu_loras,
            reasoning_parser=reasoning,
            enable_in_reasoning=enable_in_reasoning,
            disable_any_whitespace=structured.get("disable_any_whitespace"),
            disable_additional_properties=bool(structured.get("disable_additional_properties", False)),
            async_scheduling=resolve_async_scheduling(args.async_scheduling, tp * pp, spec),
        )


def resolve_async_scheduling(value: bool | None, world_size: int, spec: ModelSpec) -> bool:
    """vLLM's ``async_scheduling``: None keeps it off until a GPU run has measured it (it pays
    where a device runs the forward while the host works: one CUDA device; on a CPU the host
    computes the forward too, so nothing overlaps). ``True`` asks for it anywhere it runs: one
    rank, a text model (``ValueError`` otherwise, naming the argument)."""
    runs = world_size == 1 and spec.multimodal is None
    if value is None:
        return False
    if value and not runs:
        why = "a model split over several ranks" if world_size > 1 else "a vision-language model"
        raise ValueError(
            f"async_scheduling=True: dfllm schedules asynchronously on one rank with a text model, not {why}; "
            "leave it None or False"
        )
    return bool(value)


def _check_quantization(
    quantization: str | None,
    device: torch.device,
    dtype: torch.dtype,
    runner_type: str,
    tp: int,
    pp: int,
    spec: ModelSpec | None = None,
) -> None:
    """``quantization`` is None or "int8"; int8 runs a float32 generating decoder or pooling
    encoder (BERT, RoBERTa, XLM-R, ColBERT; not a decoder used for pooling) on CPU, on one rank."""
    if quantization is None:
        return
    where = f"quantization={quantization!r}"
    if device.type != "cpu":
        raise ValueError(f"{where} runs on CPU only (device {device}); on GPU use quantization=None")
    if runner_type == "pooling" and spec is not None and pooling_model_class(spec)[1]:
        raise ValueError(
            f"{where} serves generating decoders and pooling encoders (BERT, RoBERTa, XLM-R); "
            "a decoder used for pooling (embed, classify, score) runs quantization=None"
        )
    if (tp, pp) != (1, 1):
        raise ValueError(
            f"{where} runs on one rank: tensor_parallel_size and pipeline_parallel_size must be 1 (got {tp} and {pp})"
        )
    if dtype != torch.float32:
        raise ValueError(f"{where} needs dtype float32 (or 'auto' on CPU), got {dtype}")
    quantized_engine()  # RuntimeError naming quantization on a platform without fbgemm


LORA_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)


def _check_lora_args(args: EngineArgs, spec: ModelSpec, runner_type: str) -> int:
    """vLLM's LoRA arguments against each other and the model (each value is checked by its
    field); ``max_cpu_loras`` resolved (None: ``max_loras``, as vLLM)."""
    max_cpu_loras = args.max_loras if args.max_cpu_loras is None else args.max_cpu_loras
    if max_cpu_loras < args.max_loras:
        raise ValueError(f"max_cpu_loras must be None or an int >= max_loras ({args.max_loras}), got {max_cpu_loras!r}")
    if args.enable_lora:
        if runner_type not in ("generate", "pooling"):
            raise ValueError(
                f"enable_lora=True serves generating models and decoders run with runner='pooling', "
                f"not runner={runner_type!r}"
            )
        if args.quantization is not None:
            raise ValueError(f"enable_lora=True runs quantization=None (got {args.quantization!r})")
        if not set(spec.architectures) & set(LORA_ARCHITECTURES):
            raise ValueError(
                f"enable_lora=True: LoRA adapters are served for {list(LORA_ARCHITECTURES)}, not "
                f"{list(spec.architectures)}"
            )
    return max_cpu_loras


def apply_hf_overrides(hf_config: PretrainedConfig, overrides) -> PretrainedConfig:
    """``hf_config`` with vLLM's ``hf_overrides`` applied: a dict of fields (a nested dict
    updates the sub-config of that name) or a callable returning the new config."""
    if overrides is None:
        return hf_config
    if callable(overrides):
        return overrides(hf_config)
    for key, value in overrides.items():
        current = getattr(hf_config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            apply_hf_overrides(current, value)
        else:
            setattr(hf_config, key, value)
    return hf_config


def resolve_device(device: str | torch.device) -> torch.device:
    """ "auto" is CUDA when available, else CPU."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unsupported device {device!r}; use 'cpu', 'cuda' or 'auto'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' requested but no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}; use 'cpu', 'cuda' or 'auto'")
    return dev


def resolve_dtype(dtype: str | torch.dtype, spec: ModelSpec, device: torch.device) -> torch.dtype:
    """ "auto" is the checkpoint's dtype on CUDA (float32 checkpoints run in bfloat16 there);
    on CPU it is float32, which the CPU matmul kernels run fastest and most exactly."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        resolved = spec.dtype
        if resolved == torch.float32:
            resolved = torch.bfloat16
    elif dtype in DTYPES:
        resolved = DTYPES[dtype]
    else:
        raise ValueError(f"unsupported dtype {dtype!r}; use 'auto', 'float32', 'float16' or 'bfloat16'")
    if resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {resolved}; use float32, float16 or bfloat16")
    return resolved


def resolve_max_model_len(max_model_len: int | None, spec: ModelSpec) -> int:
    """Defaults to the model's ``max_position_embeddings``; may not exceed it."""
    limit = spec.max_position_embeddings
    if max_model_len is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
        return int(limit)
    if limit is not None and max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}")
    return int(max_model_len)


def _resolve_runner(runner: str, spec: ModelSpec, path: Path) -> str:
    """ "auto" -> pooling for encoders and sentence-transformers directories, else generate."""
    pooling_only = is_pooling_only(spec)
    if runner == "generate" and pooling_only:
        raise ValueError(
            f"{path.name} ({', '.join(spec.architectures)}) cannot generate text; "
            "use runner='pooling' (embed, classify, score, encode)"
        )
    if runner == "auto":
        return "pooling" if pooling_only or (path / "modules.json").is_file() else "generate"
    return runner


def _check_parallel(spec: ModelSpec, runner_type: str, tp: int, pp: int) -> None:
    """Sizes the model splits by; pooling runs on one rank only."""
    if runner_type == "pooling" and (tp, pp) != (1, 1):
        raise NotImplementedError(
            "pooling models (embed, classify, score, encode) run on one rank: "
            "tensor_parallel_size and pipeline_parallel_size must be 1"
        )
    if spec.kv_lora_rank and (tp, pp) != (1, 1):
        raise NotImplementedError(
            "multi-head latent attention (DeepSeek-V2/V3) runs on one rank: "
            "tensor_parallel_size and pipeline_parallel_size must be 1"
        )
    check_parallel_config(spec, tp, pp)


def _default_token_budget(device: torch.device, max_num_seqs: int) -> int:
    """Tokens per step: 8192 on CUDA, 2048 on CPU (generating and pooling: encoders run their
    batches unpadded, and on 2 threads MiniLM's embeddings took 1.1x less time at 2048 padded
    tokens than at 1024, no less at 4096 or 8192; int8 the same at 1024, 2048 and 4096, slower at 8192)."""
    if device.type == "cuda":
        return max(8192, max_num_seqs)
    return max(2048, max_num_seqs)


def _check_model(spec: ModelSpec, runner_type: str, max_model_len: int) -> None:
    """Reject a decoder dfllm cannot run: an unsupported architecture, a quantized checkpoint,
    or sliding windows its class does not honour (encoders are checked as they are built)."""
    if is_pooling_only(spec):
        return
    if not is_generative(spec):
        raise ValueError(unsupported_architecture_message(spec.architectures))
    if spec.quantization is not None:
        raise ValueError(f"quantized checkpoints ({spec.quantization}) are not supported; use float weights")
    if spec.multimodal is not None:  # a vision-language variant dfllm does not run is refused by name
        model_class(spec).image_tokens(spec)
    # A decoder embedder is held to the model's full length (as the engine always has).
    limit = max_model_len if runner_type == "generate" else spec.max_position_embeddings or max_model_len
    # Sliding windows are honoured by the attention kernels: on every layer alike (Mistral), or
    # per layer by the classes that say so (Gemma); other mixes (Qwen2's max_window_layers) are not.
    window = spec.sliding_window
    if window is not None and window < limit and not honours_windows(model_class(spec).window_support, spec):
        raise ValueError(
            f"sliding-window attention (window {window}) on these layers is not supported for "
            f"{list(spec.architectures)}; set max_model_len <= {window}"
        )
