"""Mixture-of-experts feed-forward: the Triton twin of :mod:`dfllm.kernels.fused_moe`.

In the spirit of vLLM's ``fused_moe``:

* the ``(token, slot)`` pairs of the routing are sorted by expert and each expert's run is
  padded to a multiple of ``BLOCK_M`` (:func:`align_by_expert`, plain tensor ops with no host
  sync), so every block of ``BLOCK_M`` sorted rows belongs to one expert;
* one grouped-GEMM launch computes every pair's ``gate_up`` projection (a block gathers its
  tokens' rows of ``x`` and multiplies them by its expert's ``w13``), SiLU-and-multiply
  follows, and a second launch computes the ``down`` projection, scaled by the routing
  weight of each pair;
* the ``top_k`` scaled rows of each token are summed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dfllm.kernels._triton_activation import silu_and_mul_triton


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weight_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_padded_ptr,
    N,
    K,
    num_pairs,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``c[p] = a[p // ROW_DIV] @ b[expert(p)].T`` (times ``weight[p]`` when ``MUL_WEIGHT``)
    for the pairs ``p`` of one block of sorted rows and one block of output columns."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs  # padding rows hold num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    a_rows = (pairs // ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_base = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + (k0 + offs_k)[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(b_base + (k0 + offs_k)[:, None] * stride_bk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_ids, block_expert, num_padded)``: the flat pair ids ``t * top_k + k`` sorted
    by expert, each expert's run padded with ``T * top_k`` to a multiple of ``block_m``; the
    expert of every block of ``block_m`` rows; and (a one-element tensor) how many rows are
    used. The buffers have a fixed upper-bound size, so no value is read back to the host."""
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    count_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    dest = padded_start[experts] + torch.arange(pairs, device=device) - count_start[experts]
    capacity = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, starts, right=True).clamp_max(num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, padded_end[-1:].to(torch.int32)


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out_rows: int,
    weights: torch.Tensor | None,
    row_div: int,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    block_m: int,
) -> torch.Tensor:
    """One launch: row ``p`` of the result is ``a[p // row_div] @ b[expert(p)].T`` (scaled)."""
    n, k = b.shape[1], b.shape[2]
    c = torch.empty(out_rows, n, dtype=a.dtype, device=a.device)
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    grid = (sorted_ids.numel() // block_m, triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        b,
        c,
        weights if weights is not None else c,
        sorted_ids,
        block_expert,
        num_padded,
        n,
        k,
        out_rows,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        ROW_DIV=row_div,
        MUL_WEIGHT=weights is not None,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return c


def fused_moe_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Triton :func:`~dfllm.kernels.fused_moe.fused_moe_torch`: two grouped-GEMM launches."""
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    pairs = tokens * top_k
    block_m = 16 if pairs <= 256 else 64
    routing = align_by_expert(topk_ids, w13.shape[0], block_m)
    gate_up = _grouped_gemm(x, w13, pairs, None, top_k, *routing, block_m)
    act = silu_and_mul_triton(gate_up)
    down = _grouped_gemm(act, w2, pairs, topk_weights.reshape(-1).float().contiguous(), 1, *routing, block_m)
    return down.view(tokens, top_k, -1).sum(dim=1)
