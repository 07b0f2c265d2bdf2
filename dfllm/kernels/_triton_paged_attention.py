"""Paged attention for mixed prefill/decode batches: the Triton twin of :mod:`dfllm.kernels.paged_attention`.

One kernel, in the style of vLLM's unified attention, serves the whole ragged batch:

* the grid is (query blocks, KV heads, segments). A query block holds ``BLOCK_Q`` consecutive
  query tokens of one sequence; its rows are ``BLOCK_Q x group`` (token, query head) pairs, so
  the query heads that share a KV head are packed into the M dimension of one ``tl.dot``
  (``BLOCK_M = max(16, next_pow2(group))``, any GQA ratio);
* a program finds its sequence by binary search over ``query_start_loc``: sequence ``i`` owns
  the query blocks from ``query_start_loc[i] // BLOCK_Q + i``, which bounds the grid by
  ``T // BLOCK_Q + B`` without a host sync;
* keys and values are read from the paged cache ``[num_blocks, block_size, kv_heads, head_dim]``
  through the block table, one block id per key, so the tile size is independent of the block
  size; a query at position ``i`` of a chunk of ``q_len`` new tokens sits at absolute position
  ``seq_len - q_len + i`` and sees the keys up to it (causal over the new tokens, everything over
  the cached prefix); tiles past the causal limit are never visited;
* fp32 online softmax (``exp2`` with the scale folded into ``log2 e``), masked loads, head dim
  padded to a power of two;
* optional per-layer features, compiled in only when asked for (``USE_WINDOW``, ``USE_SOFTCAP``):
  a sliding window (a query at position ``p`` sees keys ``p - window < j <= p``; tiles wholly
  before the window of a query block's first query are never visited, nor their blocks read)
  and logit soft-capping (``softcap * tanh(scores / softcap)`` before the softmax).

Flash decoding: when the batch is small (few tokens, so that query blocks x KV heads would leave
most of the GPU idle), the same kernel runs with ``NUM_SEGMENTS > 1``: each program covers one
segment of the KV tiles and writes its unnormalised partial output with its running max and sum
(together the log-sum-exp); a second kernel merges the segments of each (token, head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dfllm.kernels.metadata import AttentionMetadata

LOG2E = 1.4426950408889634
MAX_SEGMENTS = 16
SPLIT_MAX_TOKENS = 256  # flash decoding only for batches of at most this many tokens


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global query block ``q_block_idx`` (binary search)."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _tanh(x):
    """tanh from ``exp2`` (no overflow: ``e = exp(-2|x|)`` is at most 1)."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    seg_out_ptr,
    seg_max_ptr,
    seg_sum_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    qk_scale,
    scale,
    softcap,
    window,
    num_seqs,
    num_heads,
    head_dim,
    block_size,
    table_width,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block_idx - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_pos = local_block * BLOCK_Q + offs_m // GROUP  # position within the new tokens
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_pos < q_len)
    d_ok = offs_d < head_dim
    token = (q_start + q_pos).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)

    # Keys this query block may see: up to the absolute position of its last query.
    last_q = tl.minimum((local_block + 1) * BLOCK_Q, q_len) - 1
    num_tiles = tl.cdiv(context_len + last_q + 1, TILE_N)
    # ... and from the first key in the window of its first query
    first_key = 0
    if USE_WINDOW:
        first_key = tl.maximum(context_len + local_block * BLOCK_Q - window + 1, 0)
    first_tile = first_key // TILE_N
    tiles_per_segment = tl.cdiv(num_tiles - first_tile, NUM_SEGMENTS)
    tile_lo = first_tile + segment * tiles_per_segment
    tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE_N + tl.arange(0, TILE_N)
        col = offs_n // block_size
        key_ok = (offs_n < seq_len) & (col < table_width)
        if USE_WINDOW:
            key_ok = key_ok & (offs_n >= first_key)  # blocks before the window may be released
        blk = tl.load(table + col, mask=key_ok, other=0).to(tl.int64)
        slot_off = offs_n % block_size
        k_off = blk * stride_kb + slot_off * stride_ks + kv_head * stride_kh
        v_off = blk * stride_vb + slot_off * stride_vs + kv_head * stride_vh
        kv_mask = key_ok[None, :] & d_ok[:, None]
        k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if FP32_DOT:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        visible = key_ok[None, :] & (offs_n[None, :] <= context_len + q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > context_len + q_pos[:, None] - window)
        if USE_SOFTCAP:
            s = _tanh(s * (scale / softcap)) * (softcap * 1.4426950408889634)
        else:
            s = s * qk_scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    if NUM_SEGMENTS == 1:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        stat = (token * num_heads + head) * NUM_SEGMENTS + segment
        tl.store(seg_max_ptr + stat, m_i, mask=row_ok)
        tl.store(seg_sum_ptr + stat, l_i, mask=row_ok)
        tl.store(seg_out_ptr + stat[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_segments_kernel(
    out_ptr,
    seg_out_ptr,
    seg_max_ptr,
    seg_sum_ptr,
    num_heads,
    head_dim,
    stride_ot,
    stride_oh,
    HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_PAD)
    stat = (token * num_heads + head) * NUM_SEGMENTS + offs_s
    seg_max = tl.load(seg_max_ptr + stat)
    seg_sum = tl.load(seg_sum_ptr + stat)
    top = tl.max(seg_max, axis=0)
    weight = tl.where(seg_max > float("-inf"), tl.exp2(seg_max - top), 0.0)
    total = tl.sum(seg_sum * weight, axis=0)
    parts = tl.load(seg_out_ptr + stat[:, None] * HEAD_PAD + offs_d[None, :])
    out = tl.sum(parts * weight[:, None], axis=0) / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < head_dim,
    )


def paged_attention_triton(
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
    """Triton :func:`~dfllm.kernels.paged_attention.paged_attention_torch` (one launch per step).

    Keys and values are read from the cache (the new ones were written there first), so ``k``
    and ``v`` are not used; the ragged fields of ``meta`` describe the batch.
    """
    return paged_attention_launch(q, k_cache, v_cache, meta, scale, sliding_window=sliding_window, softcap=softcap)


def paged_attention_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_segments: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Run the attention kernel; ``num_segments`` forces the KV split (1 = no flash decoding).

    ``sliding_window`` (else ``meta.sliding_window``) and ``softcap`` as in the reference."""
    window = sliding_window if sliding_window is not None else meta.sliding_window
    tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = meta.seq_lens.shape[0]
    if tokens == 0 or num_seqs == 0:
        return out
    block_m, block_q, q_blocks, auto_segments = launch_plan(q, kv_heads, meta, window)
    num_segments = auto_segments if num_segments is None else num_segments
    if num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two, got {num_segments}")
    head_pad = max(16, triton.next_power_of_2(head_dim))
    tile_n = 16 if num_segments > 1 and q.is_cuda else 32
    fp32_dot = q.dtype == torch.float32 or not q.is_cuda  # the interpreter computes in fp32
    if num_segments > 1:
        seg_out = torch.empty(tokens, num_heads, num_segments, head_pad, dtype=torch.float32, device=q.device)
        seg_max = torch.empty(tokens, num_heads, num_segments, dtype=torch.float32, device=q.device)
        seg_sum = torch.empty_like(seg_max)
    else:
        seg_out = seg_max = seg_sum = out
    tables = meta.block_tables
    _paged_attention_kernel[(q_blocks, kv_heads, num_segments)](
        out,
        seg_out,
        seg_max,
        seg_sum,
        q,
        k_cache,
        v_cache,
        tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale * LOG2E,
        scale,
        softcap or 1.0,
        window or 0,
        num_seqs,
        num_heads,
        head_dim,
        k_cache.shape[1],
        tables.shape[1],
        *q.stride()[:2],
        *out.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        tables.stride(0),
        GROUP=num_heads // kv_heads,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        HEAD_PAD=head_pad,
        TILE_N=tile_n,
        NUM_SEGMENTS=num_segments,
        FP32_DOT=fp32_dot,
        USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None,
        num_warps=8 if block_m >= 64 and head_pad >= 128 else 4,
        num_stages=2,
    )
    if num_segments > 1:
        _merge_segments_kernel[(tokens, num_heads)](
            out,
            seg_out,
            seg_max,
            seg_sum,
            num_heads,
            head_dim,
            out.stride(0),
            out.stride(1),
            HEAD_PAD=head_pad,
            NUM_SEGMENTS=num_segments,
        )
    return out


def launch_plan(
    q: torch.Tensor, kv_heads: int, meta: AttentionMetadata, window: int | None = None
) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_Q, query blocks, KV segments)`` for a batch of queries ``q`` (a sliding
    ``window`` bounds the keys a query block visits, hence how far they are worth splitting)."""
    tokens, num_heads = q.shape[0], q.shape[1]
    group = num_heads // kv_heads
    max_query_len, max_seq_len = _host_maxima(meta)
    block_m = max(16, triton.next_power_of_2(group))
    if max_query_len > 16:
        block_m = max(block_m, 64)  # bigger query tiles for prefill chunks
    block_q = block_m // group
    if window is not None:
        max_seq_len = min(max_seq_len, window + block_q)
    q_blocks = tokens // block_q + meta.seq_lens.shape[0]
    return block_m, block_q, q_blocks, _num_segments(q.device, tokens, q_blocks * kv_heads, max_seq_len)


def _host_maxima(meta: AttentionMetadata) -> tuple[int, int]:
    """Longest query chunk and longest sequence of the step (host values, synced only if missing)."""
    max_query_len = meta.max_query_len or int((meta.query_start_loc[1:] - meta.query_start_loc[:-1]).max())
    max_seq_len = meta.max_seq_len or int(meta.seq_lens.max())
    return max_query_len, max_seq_len


def _num_segments(device: torch.device, tokens: int, programs: int, max_seq_len: int) -> int:
    """How many KV segments per query block: enough programs to fill the device, a power of two."""
    if tokens > SPLIT_MAX_TOKENS:
        return 1
    target = 2 * _sm_count(device)
    min_keys_per_segment = 256 if device.type == "cuda" else 32
    want = min(MAX_SEGMENTS, -(-target // programs), -(-max_seq_len // min_keys_per_segment))
    if want <= 1:
        return 1
    return min(MAX_SEGMENTS, triton.next_power_of_2(want))


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a small stand-in for the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
