"""Qwen2-VL (``Qwen2VLForConditionalGeneration``): Qwen2-VL's vision transformer (2-D rotary,
2x2 patch merger; :mod:`dfllm.models.vision.qwen2_vl_vision`) and a Qwen2 text model with
multimodal rotary positions (M-RoPE), as transformers' Qwen2-VL.

An image of any size becomes ``t * h * w / 4`` embeddings (its processor resizes it to a
multiple of 28 pixels and gives its patch grid). M-RoPE rotates each head's frequency
sections (``mrope_section``) by a token's temporal, row and column position: text tokens have
the same position on all three axes, an image's tokens their (frame, row, column) in the
merged grid, offset by where the image starts (``dfllm.multimodal.processor.mrope_positions``);
generated tokens count on from the prompt's largest position. The engine passes these
positions per step (``dfllm.multimodal.encoder.step_mrope_positions``). Split over ranks, the
vision tower is replicated (rank 0 encodes the images) and the text model split.

Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``) is the same with its own vision tower
(RMS norms, gated MLPs, window attention); its images' positions are Qwen2-VL's (videos,
whose temporal positions differ, are not supported).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dfllm.distributed.parallel_state import ParallelContext
from dfllm.kernels.backend import KernelOps
from dfllm.kernels.metadata import AttentionMetadata
from dfllm.models.layers import RotaryEmbedding
from dfllm.models.llama import Qwen2ForCausalLM
from dfllm.models.spec import ModelSpec
from dfllm.models.vision.qwen2_vl_vision import Qwen2VisionTransformer, Qwen25VisionTransformer
from dfllm.multimodal.encoder import embed_with_images
from dfllm.multimodal.processor import ImageTokens


@dataclass(frozen=True)
class Qwen2VLInfo:
    image_token_id: int
    merge: int
    mrope_section: tuple[int, ...]
    vision_config: dict


def qwen2_vl_info(config) -> Qwen2VLInfo:
    """Read a Qwen2-VL config (an object or its ``to_dict()``)."""
    cfg = config if isinstance(config, dict) else config.to_dict()
    text, vision = cfg.get("text_config") or cfg, cfg.get("vision_config") or {}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = tuple(rope.get("mrope_section") or (16, 24, 24))
    token = cfg.get("image_token_id", text.get("image_token_id"))
    if token is None:
        raise ValueError("Qwen2-VL config.json names no image_token_id")
    return Qwen2VLInfo(int(token), int(vision.get("spatial_merge_size", 2)), section, vision)


class MRotaryEmbedding(nn.Module):
    """The text model's rotary tables, read with 1-D positions ``(tokens,)`` as usual or with
    M-RoPE's ``(3, tokens)``: frequency ``j`` takes its angle from the axis of its section."""

    axis: torch.Tensor  # buffer

    def __init__(self, rotary: RotaryEmbedding, section: tuple[int, ...]):
        super().__init__()
        self.rotary: RotaryEmbedding = rotary
        half = rotary.cos.shape[-1]
        if sum(section) != half:
            raise ValueError(f"Qwen2-VL mrope_section {list(section)} does not add up to half the head size ({half})")
        axis = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])
        self.register_buffer("axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return self.rotary(positions)
        cos, sin = self.rotary(positions)  # (3, tokens, half)
        index = self.axis.view(1, 1, -1).expand(1, cos.shape[1], -1)
        return cos.gather(0, index)[0], sin.gather(0, index)[0]


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    """The Qwen2 text decoder (``model``, ``lm_head``) plus ``visual``; ``forward`` takes
    ``mm_embeds`` (as LLaVA's) and ``mrope_positions`` ``(3, tokens)``."""

    uses_mrope = True
    vision_tower_class: type[Qwen2VisionTransformer] = Qwen2VisionTransformer
    window_support = "none"
    supports_cuda_graphs = False  # 3-D rotary positions

    @classmethod
    def image_tokens(cls, spec: ModelSpec, tokenizer=None) -> ImageTokens:
        """``<|image_pad|>``, expanded to each image's merged patch grid, with 3-D positions."""
        info = qwen2_vl_info(spec.multimodal)
        return ImageTokens(
            info.image_token_id,
            "<|image_pad|>",
            0,
            merge=info.merge,
            mrope=True,
            placeholder="<|vision_start|><|image_pad|><|vision_end|>",
        )

    def __init__(self, spec: ModelSpec, ops: KernelOps, max_positions: int, parallel: ParallelContext | None = None):
        super().__init__(spec, ops, max_positions, parallel)
        assert spec.multimodal is not None
        self.info = qwen2_vl_info(spec.multimodal)
        self.visual = self.vision_tower_class(self.info.vision_config)
        self.model.rotary_emb = MRotaryEmbedding(self.model.rotary_emb, self.info.mrope_section)  # type: ignore[assignment]
        self._text_checkpoint_name = self.checkpoint_name  # the decoder's (a pipeline stage's) naming
        self.checkpoint_name = self._qwen2_vl_checkpoint_name

    def _qwen2_vl_checkpoint_name(self, name: str) -> str | None:
        """Parameter key of a checkpoint tensor: Qwen's names (``model.layers.*``, ``visual.*``)
        or transformers 5's (``model.language_model.*``, ``model.visual.*``)."""
        for old, new in (("model.language_model.", "model."), ("model.visual.", "visual.")):
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        return name if name.startswith("visual.") else self._text_checkpoint_name(name)

    def encode_image_items(self, items, device: torch.device) -> list[torch.Tensor]:
        """Each image's embeddings; all images in one vision batch (attention within each)."""
        pixels = torch.cat([it.pixel_values for it in items]).to(device)
        out = self.visual(pixels.to(self.visual.patch_embed.proj.weight.dtype), [it.grid for it in items])
        return list(out.split([it.length for it in items]))

    def forward(
        self, input_ids, positions, meta: AttentionMetadata, intermediate=None, mm_embeds=None, mrope_positions=None
    ):
        if mm_embeds is not None and intermediate is None:
            assert self.model.embed_tokens is not None
            intermediate = (
                embed_with_images(self.model.embed_tokens, input_ids, self.info.image_token_id, mm_embeds),
                None,
            )
        return super().forward(input_ids, positions if mrope_positions is None else mrope_positions, meta, intermediate)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 (transformers' name)
    """Qwen2.5-VL: Qwen2-VL with the Qwen2.5-VL vision tower."""

    vision_tower_class = Qwen25VisionTransformer
