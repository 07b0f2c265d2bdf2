"""Building blocks of the decoder models: norm, rotary embedding, MLP and paged attention."""

from __future__ import annotations

import torch
from torch import nn

from dfllm.distributed.communication import GroupComm
from dfllm.kernels.backend import KernelOps
from dfllm.kernels.metadata import AttentionMetadata
from dfllm.models.parallel_layers import column_linear, row_linear


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for positions ``[0, max_positions)``.

    ``inv_freq`` and ``attention_scaling`` come from the model config, through transformers'
    own rope initialisers for the scaled variants (linear, llama3, yarn, longrope).
    Fewer frequencies than half the head dimension rotate only the head's first features
    (``partial_rotary_factor``).
    """

    cos: torch.Tensor  # buffers (registered in __init__)
    sin: torch.Tensor

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int):
        super().__init__()
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos.unsqueeze(1) * inv_freq.float().unsqueeze(0)
        self.register_buffer("cos", freqs.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_scaling, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


class GatedMLP(nn.Module):
    """SwiGLU MLP with the gate and up projections fused into one matmul.

    Under a tensor-parallel group ``tp`` each rank holds a slice of the intermediate columns.
    """

    def __init__(self, hidden: int, intermediate: int, bias: bool, ops: KernelOps, tp: GroupComm | None = None):
        super().__init__()
        self.gate_up_proj = column_linear(hidden, [intermediate, intermediate], bias, tp)
        self.down_proj = row_linear(intermediate, hidden, bias, tp)
        self.ops = ops

        # LoRA adapter slots (dfllm.lora.layers.attach_lora), applied when a step carries adapters
        self.gate_up_lora: nn.Module | None = None
        self.down_lora: nn.Module | None = None

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if lora is not None and self.gate_up_lora is not None:
            h = self.gate_up_lora(x, h, lora)
        a = self.ops.silu_and_mul(h)
        out = self.down_proj(a)
        if lora is not None and self.down_lora is not None:
            out = self.down_lora(a, out, lora)
        return out


class PagedAttention(nn.Module):
    """Grouped-query self-attention whose keys and values live in the paged KV cache.

    ``k_cache``/``v_cache`` are views of this layer's slice of the engine's KV tensor,
    attached by the model runner once the cache is allocated. Under a tensor-parallel group
    ``tp`` each rank holds ``1/tp.size`` of the query and key/value heads (and of the cache).
    ``qk_norm_eps`` (Qwen3) adds ``q_norm``/``k_norm``: an RMSNorm over each head's ``head_dim``
    features of the queries and keys, applied before the rotary embedding. ``sliding_window``
    and ``softcap`` (None here; set by families such as Gemma, per layer) go to the kernel; a
    window on every layer alike (Mistral) comes through the step's metadata instead.
    """

    sliding_window: int | None = None
    softcap: float | None = None

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        ops: KernelOps,
        tp: GroupComm | None = None,
        qk_norm_eps: float | None = None,
    ):
        super().__init__()
        full_q, full_kv = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = column_linear(hidden, [full_q, full_kv, full_kv], qkv_bias, tp)
        self.o_proj = row_linear(full_q, hidden, o_bias, tp)
        ranks = 1 if tp is None else tp.size
        num_heads, num_kv_heads = num_heads // ranks, num_kv_heads // ranks
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.ops = ops
        # Qwen3-style per-head RMSNorm of q and k before rotary (one weight of size head_dim,
        # shared by all heads, so every tensor-parallel rank holds all of it)
        self.q_norm: nn.Module | None = RMSNorm(head_dim, qk_norm_eps, ops) if qk_norm_eps is not None else None
        self.k_norm: nn.Module | None = RMSNorm(head_dim, qk_norm_eps, ops) if qk_norm_eps is not None else None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # LoRA adapter slots (dfllm.lora.layers.attach_lora), applied when a step carries adapters
        self.qkv_lora: nn.Module | None = None
        self.o_lora: nn.Module | None = None

    def forward(self, x: torch.Tensor, cos_sin: tuple, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if meta.lora is not None and self.qkv_lora is not None:
            qkv = self.qkv_lora(x, qkv, meta.lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rotary_dim = 2 * cos_sin[0].shape[-1]
        if rotary_dim < self.head_dim:  # partial rotary: the rest of each head passes through
            q_rot, k_rot = self.ops.rotary(q[..., :rotary_dim], k[..., :rotary_dim], *cos_sin)
            q = torch.cat((q_rot, q[..., rotary_dim:]), dim=-1)
            k = torch.cat((k_rot, k[..., rotary_dim:]), dim=-1)
        else:
            q, k = self.ops.rotary(q, k, *cos_sin)
        self.ops.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        o = self.ops.paged_attention(
            q,
            k,
            v,
            self.k_cache,
            self.v_cache,
            meta,
            self.scale,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
        )
        o = o.reshape(t, self.q_size)
        if meta.lora is not None and self.o_lora is not None:
            return self.o_lora(o, self.o_proj(o), meta.lora)
        return self.o_proj(o)
