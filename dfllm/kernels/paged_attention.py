"""Attention over the paged KV cache for a batch mixing prefill chunks and decodes.

The PyTorch implementation below is the reference and the CPU path. Decodes are batched in
groups of similar context length: their keys are gathered block by block from the cache
into a padded tensor (the gather is the cost on CPU, so groups keep padding small) and the
query heads of each KV-head group attend together. Prefill spans run one at a time, causally,
over their cached prefix and their own new tokens.

Two options a layer may ask for (both off by default, and then nothing changes):

* a sliding window ``W``: a query at position ``p`` sees only the keys at positions
  ``p - W < j <= p`` (transformers' ``sliding_window_overlay``, vLLM's ``window_left = W - 1``);
* logit soft-capping ``c``: the scaled scores become ``c * tanh(scores / c)`` before the
  softmax (Gemma 2). SDPA cannot do it, so those layers attend in plain PyTorch (fp32 softmax).

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
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention output ``[T, heads, head_dim]`` for queries ``q`` ``[T, heads, head_dim]``.

    ``k``/``v`` are the step's new keys and values ``[T, kv_heads, head_dim]``, already
    written into ``k_cache``/``v_cache`` ``[num_blocks, block_size, kv_heads, head_dim]``.
    ``sliding_window`` (else ``meta.sliding_window``) limits each query to the keys of its
    window; ``softcap`` caps the scaled scores with ``softcap * tanh(scores / softcap)``.
    """
    window = sliding_window if sliding_window is not None else meta.sliding_window
    out = torch.empty_like(q)
    for group in meta.decode_groups:
        out[group.rows] = _decode(q[group.rows], k_cache, v_cache, group, scale, window, softcap)
    attend_prefills(out, q, k, v, k_cache, v_cache, meta, scale, window, softcap)
    return out


def attend_prefills(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> None:
    """Write the attention of each prefill span of ``meta`` into its rows of ``out``."""
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        out[rows] = _prefill(
            q[rows], k[rows], v[rows], k_cache, v_cache, span.ctx_len, span.kv_slots, scale, window, softcap
        )


def _decode(
    q, k_cache, v_cache, group: DecodeGroup, scale: float, window: int | None, softcap: float | None
) -> torch.Tensor:
    batch, heads, dim = q.shape
    kv_heads, bs = k_cache.shape[2], k_cache.shape[1]
    tables, mask = group.block_tables, group.mask
    if window is not None:
        tables, mask = _window_blocks(tables, mask, bs, window)
    keys = gather_seen(k_cache, tables, mask).transpose(1, 2)
    values = gather_seen(v_cache, tables, mask).transpose(1, 2)
    q = q.view(batch, kv_heads, heads // kv_heads, dim)
    o = _attend(q, keys.to(q.dtype), values.to(q.dtype), mask[:, None, None, :], scale, softcap)
    return o.reshape(batch, heads, dim)


def gather_seen(cache: torch.Tensor, tables: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The blocks ``tables`` ``[batch, width]`` of ``cache`` ``[blocks, block_size, ...]`` laid
    end to end, ``[batch, width * block_size, ...]``, with zeros in the slots ``mask`` hides.

    A hidden slot gets a zero attention weight, but ``0 * NaN`` is NaN: it may hold anything
    (never-written memory, or a block's previous owner's keys, NaN if its model output went
    non-finite), so it is not read as it is. The engine does not clear blocks it hands out."""
    batch, width = tables.shape
    rows = cache.index_select(0, tables.flatten()).view(batch, width * cache.shape[1], *cache.shape[2:])
    seen = mask.view(batch, -1, *([1] * (cache.dim() - 2)))
    return torch.where(seen, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def _window_blocks(tables: torch.Tensor, mask: torch.Tensor, bs: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Only the blocks holding each decode's window (the query sits at position ``len - 1`` and
    sees ``len - window <= j < len``), and the mask of the keys seen there: the gather reads
    no block before the window (such blocks may have been freed)."""
    width = tables.shape[1]
    lens = mask.sum(1, keepdim=True)
    span = min(width, (window - 1) // bs + 2)  # blocks a window of keys can straddle
    cols = ((lens - window).clamp_min(0) // bs) + torch.arange(span, device=tables.device)
    pos = (cols.unsqueeze(-1) * bs + torch.arange(bs, device=tables.device)).flatten(1)
    seen = (pos < lens) & (pos >= lens - window)  # columns past the table hold positions >= len
    return tables.gather(1, cols.clamp_max(width - 1)), seen


def _prefill(
    q, k, v, k_cache, v_cache, ctx_len: int, kv_slots, scale: float, window: int | None, softcap: float | None
) -> torch.Tensor:
    q_len = q.shape[0]
    if k_cache.dtype != k.dtype:  # kv_cache_dtype: the new keys as the cache holds them, as a cached prefix is
        k, v = k.to(k_cache.dtype).to(q.dtype), v.to(v_cache.dtype).to(q.dtype)
    if kv_slots is None and window is None and softcap is None:
        keys, values, mask, causal = k, v, None, True
    else:
        # keys from the window of the first query on (none before it is read: it may be freed)
        start = 0 if window is None or kv_slots is None else max(0, ctx_len - q_len - window + 1)
        if kv_slots is None:
            keys, values = k, v
        else:
            keys = k_cache.view(-1, *k_cache.shape[2:])[kv_slots[start:]].to(q.dtype)
            values = v_cache.view(-1, *v_cache.shape[2:])[kv_slots[start:]].to(q.dtype)
        rows = torch.arange(q_len).unsqueeze(1) + (ctx_len - q_len)
        cols = torch.arange(start, ctx_len).unsqueeze(0)
        mask, causal = cols <= rows, False
        if window is not None:
            mask = mask & (cols > rows - window)
        mask = mask.to(q.device)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, keys, values))
    if softcap is not None:
        assert mask is not None  # set above whenever there is a cap
        group = q.shape[1] // keys.shape[1]
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
        o = _attend(qh, kh, vh, mask, scale, softcap)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """``softmax(cap(q k^T * scale) masked) v`` (``mask`` True where a key is seen); without a
    cap it is SDPA's, with one it is computed in fp32 (as transformers' eager attention)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
