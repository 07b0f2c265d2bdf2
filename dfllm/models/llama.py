"""Llama-family decoder (Llama 2/3, SmolLM/SmolLM2, Mistral-style) and Qwen2 (qkv bias).

The two architectures share one implementation: they differ in which projections carry a
bias. The module tree mirrors Hugging Face's names, except that the q/k/v projections and
the gate/up projections are fused into ``qkv_proj`` and ``gate_up_proj``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from dfllm.kernels.backend import KernelOps
from dfllm.kernels.metadata import AttentionMetadata
from dfllm.models.layers import GatedMLP, PagedAttention, RMSNorm, RotaryEmbedding
from dfllm.models.rope import rope_inv_freq


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool, ops: KernelOps):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, ops)
        self.self_attn = PagedAttention(
            h,
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim_of(config),
            qkv_bias,
            o_bias,
            ops,
        )
        self.post_attention_layernorm = RMSNorm(h, eps, ops)
        self.mlp = GatedMLP(h, config.intermediate_size, getattr(config, "mlp_bias", False), ops)

    def forward(self, x, residual, cos_sin, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool, ops: KernelOps, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, o_bias, ops) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        inv_freq, scaling = rope_inv_freq(config, head_dim_of(config))
        self.rotary_emb = RotaryEmbedding(inv_freq, scaling, max_positions)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb(positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos_sin, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Causal LM: ``forward`` gives hidden states, ``compute_logits`` the chosen rows' logits."""

    def __init__(self, config: PretrainedConfig, ops: KernelOps, max_positions: int):
        super().__init__()
        self.model = DecoderModel(config, *self.biases(config), ops, max_positions)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def biases(config: PretrainedConfig) -> tuple[bool, bool]:
        """``(qkv_bias, o_proj_bias)``: Llama puts ``attention_bias`` on all four."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: biases on the q, k and v projections only."""

    @staticmethod
    def biases(config: PretrainedConfig) -> tuple[bool, bool]:
        return True, False
