"""Engine configuration: the constructor arguments of :class:`dfllm.LLM`, resolved."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from dfllm.kernels.backend import BACKENDS
from dfllm.models.loader import config_dtype

DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


@dataclass
class EngineConfig:
    """Resolved settings of one engine instance."""

    model_path: Path
    hf_config: PretrainedConfig
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
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" is CUDA when available, else CPU."""
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


def resolve_dtype(dtype: str | torch.dtype, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """"auto" is the checkpoint's dtype on CUDA (float32 checkpoints run in bfloat16 there);
    on CPU it is float32, which the CPU matmul kernels run fastest and most exactly."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        resolved = config_dtype(hf_config)
        if resolved == torch.float32:
            resolved = torch.bfloat16
    elif dtype in DTYPES:
        resolved = DTYPES[dtype]
    else:
        raise ValueError(f"unsupported dtype {dtype!r}; use 'auto', 'float32', 'float16' or 'bfloat16'")
    if resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {resolved}; use float32, float16 or bfloat16")
    return resolved


def resolve_max_model_len(max_model_len: int | None, hf_config: PretrainedConfig) -> int:
    """Defaults to the model's ``max_position_embeddings``; may not exceed it."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if max_model_len is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
        return int(limit)
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    if limit is not None and max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}")
    return int(max_model_len)


def check_engine_args(max_num_seqs: int, block_size: int, gpu_memory_utilization: float,
                      tensor_parallel_size: int, attention_backend: str) -> None:
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
