"""RMSNorm with the residual add fused in: the Triton twin of :mod:`dfllm.kernels.rms_norm`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    num_rows,
    hidden,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < hidden)
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
        tl.store(res_out_ptr + rows[:, None] * stride_res_out + cols[None, :], x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / hidden + eps)
    # the output rounded once (on the store), as the reference does
    h = h * inv_rms[:, None]
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], h * w[None, :], mask=mask)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~dfllm.kernels.rms_norm.rms_norm_torch`: same arguments, same results."""
    shape, hidden = x.shape, x.shape[-1]
    x2 = _rows(x)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    res2 = _rows(residual) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    block = triton.next_power_of_2(hidden)
    rows_per_program = max(1, min(16, 2048 // block))
    grid = (triton.cdiv(x2.shape[0], rows_per_program),)
    _rms_norm_kernel[grid](
        x2,
        res2,
        weight,
        out,
        res_out,
        x2.shape[0],
        hidden,
        x2.stride(0),
        res2.stride(0),
        out.stride(0),
        res_out.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        ROWS=rows_per_program,
        BLOCK=block,
    )
    out = out.view(shape)
    return out if residual is None else (out, res_out.view(shape))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, hidden]`` tensor whose last dimension is contiguous."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
