"""Which architectures dfllm implements, and the checks that reject the rest clearly."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from dfllm.models.bert import BertForSequenceClassification, BertModel
from dfllm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM

GENERATIVE_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


ENCODER_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
}


def is_pooling_only(config: PretrainedConfig) -> bool:
    """True for architectures that can only pool (encoders, classifiers)."""
    return any(a in ENCODER_ARCHITECTURES for a in getattr(config, "architectures", None) or [])


def pooling_model_class(config: PretrainedConfig) -> tuple[type[nn.Module], bool]:
    """``(class, is_decoder)`` of a model used for pooling: an encoder, or a decoder embedder."""
    for arch in getattr(config, "architectures", None) or []:
        if arch in ENCODER_ARCHITECTURES:
            return ENCODER_ARCHITECTURES[arch], False
    return model_class(config, getattr(config, "max_position_embeddings", 0) or 0), True


def model_class(config: PretrainedConfig, max_model_len: int) -> type[nn.Module]:
    """The dfllm class for ``config``; raise ``ValueError`` naming what is unsupported."""
    archs = list(getattr(config, "architectures", None) or [])
    supported = [a for a in archs if a in GENERATIVE_ARCHITECTURES]
    if not supported:
        raise ValueError(
            f"unsupported architecture {archs or '(none in config.json)'}; "
            f"dfllm implements {sorted(GENERATIVE_ARCHITECTURES) + sorted(ENCODER_ARCHITECTURES)}"
        )
    if getattr(config, "quantization_config", None):
        method = config.quantization_config.get("quant_method", "?")
        raise ValueError(f"quantized checkpoints ({method}) are not supported; use float weights")
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", window is not None)
    if uses_window and window is not None and window < max_model_len:
        raise ValueError(
            f"sliding-window attention (window {window}) is not supported; "
            f"set max_model_len <= {window}"
        )
    return GENERATIVE_ARCHITECTURES[supported[0]]
