"""Float32 logits from an LM head held in a reduced precision (PyTorch reference and dispatch).

A bfloat16 LM head rounds every logit to 8 significant bits: at the magnitudes where a model's
leading candidates sit (10-30) that is a step of 0.06-0.125, enough to tie or swap the two
most likely tokens, and greedy decoding then parts from float32's at that step. vLLM's
bfloat16 logits carry the same rounding. dfllm's are float32 where they decide:

- on CUDA, the LM head's GEMM writes float32 (``torch.mm(..., out_dtype=torch.float32)``: the
  same bfloat16 operands and float32 accumulation, no rounding of the result);
- on a CPU (oneDNN's bfloat16 GEMM returns bfloat16), the rounded logits are widened and every
  entry that could be its row's maximum, those within :data:`MARGIN` of it, is recomputed as a
  float32 dot product of the same operands (a handful per row; the compiled kernel in
  ``csrc/cpu_ops.cpp`` does it in the pass that widens, :func:`exact_top_logits_torch` is the
  reference). Greedy choices and the leading log-probabilities are then those of float32
  logits; the tail keeps bfloat16 values.

``benchmarks/bench_fidelity.py`` measured it on the bundled SmolLM2: of 128 greedy chats, 26.6%
of bfloat16 rows fully equal to float32's before, 44.5% with float32 logits alone.
"""

from __future__ import annotations

import torch

# How far below its row's maximum a rounded logit may lie and still be the true maximum: each
# of the two values is off by at most half a unit in the last place (2^-8 relative for
# bfloat16, 2^-11 for float16), so twice the dtype's epsilon covers both with room to spare.
MARGIN = {torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps, torch.float16: 2 * torch.finfo(torch.float16).eps}


def exact_top_logits_torch(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` (``hidden @ weight.T`` in a reduced precision) as float32, the
    entries within :data:`MARGIN` of their row's maximum recomputed with float32 accumulation; a
    row without a finite maximum (NaN or infinite entries) is only widened."""
    out = logits.float()
    rel = MARGIN.get(logits.dtype)
    if rel is None or not out.numel():
        return out
    top = out.amax(-1, keepdim=True)
    finite = top.isfinite() & ~out.isnan().any(-1, keepdim=True)
    rows, cols = ((out >= top - rel * top.abs()) & finite).nonzero(as_tuple=True)
    out[rows, cols] = (hidden[rows].float() * weight[cols].float()).sum(-1)
    return out
