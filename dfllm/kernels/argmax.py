"""Greedy choice over rows of logits, and the id that marks a row with no finite maximum.

The PyTorch reference of :func:`dfllm.kernels.backend.argmax_rows`; the compiled CPU kernel
(``argmax_rows`` in ``csrc/cpu_ops.cpp``) gives the same ids, and the same
:data:`NON_FINITE_ID` for the same rows.
"""

from __future__ import annotations

import torch

# the id given to a row whose maximum is not finite (a NaN, a +inf, or no finite value): its
# logits cannot be sampled (the sampler's check; the C++ kernel writes the same -1)
NON_FINITE_ID = -1


def code_non_finite(ids: torch.Tensor, maxima: torch.Tensor) -> torch.Tensor:
    """``ids`` (``[rows]``) with :data:`NON_FINITE_ID` where ``maxima`` (each row's logit
    maximum, ``[rows]``) is not finite."""
    return torch.where(torch.isfinite(maxima), ids, NON_FINITE_ID)


def argmax_rows_torch(x: torch.Tensor, code: bool = False) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D ``x``; with ``code``, :data:`NON_FINITE_ID` for a row whose
    ``amax`` is not finite."""
    ids = x.argmax(dim=-1)
    return code_non_finite(ids, x.amax(dim=-1)) if code else ids
