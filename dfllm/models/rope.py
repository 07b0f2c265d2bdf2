"""Rotary frequencies of a Llama/Qwen2 model, including the scaled rope types."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dfllm.models.spec import ModelSpec

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_inv_freq(spec: ModelSpec, max_model_len: int | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of the model; unsupported rope types raise.

    Longrope (Phi-3 "su") has short and long factors: like vLLM, an engine whose
    ``max_model_len`` exceeds ``original_max_position_embeddings`` uses the long factors for
    every position (so cached keys never change factors), one within it the short factors."""
    params = spec.rope_parameters
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        # partial_rotary_factor (Phi-3/Phi-4-mini): only the first part of each head rotates
        dim = int(spec.head_dim * params.get("partial_rotary_factor", 1.0))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    extra = {}
    original = params.get("original_max_position_embeddings") or spec.max_position_embeddings
    if rope_type == "longrope" and max_model_len is not None and original and max_model_len > original:
        extra["seq_len"] = int(original) + 1  # past transformers' switch to the long factors
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](_init_config(spec), torch.device("cpu"), **extra)
    return inv_freq, float(scaling)


def _init_config(spec: ModelSpec) -> SimpleNamespace:
    """transformers' initialisers read a config: one holding just what they read (the rope
    parameters under their v5 and v4 names; the dict is already standardised)."""
    params = spec.rope_parameters
    return SimpleNamespace(
        rope_parameters=dict(params),
        rope_scaling=dict(params),
        rope_theta=params["rope_theta"],
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        standardize_rope_params=lambda: None,
    )
