"""SiLU-and-multiply, the SwiGLU activation (PyTorch reference).

The Triton twin, same signature and semantics, is in ``_triton_activation.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = cat(gate, up)`` along the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
