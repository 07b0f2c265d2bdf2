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

    It is left uninitialised (untouched pages cost nothing on CPU); each block is zeroed
    whenever it is handed out to a sequence (:func:`zero_blocks`), because masked-out slots
    are still multiplied by a zero attention weight and garbage there (uninitialised memory,
    or what a sequence whose output went NaN left behind) could be NaN.
    """
    return torch.empty(
        num_tensors, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )


def zero_blocks(kv: torch.Tensor, block_ids: list[int]) -> None:
    """Zero the given blocks in every layer, for keys and values (or keys only).

    On a CPU the blocks are filled as 16-byte elements (the cache viewed as ``complex128``,
    each block of a layer a row of them): the same bytes, all zero bits, as a fill with the
    cache's own zero, about three times as fast as a float32 ``index_fill_`` (which moves
    one 4-byte element at a time)."""
    if block_ids:
        ids = torch.tensor(block_ids)
        if kv.device.type == "cuda":  # from pinned memory, without waiting for the device
            ids = ids.pin_memory().to(kv.device, non_blocking=True)
        wide = _as_rows_of_16_bytes(kv) if kv.device.type == "cpu" else None
        if wide is not None:
            wide.index_fill_(1, ids, 0)
        else:
            kv.index_fill_(2, ids, 0)


def _as_rows_of_16_bytes(kv: torch.Tensor) -> torch.Tensor | None:
    """``kv`` (``[tensors, layers, blocks, ...]``, contiguous) viewed as ``[tensors * layers,
    blocks, n]`` ``complex128``, where its blocks' bytes allow it; None otherwise."""
    if kv.dim() < 3 or not kv.is_contiguous() or kv.numel() == 0:
        return None
    row_bytes = kv[0, 0, 0].numel() * kv.element_size()
    if row_bytes % 16 or (kv.storage_offset() * kv.element_size()) % 16 or kv.data_ptr() % 16:
        return None
    return kv.view(kv.shape[0] * kv.shape[1], kv.shape[2], -1).view(torch.complex128)
