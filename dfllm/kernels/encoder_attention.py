"""Bidirectional attention over unpadded sequences, as encoders (BERT and its kin) run it.

The tokens of a batch's sequences lie back to back in ``qkv`` ``[tokens, 3 * hidden]`` (each
token's query, key and value side by side, as the fused projection writes them); sequence
``i`` holds rows ``cu_seqlens[i] .. cu_seqlens[i + 1]`` and each of its queries attends to
every key of its own sequence. :func:`encoder_attention_torch` is the reference: the
sequences padded into one batch and PyTorch's ``scaled_dot_product_attention`` with a key
mask; the compiled CPU twin is :func:`dfllm.kernels._cpu.encoder_attention_cpu`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def encoder_attention_torch(qkv: torch.Tensor, cu_seqlens: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[tokens, hidden]`` attention outputs of the unpadded ``qkv`` ``[tokens, 3 * hidden]``
    (``cu_seqlens`` int64 ``[sequences + 1]``), scaled by ``1 / sqrt(head_dim)``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    tokens, hidden = qkv.shape[0], qkv.shape[1] // 3
    if not lengths or tokens == 0:
        return qkv.new_empty(tokens, hidden)
    b, n = len(lengths), max(lengths)
    valid = torch.arange(n, device=qkv.device)[None, :] < torch.tensor(lengths, device=qkv.device)[:, None]
    padded = qkv.new_zeros(b, n, 3 * hidden)
    padded[valid] = qkv
    heads = padded.view(b, n, 3, num_heads, hidden // num_heads).permute(2, 0, 3, 1, 4)
    mask = None if min(lengths) == n else valid[:, None, None, :]
    out = F.scaled_dot_product_attention(heads[0], heads[1], heads[2], attn_mask=mask)
    return out.transpose(1, 2).reshape(b, n, hidden)[valid]
