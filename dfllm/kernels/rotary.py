"""Rotary position embedding, rotate-half (Llama/Qwen2) layout (PyTorch reference).

The Triton twin, same signature and semantics, is in ``_triton_rotary.py``.
"""

from __future__ import annotations

import torch


def rotary_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` ``[T, heads, d]`` and ``k`` ``[T, kv_heads, d]`` by ``cos``/``sin`` ``[T, d/2]``."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """In float32 with float32 cos/sin, rounded to ``x``'s dtype once (as vLLM's kernels)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
