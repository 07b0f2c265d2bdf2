"""Engine configuration: the arguments of :class:`dfllm.LLM` (:class:`dfllm.engine_args.EngineArgs`)
resolved and checked against the model into one frozen :class:`EngineConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from dfllm.engine_args import KV_CACHE_DTYPES, EngineArgs, default_capture_sizes, parse_capture_sizes
from dfllm.kernels.backend import BACKENDS
from dfllm.models.bundled import resolve_model
from dfllm.models.families import unsupported_architecture_message
from dfllm.models.loader import load_config
from dfllm.models.quantization import QUANTIZATIONS, quantized_engine
from dfllm.models.registry import (
    is_generative,
    is_pooling_only,
    model_class,
    pooling_model_class,
)
from dfllm.models.seq_cls import adapt_seq_cls_config
from dfllm.models.sliding_window import honours_windows
from dfllm.models.spec import ModelSpec, check_parallel_config

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
RUNNERS = ("auto", "generate", "pooling")
SCHEDULING_POLICIES = ("fcfs", "priority")
DEFAULT_MAX_LOGPROBS = 20  # vLLM's default


@dataclass(frozen=True)
class EngineConfig:
    """Resolved settings of one engine instance; build it with :meth:`create`.

    ``model`` describes the checkpoint (the model code reads it, never ``hf_config``);
    ``runner_type`` is "generate" or "pooling". ``max_logprobs`` caps the ``logprobs`` and
    ``prompt_logprobs`` a request may ask (-1: the whole vocabulary), checked by the input
    processor; ``scheduling_policy`` is "fcfs" (arrival order) or "priority" (a request's
    ``priority``, lower first, then arrival), as vLLM's. ``deduplicate_requests`` computes
    identical deterministic requests once (see :mod:`dfllm.engine.llm_engine`);
    ``prefix_aware_scheduling`` admits waiting requests longest cached prefix first (see
    :mod:`dfllm.engine.scheduler`).
    """

    model_path: Path
    tokenizer_path: Path  # the tokenizer's directory: the model's, or `tokenizer` resolved as `model` is
    hf_config: PretrainedConfig
    model: ModelSpec
    runner_type: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    seed: int
    attention_backend: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_logprobs: int
    logprobs_mode: str  # vLLM's: what sampled logprobs hand back (dfllm.engine.sampler)
    scheduling_policy: str
    deduplicate_requests: bool
    prefix_aware_scheduling: bool
    quantization: str | None  # "int8": dynamic int8 linear layers (dfllm.models.quantization)
    # CUDA graphs of decode steps (dfllm.engine.cuda_graphs): vLLM's enforce_eager turns them off;
    # the batch-size buckets captured (vLLM's compilation_config.cudagraph_capture_sizes)
    enforce_eager: bool
    cudagraph_capture_sizes: tuple[int, ...]
    # the KV cache's element type when it differs from the model's (vLLM's kv_cache_dtype)
    kv_cache_dtype: torch.dtype | None
    # LoRA adapters (vLLM's enable_lora, max_loras, max_lora_rank, max_cpu_loras): see dfllm.lora
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    # vLLM's structured_outputs_config defaults for every request's StructuredOutputsParams
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False

    @property
    def kv_dtype(self) -> torch.dtype:
        """The element type of the KV cache: ``kv_cache_dtype``, else the model's dtype."""
        return self.kv_cache_dtype or self.dtype

    @property
    def world_size(self) -> int:
        """The number of ranks the model is split over."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @classmethod
    def create(cls, args: EngineArgs) -> EngineConfig:
        """Resolve and check :class:`dfllm.LLM`'s engine arguments (:class:`dfllm.engine_args.EngineArgs`)
        and the model they name, before anything is loaded but its ``config.json``: bad arguments, a model
        that cannot be found, an architecture, quantization or sliding windows dfllm does not
        support, and sizes the model cannot be split by raise ``ValueError`` (``runner="generate"``
        for an encoder too; ``NotImplementedError`` for a parallel pooling model).
        ``max_logprobs=None`` is vLLM's default, 20; ``quantization="int8"`` is
        :mod:`dfllm.models.quantization`; ``kv_cache_dtype="bfloat16"`` rounds each key and
        value once, when written."""
        if args.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {args.runner!r}")
        max_logprobs = _check_max_logprobs(args.max_logprobs)
        if args.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {args.scheduling_policy!r}")
        tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
        check_engine_args(args.max_num_seqs, args.block_size, args.gpu_memory_utilization, tp, args.attention_backend)
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
        elif max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        resolved_dtype = resolve_dtype(args.dtype, spec, dev)
        _check_model(spec, runner_type, max_len)
        _check_quantization(args.quantization, dev, resolved_dtype, runner_type, tp, pp, spec)
        if not isinstance(args.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {args.enforce_eager!r}")
        if args.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {args.kv_cache_dtype!r}")
        kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
        max_cpu_loras = _check_lora_args(
            args.enable_lora,
            args.max_loras,
            args.max_lora_rank,
            args.max_cpu_loras,
            spec,
            runner_type,
            args.quantization,
        )
        capture_sizes = parse_capture_sizes(args.compilation_config)
        if capture_sizes is None:
            capture_sizes = default_capture_sizes(args.max_num_seqs)
        structured = args.structured_outputs_config or {}
        return cls(
            model_path=path,
            tokenizer_path=path if args.tokenizer is None else resolve_model(args.tokenizer),
            hf_config=hf_config,
            dtype=resolved_dtype,
            device=dev,
            max_model_len=max_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            seed=args.seed,
            attention_backend=args.attention_backend,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            model=spec,
            runner_type=runner_type,
            max_logprobs=max_logprobs,
            logprobs_mode=args.logprobs_mode,
            scheduling_policy=args.scheduling_policy,
            deduplicate_requests=bool(args.deduplicate_requests),
            prefix_aware_scheduling=bool(args.prefix_aware_scheduling),
            quantization=args.quantization,
            enforce_eager=args.enforce_eager,
            cudagraph_capture_sizes=capture_sizes,
            kv_cache_dtype=None if kv_dtype == resolved_dtype else kv_dtype,
            enable_lora=args.enable_lora,
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            disable_any_whitespace=structured.get("disable_any_whitespace"),
            disable_additional_properties=bool(structured.get("disable_additional_properties", False)),
        )


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
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
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


def _check_lora_args(
    enable_lora: bool,
    max_loras: int,
    max_lora_rank: int,
    max_cpu_loras: int | None,
    spec: ModelSpec,
    runner_type: str,
    quantization: str | None,
) -> int:
    """vLLM's LoRA arguments checked; ``max_cpu_loras`` resolved (None: ``max_loras``, as vLLM)."""
    if not isinstance(enable_lora, bool):
        raise ValueError(f"enable_lora must be a bool, got {enable_lora!r}")
    for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if max_cpu_loras is None:
        max_cpu_loras = max_loras
    if isinstance(max_cpu_loras, bool) or not isinstance(max_cpu_loras, int) or max_cpu_loras < max_loras:
        raise ValueError(f"max_cpu_loras must be None or an int >= max_loras ({max_loras}), got {max_cpu_loras!r}")
    if enable_lora:
        if runner_type not in ("generate", "pooling"):
            raise ValueError(
                f"enable_lora=True serves generating models and decoders run with runner='pooling', "
                f"not runner={runner_type!r}"
            )
        if quantization is not None:
            raise ValueError(f"enable_lora=True runs quantization=None (got {quantization!r})")
        if not set(spec.architectures) & set(LORA_ARCHITECTURES):
            raise ValueError(
                f"enable_lora=True: LoRA adapters are served for {list(LORA_ARCHITECTURES)}, not "
                f"{list(spec.architectures)}"
            )
    return max_cpu_loras


def _check_max_logprobs(max_logprobs: int | None) -> int:
    """vLLM's ``max_logprobs``: an int >= -1 (-1: no cap but the vocabulary); None is the default, 20."""
    if max_logprobs is None:
        return DEFAULT_MAX_LOGPROBS
    if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < -1:
        raise ValueError(f"max_logprobs must be an int >= -1 (-1: the whole vocabulary), got {max_logprobs!r}")
    return max_logprobs


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
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    if limit is not None and max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}")
    return int(max_model_len)


def check_engine_args(
    max_num_seqs: int, block_size: int, gpu_memory_utilization: float, tensor_parallel_size: int, attention_backend: str
) -> None:
    """Reject bad constructor arguments before anything is loaded."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}")
    if attention_backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {attention_backend!r}")


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
