"""Rotary frequencies of a Llama/Qwen2 model, including the scaled rope types."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dfllm.models.spec import ModelSpec

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_inv_freq(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of the model; unsupported rope types raise."""
    params = spec.rope_parameters
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    # transformers' initialisers read a config: they get one holding just what they read
    # (the rope parameters under their v5 and v4 names; the dict is already standardised)
    config = SimpleNamespace(
        rope_parameters=dict(params), rope_scaling=dict(params), rope_theta=params["rope_theta"],
        hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, standardize_rope_params=lambda: None,
    )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq, float(scaling)
