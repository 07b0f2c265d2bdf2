"""DeepSeek-V2 and DeepSeek-V3 decoders: multi-head latent attention (``mla``) and SwiGLU MLPs.

Parameter names follow transformers' ``DeepseekV2ForCausalLM``/``DeepseekV3ForCausalLM``,
except that each MLP's gate and up projections are fused into ``gate_up_proj``. The KV cache
holds per token only the latent and the rope key (see :mod:`dfllm.models.mla`), which the
model declares to the runner through :meth:`DeepseekV2ForCausalLM.kv_cache_layout`.

Layers from ``first_k_dense_replace`` on are mixtures of experts (:class:`DeepseekMoE`):
``n_routed_experts`` routed experts (``moe_intermediate_size`` wide; run by the shared
``ops.fused_moe`` kernel through :class:`~dfllm.models.moe.FusedExperts`) plus one dense MLP of
``n_shared_experts * moe_intermediate_size`` (``shared_experts``) that every token goes through.
Routing as transformers does it: V2 takes the softmax of the router logits and picks the top
``num_experts_per_tok`` (``topk_method`` "greedy"), or first the best ``topk_group`` of
``n_group`` expert groups by their best expert ("group_limited_greedy"); V3 takes the sigmoid,
adds ``e_score_correction_bias`` for the choice only, ranks groups by their two best experts
and weighs by the unbiased scores. Both renormalise the top-k weights when ``norm_topk_prob``
(transformers' V2 ignores that flag, DeepSeek's own V2 code and vLLM apply it; DeepSeek-V2's
configs leave it false) and scale them by ``routed_scaling_factor``. The router is computed
in float32 from weights held in the model's dtype (transformers keeps them in float32).

One rank only: tensor and pipeline parallelism are refused (``dfllm.config``).
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dfllm.distributed.parallel_state import ParallelContext
from dfllm.kernels.backend import KernelOps
from dfllm.kernels.kv_cache import KVCacheLayout
from dfllm.kernels.metadata import AttentionMetadata
from dfllm.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from dfllm.models.llama import DecoderLayer, LlamaForCausalLM
from dfllm.models.mla import MLAttention
from dfllm.models.moe import FusedExperts, Read, expert_weight_destination
from dfllm.models.parallel_layers import lm_head, vocab_embedding
from dfllm.models.rope import rope_inv_freq
from dfllm.models.spec import ModelSpec

# checkpoint projection name -> (fused parameter name, shard index); q_proj stays as it is
PACKED_MLP = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class DeepseekRouter(nn.Module):
    """Top-k expert choice of DeepSeek-V2 (softmax; ``sigmoid=False``) or V3 (sigmoid with a
    score-correction bias): ``(weights, expert_ids)``, each ``(tokens, top_k)``, weights float32."""

    def __init__(self, spec: ModelSpec, sigmoid: bool):
        super().__init__()
        e = spec.num_experts
        self.weight = nn.Parameter(torch.zeros(e, spec.hidden_size))
        self.sigmoid = sigmoid
        # a parameter (not a buffer) so that the loader fills it from the checkpoint
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e), requires_grad=False) if sigmoid else None
        self.top_k, self.num_experts = spec.num_experts_per_tok, e
        self.method = "noaux_tc" if sigmoid else (spec.topk_method or "greedy")
        self.n_group, self.topk_group = spec.n_group or 1, spec.topk_group or 1
        self.renormalize, self.scale = spec.norm_topk_prob, spec.routed_scaling_factor
        if self.method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise NotImplementedError(
                f"topk_method {spec.topk_method!r} is not supported (DeepSeek-V2: 'greedy' or 'group_limited_greedy')"
            )
        if not 0 < self.top_k <= e or e % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(
                f"bad DeepSeek routing: num_experts_per_tok={self.top_k}, n_routed_experts={e}, "
                f"n_group={spec.n_group}, topk_group={spec.topk_group}"
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float()
        if self.method != "greedy":
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            if self.sigmoid:
                group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            else:
                group_scores = grouped.max(dim=-1).values
            best = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape(-1, self.num_experts)
            choice = choice.masked_fill(~keep, float("-inf") if self.sigmoid else 0.0)
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class DeepseekMoE(nn.Module):
    """Routed experts plus the always-on shared experts (one dense MLP)."""

    def __init__(self, spec: ModelSpec, ops: KernelOps, sigmoid: bool):
        super().__init__()
        h, width = spec.hidden_size, spec.moe_intermediate_size
        self.ops = ops
        self.gate = DeepseekRouter(spec, sigmoid)
        self.experts = FusedExperts(spec.num_experts, h, width)
        shared = width * spec.n_shared_experts
        self.shared_experts = GatedMLP(h, shared, spec.mlp_bias, ops) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.ops.fused_moe(x, self.experts.w13_weight, self.experts.w2_weight, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def deepseek_layer(spec: ModelSpec, index: int, ops: KernelOps, sigmoid_router: bool) -> DecoderLayer:
    """Decoder layer ``index``: latent attention, then a dense MLP for the first
    ``first_k_dense_replace`` layers and the routed and shared experts after them."""
    mlp: nn.Module
    if index >= spec.first_k_dense_replace:
        mlp = DeepseekMoE(spec, ops, sigmoid_router)
    else:
        mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, ops)
    return DecoderLayer(spec, False, False, ops, attn=MLAttention(spec, ops), mlp=mlp)


class DeepseekV2Model(nn.Module):
    """The decoder stack (one stage: ``stage_layers`` are all the layers)."""

    def __init__(self, spec: ModelSpec, ops: KernelOps, max_positions: int, sigmoid_router: bool):
        super().__init__()
        self.start, self.end = 0, spec.num_hidden_layers
        self.embed_tokens = vocab_embedding(spec.vocab_size, spec.hidden_size, None)
        self.layers = nn.ModuleList(deepseek_layer(spec, i, ops, sigmoid_router) for i in range(spec.num_hidden_layers))
        self.stage_layers = cast(list[DecoderLayer], list(self.layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)
        # the rotary tables cover the rope part of the heads only
        inv_freq, scaling = rope_inv_freq(dataclasses.replace(spec, head_dim=spec.qk_rope_head_dim))
        self.rotary_emb = RotaryEmbedding(inv_freq, scaling, max_positions)

    def forward(self, input_ids, positions, meta: AttentionMetadata):
        x, residual = self.embed_tokens(input_ids), None
        cos_sin = self.rotary_emb(positions)
        for layer in self.stage_layers:
            x, residual = layer(x, residual, cos_sin, meta)
        x, _ = self.norm(x, residual)
        return x


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 causal LM with multi-head latent attention and a compressed KV cache.

    It offers Llama's interface (``forward``, ``compute_logits``; hence the base class, which
    the registry and the runner expect) but builds and runs its own decoder:
    ``LlamaForCausalLM.__init__`` is deliberately not called, and no Llama method is inherited.
    """

    packed_modules_mapping = PACKED_MLP
    sigmoid_router = False  # V2 routes by softmax
    window_support = "none"
    supports_cuda_graphs = False  # latent attention

    def __init__(self, spec: ModelSpec, ops: KernelOps, max_positions: int, parallel: ParallelContext | None = None):
        nn.Module.__init__(self)
        check_supported(spec, parallel)
        model = DeepseekV2Model(spec, ops, max_positions, self.sigmoid_router)
        head = lm_head(spec.vocab_size, spec.hidden_size, None)
        self.tie_word_embeddings = spec.tie_word_embeddings
        if self.tie_word_embeddings:
            head.weight = model.embed_tokens.weight
        self.model = model  # type: ignore[assignment]  # the runner reads only stage_layers and rotary_emb
        self.lm_head = head

    @classmethod
    def kv_cache_layout(cls, spec: ModelSpec, tp_size: int = 1) -> KVCacheLayout:
        """Per token and layer: one row of ``kv_lora_rank + qk_rope_head_dim`` features (latent
        and rope key) and no values tensor (``tp_size`` is always 1: MLA runs on one rank)."""
        return MLAttention.kv_cache_layout(spec)

    def forward(self, input_ids, positions, meta: AttentionMetadata, intermediate=None):
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None
        return self.lm_head(hidden)

    def weight_destination(self, name: str, read: Read) -> tuple[str, torch.Tensor, torch.Tensor] | None:
        """The loader's hook for the routed experts' tensors (per expert or fused)."""
        return expert_weight_destination(self, name, read)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: the same attention (its rope layout set by ``rope_interleave``) and MoE
    layers routed by sigmoid scores with a score-correction bias."""

    sigmoid_router = True


def check_supported(spec: ModelSpec, parallel: ParallelContext | None) -> None:
    """Raise ``NotImplementedError`` for what this implementation does not cover (parallel
    ranks, activations other than SiLU) and ``ValueError`` for an inconsistent config."""
    if parallel is not None and (parallel.tp_size, parallel.pp_size) != (1, 1):
        raise NotImplementedError(
            "multi-head latent attention (DeepSeek-V2/V3) runs on one rank: "
            "tensor_parallel_size and pipeline_parallel_size must be 1"
        )
    if spec.first_k_dense_replace < spec.num_hidden_layers and not (spec.num_experts and spec.moe_intermediate_size):
        raise ValueError(
            f"DeepSeek MoE layers (from first_k_dense_replace={spec.first_k_dense_replace}) need "
            f"n_routed_experts ({spec.num_experts}) and moe_intermediate_size "
            f"({spec.moe_intermediate_size})"
        )
    if spec.hidden_act != "silu":
        raise NotImplementedError(f"hidden_act {spec.hidden_act!r} is not supported (DeepSeek MLPs use 'silu')")
    if spec.kv_lora_rank <= 0 or spec.qk_rope_head_dim <= 0 or spec.qk_rope_head_dim % 2:
        raise ValueError(
            f"kv_lora_rank ({spec.kv_lora_rank}) must be positive and qk_rope_head_dim "
            f"({spec.qk_rope_head_dim}) positive and even"
        )
