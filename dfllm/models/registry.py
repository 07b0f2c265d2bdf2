"""Which architectures dfllm implements, and the class of each (``EngineConfig.create``
rejects the rest, naming what is unsupported)."""

from __future__ import annotations

from torch import nn

from dfllm.models.bert import BertForSequenceClassification, BertModel
from dfllm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from dfllm.models.spec import ModelSpec

GENERATIVE_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


ENCODER_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
}


def is_pooling_only(spec: ModelSpec) -> bool:
    """True for architectures that can only pool (encoders, classifiers)."""
    return any(a in ENCODER_ARCHITECTURES for a in spec.architectures)


def is_generative(spec: ModelSpec) -> bool:
    """True when one of the model's architectures is a decoder dfllm implements."""
    return any(a in GENERATIVE_ARCHITECTURES for a in spec.architectures)


def pooling_model_class(spec: ModelSpec) -> tuple[type[nn.Module], bool]:
    """``(class, is_decoder)`` of a model used for pooling: an encoder, or a decoder embedder."""
    for arch in spec.architectures:
        if arch in ENCODER_ARCHITECTURES:
            return ENCODER_ARCHITECTURES[arch], False
    return model_class(spec), True


def model_class(spec: ModelSpec) -> type[LlamaForCausalLM]:
    """The dfllm decoder class of a (supported) model: its first architecture dfllm implements."""
    return next(GENERATIVE_ARCHITECTURES[a] for a in spec.architectures if a in GENERATIVE_ARCHITECTURES)
