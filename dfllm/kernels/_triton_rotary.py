"""Rotary embedding (rotate-half layout) applied in place: the Triton twin of :mod:`dfllm.kernels.rotary`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, token, stride_t, stride_h, heads, c, s, half, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate all ``heads`` of one token in place by ``c``/``s`` ``[1, BLOCK_D]`` (fp32)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < half)
    ptr = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + half, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(ptr, (a * c - b * s).to(x1.dtype), mask=mask)
    tl.store(ptr + half, (b * c + a * s).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    q_heads,
    k_heads,
    half,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    c = tl.load(cos_ptr + token * stride_cos + offs_d, mask=offs_d < half, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + token * stride_sin + offs_d, mask=offs_d < half, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, q_heads, c, s, half, BLOCK_QH, BLOCK_D)
    _rotate_heads(k_ptr, token, stride_kt, stride_kh, k_heads, c, s, half, BLOCK_KH, BLOCK_D)


def rotary_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~dfllm.kernels.rotary.rotary_torch`, rotating ``q`` and ``k`` in place; returns them."""
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_triton needs the head dimension of q and k to be contiguous")
    tokens, half = q.shape[0], q.shape[-1] // 2
    cos, sin = _last_contiguous(cos), _last_contiguous(sin)
    if tokens:
        _rotary_kernel[(tokens,)](
            q,
            k,
            cos,
            sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            sin.stride(0),
            q.shape[1],
            k.shape[1],
            half,
            BLOCK_QH=triton.next_power_of_2(q.shape[1]),
            BLOCK_KH=triton.next_power_of_2(k.shape[1]),
            BLOCK_D=triton.next_power_of_2(half),
        )
    return q, k


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
