"""SigLIP as an embedding model (``SiglipModel``, ``runner="pooling"``): text and images into
one space, as vLLM serves it.

A text prompt runs the text tower (bidirectional attention over its own tokens), is pooled
at its last token and projected by the tower's ``head``; an image runs the vision tower from
:mod:`dfllm.models.vision` (our own forward pass), pooled by its attention-pooling head. As
in vLLM, text is not padded to the tokenizer's ``max_length``: the embedding of a prompt is
transformers' ``get_text_features`` of the prompt's own token ids.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from dfllm.models.clip import ImageTextModel, TextTransformer


class SiglipTextTransformer(TextTransformer):
    """SigLIP's text tower: :class:`~dfllm.models.clip.TextTransformer` with its ``head``."""

    def __init__(self, config: PretrainedConfig):
        super().__init__(config, causal=False, where="SigLIP text_config")
        self.head = nn.Linear(config.hidden_size, getattr(config, "projection_size", None) or config.hidden_size)


class SiglipModel(ImageTextModel):
    """SigLIP's two towers: :meth:`pool_text` the text embeddings and :meth:`image_features`
    the image embeddings."""

    text_model: SiglipTextTransformer

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        from dfllm.models.vision.siglip_vision import SiglipVisionTransformer

        vision = config.vision_config
        if not getattr(vision, "vision_use_head", True):
            raise ValueError(
                "SigLIP vision_config.vision_use_head=False: a vision tower without its pooling head "
                "gives no image embedding; dfllm embeds with SiglipModel checkpoints that have one"
            )
        self.text_model = SiglipTextTransformer(config.text_config)
        self.vision_model = SiglipVisionTransformer(vision)

    def pool_text(self, hidden: torch.Tensor, prompts: list[list[int]]) -> torch.Tensor:
        """Text embeddings ``[batch, projection_size]``: each prompt's last token, through ``head``."""
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        last = torch.tensor([len(p) - 1 for p in prompts], device=hidden.device)
        return self.text_model.head(hidden[rows, last])

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Image embeddings ``[images, hidden]``: the vision tower's attention-pooled output."""
        return self.vision_model(pixel_values).pooler_output

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Checkpoint tensor name -> parameter name (None: ``logit_scale``/``logit_bias``, unused here)."""
        return None if name in ("logit_scale", "logit_bias") else name
