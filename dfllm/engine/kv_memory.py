"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

import psutil
import torch

CPU_MEMORY_FRACTION = 0.25
CPU_MAX_BYTES = 4 * 2**30


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_tensors: int = 2
) -> int:
    """Bytes that one block holds across all layers: keys plus values (``num_tensors=2``), or
    keys only (1)."""
    return num_tensors * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def cpu_kv_budget(max_tokens_needed_bytes: int) -> int:
    """On CPU: a quarter of the available RAM, at most 4 GiB, and no more than the engine can use."""
    available = int(psutil.virtual_memory().available * CPU_MEMORY_FRACTION)
    return min(available, CPU_MAX_BYTES, max_tokens_needed_bytes)


def cuda_kv_budget(device: torch.device, gpu_memory_utilization: float) -> int:
    """On CUDA: ``gpu_memory_utilization`` of the card, less what is used and the peak activations."""
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
    used = total - free
    return int(total * gpu_memory_utilization - used - (peak - current))


def allocate(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    num_tensors: int = 2,
) -> torch.Tensor:
    """One tensor ``[2, layers, blocks, block_size, kv_heads, head_dim]`` for all keys and values
    (``[1, ...]``, keys only, for ``num_tensors=1``).

    It is left uninitialised (untouched pages cost nothing on CPU), and its blocks are never
    cleared: attention reads only the slots its sequence wrote (see
    :mod:`dfllm.engine.block_manager`).
    """
    return torch.empty(
        num_tensors, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )
