"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a compressed paged KV cache.

Every token is projected to a latent ``c_kv`` (``kv_lora_rank`` features, RMS-normed) and one
rope key ``k_pe`` (``qk_rope_head_dim`` features) shared by all heads. The paged cache keeps
only those: per layer ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``, no
values (see :meth:`MLAttention.kv_cache_layout`), instead of full per-head keys and values.
``kv_b_proj`` expands a latent into each head's key part ``k_nope`` (``qk_nope_head_dim``)
and value (``v_head_dim``).

The attention is computed in PyTorch (the reference and the only implementation: there is
no Triton MLA kernel; on CUDA the same code runs with PyTorch's own kernels):

- prefill spans *decompress*: their context's latents (the fresh ones, or those gathered
  from the cache by ``kv_slots`` when a prefix is cached) go through ``kv_b_proj`` into
  per-head keys ``[k_nope, k_pe]`` and values, and the queries attend causally over them;
- decode groups *absorb* ``kv_b_proj`` as vLLM's MLA does: each head's ``q_nope`` is
  mapped into latent space by that head's key block ``W_UK`` (``q_nope @ W_UK``), so the
  queries attend directly over the cached ``[c_kv, k_pe]`` rows, one key "head" shared by
  all query heads, with ``c_kv`` as the values; the latent output is mapped back per head
  by the value block ``W_UV``. Both give ``softmax(q_nope.k_nope + q_pe.k_pe) v``.

The rope part follows transformers: DeepSeek-V2 rotates interleaved pairs ``(x0, x1), (x2,
x3), ...`` (its complex-number form); DeepSeek-V3 does too unless ``rope_interleave`` is false,
when it rotates halves like Llama. V3 lays the interleaved result out as evens then odds;
dfllm keeps the pairs in place, which changes no dot product of queries with keys (both are
laid out alike, and the cache holds dfllm's own keys). The softmax scale is
``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under yarn scaling.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dfllm.kernels.backend import KernelOps
from dfllm.kernels.kv_cache import KVCacheLayout
from dfllm.kernels.metadata import AttentionMetadata, DecodeGroup
from dfllm.kernels.paged_attention import gather_seen
from dfllm.models.layers import RMSNorm
from dfllm.models.spec import ModelSpec

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm/kv_a_layernorm with the default eps


def mla_softmax_scale(spec: ModelSpec) -> float:
    """``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``mscale ** 2`` for scaled rope
    types that give ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5
    params = spec.rope_parameters
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params.get("rope_type", "default") != "default" and mscale_all_dim:
        factor = params["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[T, heads, rope_dim]`` with ``cos``/``sin`` ``[T, rope_dim / 2]``:
    interleaved pairs (DeepSeek) or halves (Llama), computed in float32."""
    dtype = x.dtype
    x = x.float()
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)


def write_latent_cache(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``latent`` ``[T, kv_lora_rank + rope_dim]`` at ``slot_mapping`` (-1 skipped) in
    ``cache`` ``[num_blocks, block_size, 1, kv_lora_rank + rope_dim]``."""
    flat = cache.view(-1, cache.shape[-1])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        latent, slot_mapping = latent[valid], slot_mapping[valid]
    flat.index_copy_(0, slot_mapping, latent.to(flat.dtype))


def mla_attention_torch(
    q: torch.Tensor,
    latent: torch.Tensor,
    cache: torch.Tensor,
    kv_b_weight: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    qk_nope_head_dim: int,
    v_head_dim: int,
) -> torch.Tensor:
    """Attention output ``[T, heads, v_head_dim]``.

    ``q`` ``[T, heads, qk_nope_head_dim + rope_dim]`` are the queries (rope applied);
    ``latent`` ``[T, kv_lora_rank + rope_dim]`` the step's new latents and rope keys, already
    written into ``cache``; ``kv_b_weight`` ``[heads * (qk_nope_head_dim + v_head_dim),
    kv_lora_rank]`` is ``kv_b_proj``'s weight.
    """
    heads = q.shape[1]
    rank = cache.shape[-1] - (q.shape[-1] - qk_nope_head_dim)
    w = kv_b_weight.view(heads, qk_nope_head_dim + v_head_dim, rank)
    w_uk, w_uv = w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]
    out = q.new_empty(q.shape[0], heads, v_head_dim)
    for group in meta.decode_groups:
        out[group.rows] = _decode_absorbed(q[group.rows], cache, w_uk, w_uv, group, scale)
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        if span.kv_slots is None:
            ctx = latent[rows]
        else:
            ctx = cache.view(-1, cache.shape[-1])[span.kv_slots].to(q.dtype)
        out[rows] = _prefill_decompressed(
            q[rows],
            ctx,
            kv_b_weight,
            rank,
            qk_nope_head_dim,
            v_head_dim,
            span.ctx_len,
            span.kv_slots is not None,
            scale,
        )
    return out


def _decode_absorbed(q, cache, w_uk, w_uv, group: DecodeGroup, scale: float) -> torch.Tensor:
    batch, heads, _ = q.shape
    rank = w_uk.shape[-1]
    nope = w_uk.shape[1]
    q_latent = torch.einsum("bhn,hnl->bhl", q[..., :nope], w_uk.to(q.dtype))
    query = torch.cat((q_latent, q[..., nope:]), dim=-1).unsqueeze(1)  # [batch, 1, heads, rank + rope]
    keys = gather_seen(cache, group.block_tables, group.mask).view(batch, 1, -1, cache.shape[-1]).to(q.dtype)
    mask = group.mask[:, None, None, :]
    o = F.scaled_dot_product_attention(query, keys, keys[..., :rank], attn_mask=mask, scale=scale)
    return torch.einsum("bhl,hvl->bhv", o.squeeze(1), w_uv.to(q.dtype))


def _prefill_decompressed(
    q, ctx, kv_b_weight, rank: int, nope: int, v_dim: int, ctx_len: int, cached: bool, scale: float
) -> torch.Tensor:
    q_len, heads, _ = q.shape
    kv = F.linear(ctx[:, :rank], kv_b_weight.to(q.dtype)).view(ctx.shape[0], heads, nope + v_dim)
    k_pe = ctx[:, None, rank:].expand(-1, heads, -1)
    keys = torch.cat((kv[..., :nope], k_pe), dim=-1)
    values = kv[..., nope:]
    if cached:
        rows = torch.arange(q_len).unsqueeze(1) + (ctx_len - q_len)
        mask, causal = (torch.arange(ctx_len).unsqueeze(0) <= rows).to(q.device), False
    else:
        mask, causal = None, True
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
    )
    return o.squeeze(0).transpose(0, 1)


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention, parameters named as in transformers.

    Queries come from ``q_proj``, or (``q_lora_rank`` set) from ``q_b_proj(q_a_layernorm(
    q_a_proj(x)))``; ``kv_a_proj_with_mqa`` gives the latent and the rope key. ``k_cache`` is
    this layer's ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]`` slice of the
    engine's cache, attached by the model runner (``v_cache`` stays None: MLA caches no values).
    """

    def __init__(self, spec: ModelSpec, ops: KernelOps):
        super().__init__()
        h, heads = spec.hidden_size, spec.num_attention_heads
        self.num_heads = heads
        self.nope, self.rope, self.v_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.rank = spec.kv_lora_rank
        qk_dim = self.nope + self.rope
        bias = spec.attention_bias
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if spec.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, spec.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, ops)
        self.kv_b_proj = nn.Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=bias)
        self.scale = mla_softmax_scale(spec)
        self.interleaved = spec.rope_interleave
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None  # always None (the runner attaches no values)

    @staticmethod
    def kv_cache_layout(spec: ModelSpec) -> KVCacheLayout:
        """One cached "head" per token: the latent and the rope key, no values."""
        return KVCacheLayout(heads=1, head_dim=spec.kv_lora_rank + spec.qk_rope_head_dim, values=False)

    def forward(self, x: torch.Tensor, cos_sin: tuple, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope + self.rope)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        cos, sin = cos_sin
        q = torch.cat((q[..., : self.nope], rotate(q[..., self.nope :], cos, sin, self.interleaved)), dim=-1)
        k_pe = rotate(k_pe.unsqueeze(1), cos, sin, self.interleaved).squeeze(1)
        latent = torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1)
        assert self.k_cache is not None, "the KV cache is not attached"
        write_latent_cache(latent, self.k_cache, meta.slot_mapping)
        o = mla_attention_torch(q, latent, self.k_cache, self.kv_b_proj.weight, meta, self.scale, self.nope, self.v_dim)
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))
