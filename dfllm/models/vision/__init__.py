"""Vision encoders (our own forward passes), loading transformers' safetensors weight names."""

from dfllm.models.vision.clip_vision import CLIPVisionTransformer, vision_activation
from dfllm.models.vision.siglip_vision import SiglipVisionTransformer

__all__ = ["CLIPVisionTransformer", "SiglipVisionTransformer", "vision_activation"]
