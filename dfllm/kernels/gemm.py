"""bfloat16 linear layers on CPUs with AVX512-BF16: the PyTorch reference of dfllm's GEMM.

On a CPU with AVX512-BF16 and no AMX, a decoder's bfloat16 linear layers (the LM head
included) multiply through dfllm's own GEMM (``bf16_gemm`` in ``csrc/cpu_ops.cpp``, chosen by
:func:`dfllm.models.cpu_linear.own_gemm_applies`) instead of oneDNN's: the same ``vdpbf16ps``
products and float32 accumulation, the result rounded once, without oneDNN's per-call cost and
with each weight's next panel prefetched while the current one multiplies. Why and how fast:
docs/engine.md; ``benchmarks/bench_gemm.py`` measures it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bf16_linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` accumulated in float32 from bfloat16 operands, rounded once to
    bfloat16: what the compiled GEMM computes, up to the order of its float32 additions."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
