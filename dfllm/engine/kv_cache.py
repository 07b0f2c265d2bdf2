"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

import logging

import psutil
import torch

logger = logging.getLogger("dfllm")

CPU_MEMORY_FRACTION = 0.25


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of keys plus values that one block holds across all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def cpu_kv_budget(max_tokens_needed_bytes: int) -> int:
    """On CPU: a quarter of the available RAM, but no more than the engine can ever use."""
    return min(int(psutil.virtual_memory().available * CPU_MEMORY_FRACTION), max_tokens_needed_bytes)


def cuda_kv_budget(device: torch.device, gpu_memory_utilization: float) -> int:
    """On CUDA: ``gpu_memory_utilization`` of the card, less what is used and the peak activations."""
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
    used = total - free
    return int(total * gpu_memory_utilization - used - (peak - current))


def allocate(num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
             dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One tensor ``[2, layers, blocks, block_size, kv_heads, head_dim]`` for all keys and values."""
    return torch.empty(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
