"""The paged KV cache: what a layer caches per token, and writing keys and values into it (PyTorch reference).

The Triton twin, same signature and semantics, is in ``_triton_kv_cache.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheLayout:
    """What one layer caches per token: ``heads`` x ``head_dim`` keys and, when ``values``, as
    many values, as a model class declares it (``kv_cache_layout(spec, tp_size)``): its KV heads
    and head size by default, one "head" of latent and rope key and no values for DeepSeek's
    latent attention."""

    heads: int
    head_dim: int
    values: bool = True

    @property
    def num_tensors(self) -> int:
        """How many cache tensors per layer: 2 (keys and values), or 1 (keys only)."""
        return 2 if self.values else 1


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
