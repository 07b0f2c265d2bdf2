"""Triton SGMV kernels for many LoRA adapters in one batch (the GPU twin of
:func:`dfllm.kernels.lora.lora_apply`), as Punica's SGMV: the adapted rows sorted by slot
(:class:`~dfllm.kernels.metadata.LoRAMetadata`), one program per (segment, block of its rows,
block of output features), each a tiled ``tl.dot`` over the input features.

``sgmv_shrink``: ``s[row] = x[row] @ a[slot].T`` (``[T, R]``, zeros for base rows);
``sgmv_expand``: ``y[row] += s[row] @ b[slot].T``. Tested against the reference in
Triton's interpreter (``TRITON_INTERPRET=1``) on CPU and on CUDA when present.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dfllm.kernels.metadata import LoRAMetadata


@triton.jit
def _sgmv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rows_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_slot_ptr,
    K,
    N,
    stride_xt,
    stride_ws,
    stride_wn,
    stride_yt,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    seg = tl.program_id(0)
    mb = tl.program_id(1)
    nb = tl.program_id(2)
    seg_len = tl.load(seg_len_ptr + seg)
    if mb * BLOCK_M >= seg_len:
        return
    start = tl.load(seg_start_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    rows = tl.load(rows_ptr + start + offs_m, mask=m_mask, other=0)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xs = tl.load(
            x_ptr + rows[:, None] * stride_xt + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )
        ws = tl.load(
            w_ptr + slot * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=n_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        acc += tl.dot(xs.to(tl.float32), ws.to(tl.float32))
    out = y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, meta: LoRAMetadata, accumulate: bool) -> None:
    x, w = x.contiguous(), w.contiguous()
    assert y.stride(-1) == 1
    n, k = w.shape[1], w.shape[2]
    block_m = 16
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    grid = (len(meta.seg_slots), triton.cdiv(meta.max_seg_len, block_m), triton.cdiv(n, block_n))
    _sgmv_kernel[grid](
        x,
        w,
        y,
        meta.sorted_rows,
        meta.seg_start,
        meta.seg_len,
        meta.seg_slot,
        k,
        n,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        y.stride(0),
        ACCUMULATE=accumulate,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def sgmv_shrink(x: torch.Tensor, a: torch.Tensor, meta: LoRAMetadata) -> torch.Tensor:
    """``[T, R]``: each adapted row's ``x @ a[slot].T`` (zeros for base rows)."""
    s = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    _launch(x, a, s, meta, accumulate=False)
    return s


def sgmv_expand(s: torch.Tensor, b: torch.Tensor, y: torch.Tensor, meta: LoRAMetadata) -> None:
    """``y[row] += s[row] @ b[slot].T`` for each adapted row, in place."""
    _launch(s, b, y, meta, accumulate=True)
