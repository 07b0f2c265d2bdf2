"""bfloat16 linear layers on CPUs with AVX512-BF16: the PyTorch reference of dfllm's GEMM.

On a CPU with AVX512-BF16 and no AMX, dfllm multiplies a decoder's bfloat16 linear layers
(the LM head included) with its own GEMM (``csrc/cpu_ops.cpp``, ``bf16_gemm``) instead of
oneDNN's: the same ``vdpbf16ps`` products and float32 accumulation, the result rounded once to
bfloat16 (equal to oneDNN's on all but a few entries in ten thousand, one unit in the last place
apart), without oneDNN's per-call cost and with each weight's next panel prefetched while
the current one is multiplied, so that a decode step's GEMMs no longer stall on weights
streaming from memory. On an AVX512-BF16 EPYC (2 threads, SmolLM2's 30 layers, weights from
memory): 1 row 7.2 ms against oneDNN's 11.6, 64 rows 31.9 against 39.6, 512 rows 254 against
268. With AMX, oneDNN's tiles are faster, and dfllm keeps oneDNN there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bf16_linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` accumulated in float32 from bfloat16 operands, rounded once to
    bfloat16: what the compiled GEMM computes, up to the order of its float32 additions."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
