"""Writing new keys and values into the paged KV cache (PyTorch reference).

The Triton twin, same signature and semantics, is in ``_triton_kv_cache.py``.
"""

from __future__ import annotations

import torch


def write_kv_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[T, kv_heads, head_dim]`` at ``slot_mapping`` (-1 skipped).

    The caches are ``[num_blocks, block_size, kv_heads, head_dim]``.
    """
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_flat.index_copy_(0, slot_mapping, key.to(k_flat.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_flat.dtype))
