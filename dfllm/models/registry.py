"""Which architectures dfllm implements, and the class of each (``EngineConfig.create``
rejects the rest, naming what is unsupported)."""

from __future__ import annotations

from torch import nn

from dfllm.models.bert import BertForSequenceClassification, BertModel
from dfllm.models.clip import CLIPModel
from dfllm.models.colbert import ColBERTModel
from dfllm.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from dfllm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from dfllm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from dfllm.models.llava import LlavaForConditionalGeneration
from dfllm.models.moe_models import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from dfllm.models.phi3 import Phi3ForCausalLM
from dfllm.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from dfllm.models.qwen3 import Qwen3ForCausalLM
from dfllm.models.seq_cls import (
    LlamaForSequenceClassification,
    Qwen2ForSequenceClassification,
    Qwen3ForSequenceClassification,
)
from dfllm.models.siglip import SiglipModel
from dfllm.models.spec import ModelSpec
from dfllm.models.xlm_roberta import XLMRobertaForSequenceClassification, XLMRobertaModel

GENERATIVE_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # mixture of experts
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    # multi-head latent attention (and mixture of experts)
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    # vision-language (images in the prompt): dfllm.models.llava, dfllm.multimodal
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
}


ENCODER_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaModel": XLMRobertaModel,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "RobertaModel": XLMRobertaModel,
    "RobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "HF_ColBERT": ColBERTModel,
    # image-text embedders: text and images into one space (runner="pooling")
    "CLIPModel": CLIPModel,
    "SiglipModel": SiglipModel,
}


# decoders with a classification head (pooling only: classify, and score with one label)
DECODER_CLASSIFIER_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
    "Qwen2ForSequenceClassification": Qwen2ForSequenceClassification,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "MistralForSequenceClassification": LlamaForSequenceClassification,
}


def is_pooling_only(spec: ModelSpec) -> bool:
    """True for architectures that can only pool (encoders, classifiers)."""
    return any(a in ENCODER_ARCHITECTURES or a in DECODER_CLASSIFIER_ARCHITECTURES for a in spec.architectures)


def is_generative(spec: ModelSpec) -> bool:
    """True when one of the model's architectures is a decoder dfllm implements."""
    return any(a in GENERATIVE_ARCHITECTURES for a in spec.architectures)


def pooling_model_class(spec: ModelSpec) -> tuple[type[nn.Module], bool]:
    """``(class, is_decoder)`` of a model used for pooling: an encoder, or a decoder embedder."""
    for arch in spec.architectures:
        if arch in ENCODER_ARCHITECTURES:
            return ENCODER_ARCHITECTURES[arch], False
        if arch in DECODER_CLASSIFIER_ARCHITECTURES:
            return DECODER_CLASSIFIER_ARCHITECTURES[arch], True
    return model_class(spec), True


def model_class(spec: ModelSpec) -> type[LlamaForCausalLM]:
    """The dfllm decoder class of a (supported) model: its first architecture dfllm implements."""
    for arch in spec.architectures:
        if arch in DECODER_CLASSIFIER_ARCHITECTURES:
            return DECODER_CLASSIFIER_ARCHITECTURES[arch]
    return next(GENERATIVE_ARCHITECTURES[a] for a in spec.architectures if a in GENERATIVE_ARCHITECTURES)
