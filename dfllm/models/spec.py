"""One typed description of a checkpoint: what the model code reads from its ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig


@dataclass(frozen=True)
class ModelSpec:
    """Every field of a Hugging Face config that dfllm reads, with each default decided once
    (in :meth:`from_hf`). A size the config lacks is 0 (such a config is rejected as an
    unsupported architecture before any model is built).

    ``rope_parameters`` holds ``rope_theta`` and ``rope_type`` and, for scaled rope types,
    their parameters (transformers v4 ``rope_scaling`` and v5 ``rope_parameters`` alike).
    ``quantization`` is the ``quant_method`` of a quantized checkpoint ("?" when unnamed).
    """

    architectures: tuple[str, ...]
    dtype: torch.dtype  # the dtype the checkpoint was saved in
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int | None
    hidden_act: str | None
    # decoders
    rms_norm_eps: float
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    rope_parameters: dict
    sliding_window: int | None
    use_sliding_window: bool
    quantization: str | None
    # BERT encoders and classifiers
    type_vocab_size: int
    layer_norm_eps: float
    position_embedding_type: str | None
    num_labels: int
    id2label: dict[int, str]

    @classmethod
    def from_hf(cls, config: PretrainedConfig) -> ModelSpec:
        """The spec of a Hugging Face config (never raises for an unknown model family)."""
        heads = getattr(config, "num_attention_heads", 0)
        hidden = getattr(config, "hidden_size", 0)
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        window = getattr(config, "sliding_window", None)
        quantization = getattr(config, "quantization_config", None)
        return cls(
            architectures=tuple(getattr(config, "architectures", None) or ()),
            dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype,
            vocab_size=getattr(config, "vocab_size", 0),
            hidden_size=hidden,
            num_hidden_layers=getattr(config, "num_hidden_layers", 0),
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or (hidden // heads if heads else 0),
            intermediate_size=getattr(config, "intermediate_size", 0),
            max_position_embeddings=getattr(config, "max_position_embeddings", None),
            hidden_act=getattr(config, "hidden_act", None),
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
            attention_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            rope_parameters=rope,
            sliding_window=window,
            use_sliding_window=bool(getattr(config, "use_sliding_window", window is not None)),
            quantization=quantization.get("quant_method", "?") if quantization else None,
            type_vocab_size=getattr(config, "type_vocab_size", 2),
            layer_norm_eps=getattr(config, "layer_norm_eps", 1e-12),
            position_embedding_type=getattr(config, "position_embedding_type", "absolute"),
            num_labels=getattr(config, "num_labels", 0),
            id2label=dict(getattr(config, "id2label", None) or {}),
        )

