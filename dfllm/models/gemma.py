"""Gemma 2 and Gemma 3 text decoders (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``).

What sets them apart from the Llama family (:mod:`dfllm.models.llama`):

* Gemma's RMSNorm scales by ``1 + weight`` and multiplies in float32 before casting back;
* the token embeddings are multiplied by ``sqrt(hidden_size)`` (cast to the model's dtype);
* every layer norms the attention and MLP outputs too (``post_attention_layernorm``,
  ``post_feedforward_layernorm``) before adding them to the residual stream;
* the MLP is GeGLU (``gelu_pytorch_tanh``);
* queries are scaled by ``query_pre_attn_scalar ** -0.5`` rather than ``head_dim ** -0.5``;
* layers alternate between sliding-window and global attention (``layer_types``); Gemma 2
  soft-caps the attention scores and the final logits (``softcap * tanh(x / softcap)``);
* Gemma 3 norms each head's queries and keys (``q_norm``/``k_norm``) and gives its sliding
  layers their own rotary base (``rope_parameters["sliding_attention"]``, the old
  ``rope_local_base_freq``) while the global layers use ``rope_parameters["full_attention"]``
  (with its scaling, e.g. linear).

The word embeddings are tied to the LM head. The module tree keeps Hugging Face's names, with
q/k/v and gate/up fused as in the Llama family. Under pipeline parallelism a stage that is not
the last hands on ``(hidden, hidden)``: Gemma keeps no separate residual between layers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dfllm.distributed.communication import GroupComm
from dfllm.distributed.parallel_state import ParallelContext, layer_range
from dfllm.kernels.backend import KernelOps
from dfllm.kernels.metadata import AttentionMetadata
from dfllm.models.layers import PagedAttention, RotaryEmbedding
from dfllm.models.llama import LlamaForCausalLM
from dfllm.models.parallel_layers import column_linear, lm_head, row_linear, vocab_embedding
from dfllm.models.rope import rope_inv_freq
from dfllm.models.sliding_window import layer_windows
from dfllm.models.spec import ModelSpec

ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu": "none"}


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * (1 + weight)`` computed in float32, then cast to ``x``'s dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm (its weight is stored as an offset from 1)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps)


class GemmaMLP(nn.Module):
    """GeGLU: ``down(gelu(gate(x)) * up(x))``, gate and up fused into one matmul."""

    def __init__(self, spec: ModelSpec, tp: GroupComm | None):
        super().__init__()
        act = spec.hidden_activation or spec.hidden_act or "gelu_pytorch_tanh"
        if act not in ACTIVATIONS:
            raise NotImplementedError(
                f"Gemma hidden_activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
            )
        self.approximate = ACTIVATIONS[act]
        self.gate_up_proj = column_linear(spec.hidden_size, [spec.intermediate_size] * 2, False, tp)
        self.down_proj = row_linear(spec.intermediate_size, spec.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class GemmaAttention(PagedAttention):
    """:class:`PagedAttention` with Gemma's options: its query scale (``query_pre_attn_scalar``),
    this layer's sliding window (None on global layers), score soft-capping and, for Gemma 3,
    per-head q/k norms (Gemma's ``1 + w`` RMSNorm)."""

    def __init__(self, spec: ModelSpec, window: int | None, qk_norm: bool, ops: KernelOps, tp: GroupComm | None = None):
        head_dim = spec.head_dim
        super().__init__(
            spec.hidden_size,
            spec.num_attention_heads,
            spec.num_key_value_heads,
            head_dim,
            spec.attention_bias,
            spec.attention_bias,
            ops,
            tp,
        )
        self.scale = float(spec.query_pre_attn_scalar or head_dim) ** -0.5
        self.sliding_window = window
        self.softcap = spec.attn_logit_softcapping
        if qk_norm:
            self.q_norm = GemmaRMSNorm(head_dim, spec.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(head_dim, spec.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    """Norm, attention, norm, add; norm, MLP, norm, add (the "sandwich" of Gemma 2/3)."""

    def __init__(self, spec: ModelSpec, index: int, qk_norm: bool, ops: KernelOps, tp: GroupComm | None = None):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        window = layer_windows(spec)[index]
        self.rope = "sliding_attention" if window is not None else "full_attention"
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttention(spec, window, qk_norm, ops, tp)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GemmaMLP(spec, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos_sin: tuple, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos_sin, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def rope_tables(spec: ModelSpec, max_positions: int) -> dict[str, RotaryEmbedding]:
    """The rotary tables of each attention kind: Gemma 3 keys its rope parameters by layer
    type (``full_attention``/``sliding_attention``); Gemma 2 has one set for both."""
    params = spec.rope_parameters
    tables = {}
    for kind in ("full_attention", "sliding_attention"):
        own = params.get(kind)
        if isinstance(own, dict):
            own = dict(own)
            own.setdefault("rope_theta", params.get("rope_theta", 10000.0))
            own["rope_type"] = own.get("rope_type", own.get("type", "default"))
            kind_spec = replace(spec, rope_parameters=own)
        else:
            kind_spec = spec
        inv_freq, scaling = rope_inv_freq(kind_spec, max_positions)
        tables[kind] = RotaryEmbedding(inv_freq, scaling, max_positions)
    return tables


class GemmaModel(nn.Module):
    """The Gemma decoder stack, or one pipeline stage of it (``stage_layers``)."""

    def __init__(
        self,
        spec: ModelSpec,
        qk_norm: bool,
        ops: KernelOps,
        max_positions: int,
        parallel: ParallelContext | None = None,
    ):
        super().__init__()
        tp = parallel.tp if parallel is not None else None
        n = spec.num_hidden_layers
        self.start, self.end = (0, n) if parallel is None else layer_range(n, parallel.pp_rank, parallel.pp_size)
        self.embed_tokens = vocab_embedding(spec.vocab_size, spec.hidden_size, tp) if self.start == 0 else None
        self.normalizer = spec.hidden_size**0.5
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(spec, i, qk_norm, ops, tp) if self.start <= i < self.end else nn.Identity()
            for i in range(n)
        )
        self.stage_layers = cast(list[GemmaDecoderLayer], list(self.layers)[self.start : self.end])
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps) if self.end == n else None
        self.rotary_emb = nn.ModuleDict(rope_tables(spec, max_positions))

    def forward(self, input_ids, positions, meta: AttentionMetadata, intermediate=None):
        if intermediate is None:
            assert self.embed_tokens is not None  # only a first stage runs without intermediate states
            x = self.embed_tokens(input_ids)
            x = x * torch.tensor(self.normalizer, dtype=x.dtype)
        else:
            x = intermediate[0]
        cos_sin = {kind: emb(positions) for kind, emb in self.rotary_emb.items()}
        for layer in self.stage_layers:
            x = layer(x, cos_sin[layer.rope], meta)
        if self.norm is None:
            return x, x
        return self.norm(x)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: sliding/global layers, soft-capped attention scores and final logits.

    It shares :class:`LlamaForCausalLM`'s interface (``forward``, ``compute_logits``, the
    checkpoint renaming of pipeline stages) but builds its own stack.
    """

    qk_norm = False
    window_support = "per_layer"  # each layer's own window goes to the kernel (GemmaAttention)
    supports_cuda_graphs = False  # soft-capped attention

    def __init__(self, spec: ModelSpec, ops: KernelOps, max_positions: int, parallel: ParallelContext | None = None):
        nn.Module.__init__(self)
        if spec.final_logit_softcapping is not None and spec.final_logit_softcapping <= 0:
            raise ValueError(f"final_logit_softcapping must be > 0, got {spec.final_logit_softcapping}")
        self.model = GemmaModel(spec, self.qk_norm, ops, max_positions, parallel)  # type: ignore[assignment]
        tp = parallel.tp if parallel is not None else None
        last = self.model.norm is not None
        self.lm_head = lm_head(spec.vocab_size, spec.hidden_size, tp) if last else None
        self.tie_word_embeddings = spec.tie_word_embeddings  # Gemma's checkpoints hold no lm_head
        if self.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.sliding_window = None  # windows are per layer (GemmaAttention), not for the whole step
        self.final_logit_softcapping = spec.final_logit_softcapping
        if parallel is not None and parallel.pp_size > 1:
            self.checkpoint_name = self._stage_checkpoint_name

    def forward(self, input_ids, positions, meta: AttentionMetadata, intermediate=None):
        return self.model(input_ids, positions, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits, soft-capped when the model says so (the sampler and the
        log-probabilities see the capped values, as transformers returns them)."""
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): Gemma 2's stack plus per-head q/k norms and per-layer-type rope."""

    qk_norm = True
