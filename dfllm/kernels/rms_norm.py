"""RMSNorm with an optional fused residual add (PyTorch reference).

The Triton twin, same signature and semantics, is in ``_triton_rms_norm.py``.
"""

from __future__ import annotations

import torch


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / rms(x)``; with ``residual``, normalise ``x + residual`` and return the sum too.

    The sum is rounded to the input's dtype (it is the next layer's residual); the output is
    computed in float32 and rounded once, as vLLM's kernels do (transformers rounds the
    normalised value first, then its product with the weight: in bfloat16 that second rounding
    made greedy tokens part from float32's sooner, ``benchmarks/bench_fidelity.py``).
    """
    if residual is not None:
        x = x + residual
        residual = x
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    h = x.float()
    out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(out_dtype)
    return out if residual is None else (out, residual)
