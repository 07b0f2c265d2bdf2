"""Attention over the paged KV cache for a batch mixing prefill chunks and decodes.

The PyTorch implementation below is the reference and the CPU path. Decodes are batched in
groups of similar context length: their keys are gathered block by block from the cache
into a padded tensor (the gather is the cost on CPU, so groups keep padding small) and the
query heads of each KV-head group attend together. Prefill spans run one at a time, causally,
over their cached prefix and their own new tokens.
The Triton twin, one launch for the whole mixed batch, is in ``_triton_paged_attention.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dfllm.kernels.metadata import AttentionMetadata, DecodeGroup


def paged_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention output ``[T, heads, head_dim]`` for queries ``q`` ``[T, heads, head_dim]``.

    ``k``/``v`` are the step's new keys and values ``[T, kv_heads, head_dim]``, already
    written into ``k_cache``/``v_cache`` ``[num_blocks, block_size, kv_heads, head_dim]``.
    """
    out = torch.empty_like(q)
    for group in meta.decode_groups:
        out[group.rows] = _decode(q[group.rows], k_cache, v_cache, group, scale)
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, span.ctx_len, span.kv_slots, scale)
    return out


def _decode(q, k_cache, v_cache, group: DecodeGroup, scale: float) -> torch.Tensor:
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    tables = group.block_tables.flatten()
    length = group.block_tables.shape[1] * k_cache.shape[1]
    keys = k_cache.index_select(0, tables).view(batch, length, kv_heads, dim).transpose(1, 2)
    values = v_cache.index_select(0, tables).view(batch, length, kv_heads, dim).transpose(1, 2)
    q = q.view(batch, kv_heads, heads // kv_heads, dim)
    mask = group.mask[:, None, None, :]
    o = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale)
    return o.reshape(batch, heads, dim)


def _prefill(q, k, v, k_cache, v_cache, ctx_len: int, kv_slots, scale: float) -> torch.Tensor:
    q_len = q.shape[0]
    if kv_slots is None:
        keys, values, mask, causal = k, v, None, True
    else:
        keys = k_cache.view(-1, *k_cache.shape[2:])[kv_slots].to(q.dtype)
        values = v_cache.view(-1, *v_cache.shape[2:])[kv_slots].to(q.dtype)
        rows = torch.arange(q_len).unsqueeze(1) + (ctx_len - q_len)
        mask, causal = torch.arange(ctx_len).unsqueeze(0) <= rows, False
        mask = mask.to(q.device)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(0).transpose(0, 1)
