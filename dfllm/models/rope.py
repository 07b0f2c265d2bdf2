"""Rotary frequencies from a Llama/Qwen2 config, including the scaled rope types."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(config: PretrainedConfig) -> dict:
    """The config's rope parameters as one dict (transformers v4 and v5 spellings)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` for the config; unsupported rope types raise."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq, float(scaling)
