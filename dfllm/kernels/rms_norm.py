"""RMSNorm with an optional fused residual add (PyTorch reference).

The Triton twin, same signature and semantics, is in ``_triton_rms_norm.py``.
"""

from __future__ import annotations

import torch


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / rms(x)``; with ``residual``, normalise ``x + residual`` and return the sum too."""
    if residual is not None:
        x = x + residual
        residual = x
    orig_dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(orig_dtype)
    return out if residual is None else (out, residual)
