"""SiLU-and-multiply: the Triton twin of :mod:`dfllm.kernels.activation`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * stride_out + cols, silu * up, mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton :func:`~dfllm.kernels.activation.silu_and_mul_torch`: ``silu(gate) * up``."""
    width = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], width, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(width))
    grid = (x2.shape[0], triton.cdiv(width, block))
    if x2.shape[0]:
        _silu_and_mul_kernel[grid](x2, out, width, x2.stride(0), out.stride(0), BLOCK=block)
    return out.view(*x.shape[:-1], width)
