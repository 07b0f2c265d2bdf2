"""Qwen3 decoder: Llama's layout with a per-head RMSNorm of the queries and keys.

Qwen3 differs from Qwen2 in two ways: the q/k/v projections carry no bias unless
``attention_bias`` says so, and ``q_norm``/``k_norm`` (one weight of size ``head_dim``)
normalise each head of the queries and keys before the rotary embedding. Its ``head_dim``
comes from the config and may differ from ``hidden_size / num_attention_heads``.
"""

from __future__ import annotations

from dfllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: ``attention_bias`` on q/k/v and o (off by default) and q/k norms."""

    qk_norm = True
