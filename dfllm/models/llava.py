"""LLaVA (``LlavaForConditionalGeneration``): a CLIP or SigLIP vision tower, a two-layer
projector and a Llama, Mistral or Qwen2 text model, as transformers' LLaVA-1.5.

Each image becomes ``image_seq_length`` embeddings (the tower's patches, less its class token
under ``vision_feature_select_strategy="default"``), written over the image's placeholder
tokens in the text model's input embeddings. The tower runs only up to its
``vision_feature_layer`` (the later layers' weights are skipped). The text model is dfllm's
own decoder; this class is that decoder with the tower and projector added, so the engine
drives it like any other. Split over ranks (tensor or pipeline parallel), only the text model
is split: the tower and projector are replicated on every rank, rank 0 encodes the images and
ships their embeddings with the step (``dfllm.engine.executor``).

Not supported (refused by name): towers other than CLIP/SigLIP (Pixtral, ...), text models
other than Llama/Mistral/Qwen2, and LLaVA-NeXT/OneVision's tiled images (other architectures).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dfllm.distributed.parallel_state import ParallelContext
from dfllm.kernels.backend import KernelOps
from dfllm.kernels.metadata import AttentionMetadata
from dfllm.models.llama import LlamaForCausalLM
from dfllm.models.spec import ModelSpec
from dfllm.models.vision.clip_vision import CLIPVisionTransformer, VisionSpec, vision_activation
from dfllm.models.vision.siglip_vision import SiglipVisionTransformer
from dfllm.multimodal.encoder import embed_with_images
from dfllm.multimodal.processor import ImageTokens

TEXT_MODEL_TYPES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
VISION_MODEL_TYPES = {"clip_vision_model": CLIPVisionTransformer, "siglip_vision_model": SiglipVisionTransformer}


@dataclass(frozen=True)
class LlavaInfo:
    """What the input side needs to know about a LLaVA checkpoint's images."""

    image_token_id: int
    tokens_per_image: int
    vision_type: str
    text_type: str
    feature_layers: tuple[int, ...]
    select_strategy: str
    projector_act: str
    projector_bias: bool
    vision_config: dict


def llava_info(config) -> LlavaInfo:
    """Read (and check) a LLaVA config (an object or its ``to_dict()``); ``ValueError`` naming
    what dfllm does not support."""
    cfg = config if isinstance(config, dict) else config.to_dict()
    vision, text = cfg.get("vision_config") or {}, cfg.get("text_config") or {}
    vtype, ttype = vision.get("model_type"), text.get("model_type", "llama")
    if vtype not in VISION_MODEL_TYPES:
        raise ValueError(
            f"LlavaForConditionalGeneration with a {vtype!r} vision tower is not supported; dfllm "
            f"runs LLaVA with {sorted(VISION_MODEL_TYPES)} towers"
        )
    if ttype not in TEXT_MODEL_TYPES:
        raise ValueError(
            f"LlavaForConditionalGeneration with a {ttype!r} text model is not supported; dfllm "
            f"runs LLaVA with {sorted(TEXT_MODEL_TYPES)} text models"
        )
    layer = cfg.get("vision_feature_layer", -2)
    layers = (layer,) if isinstance(layer, int) else tuple(layer)
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"LLaVA vision_feature_select_strategy {strategy!r} is not supported ('default', 'full')")
    spec = VisionSpec.from_hf(vision)
    positions = (spec.image_size // spec.patch_size) ** 2 + (1 if vtype == "clip_vision_model" else 0)
    token = cfg.get("image_token_index", cfg.get("image_token_id"))
    if token is None:
        raise ValueError("LLaVA config.json names no image_token_index")
    return LlavaInfo(
        int(token),
        positions - (1 if strategy == "default" else 0),
        vtype,
        ttype,
        layers,
        strategy,
        cfg.get("projector_hidden_act", "gelu"),
        bool(cfg.get("multimodal_projector_bias", True)),
        vision,
    )


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, hidden: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.act = vision_activation(act)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The text decoder (``model``, ``lm_head``) plus ``vision_tower`` and ``multi_modal_projector``.

    ``forward`` takes ``mm_embeds=(rows, embeddings)``: the batch rows of image placeholder
    tokens and the image embeddings that replace their token embeddings (see
    :mod:`dfllm.multimodal.encoder`)."""

    window_support = "none"  # a windowed text model (Mistral's) is refused beyond its window
    supports_cuda_graphs = False

    @classmethod
    def image_tokens(cls, spec: ModelSpec, tokenizer=None) -> ImageTokens:
        """LLaVA's image token, ``tokens_per_image`` per image (``ValueError`` for a variant dfllm does not run)."""
        info = llava_info(spec.multimodal)
        token = tokenizer.convert_ids_to_tokens(info.image_token_id) if tokenizer is not None else None
        return ImageTokens(info.image_token_id, token or "<image>", info.tokens_per_image)

    def __init__(self, spec: ModelSpec, ops: KernelOps, max_positions: int, parallel: ParallelContext | None = None):
        super().__init__(spec, ops, max_positions, parallel)
        assert spec.multimodal is not None
        info = llava_info(spec.multimodal)
        self.info = info
        tower_cls = VISION_MODEL_TYPES[info.vision_type]
        vspec = VisionSpec.from_hf(info.vision_config)
        total = vspec.num_hidden_layers + 1  # hidden_states: the encoder's input, then each layer's output
        self.feature_layers = tuple(layer % total for layer in info.feature_layers)
        needed = max(self.feature_layers)
        self.vision_tower: CLIPVisionTransformer | SiglipVisionTransformer
        if tower_cls is SiglipVisionTransformer:
            self.vision_tower = SiglipVisionTransformer(vspec, num_layers=needed, use_head=False)
        else:
            self.vision_tower = CLIPVisionTransformer(vspec, num_layers=needed)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vspec.hidden_size * len(self.feature_layers), spec.hidden_size, info.projector_act, info.projector_bias
        )
        self._text_checkpoint_name = self.checkpoint_name  # the decoder's (a pipeline stage's) naming
        self.checkpoint_name = self._llava_checkpoint_name

    @staticmethod
    def biases(spec: ModelSpec) -> tuple[bool, bool]:
        """Qwen2 text models have q/k/v biases; Llama and Mistral follow ``attention_bias``."""
        text_type = (spec.multimodal or {}).get("text_config", {}).get("model_type")
        return (True, False) if text_type == "qwen2" else (spec.attention_bias, spec.attention_bias)

    def _llava_checkpoint_name(self, name: str) -> str | None:
        """Parameter key of a checkpoint tensor, from transformers 4's names
        (``language_model.model.*``, ``vision_tower.vision_model.*``) or 5's
        (``model.language_model.*``, ``model.vision_tower.*``, ``lm_head.*``)."""
        for old, new in (
            ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."),
            ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
        ):
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        if name.startswith("vision_tower."):
            inner = self.vision_tower.checkpoint_name(name[len("vision_tower.") :])
            return None if inner is None else "vision_tower." + inner
        if name.startswith("multi_modal_projector."):
            return name
        return self._text_checkpoint_name(name)

    @property
    def tokens_per_image(self) -> int:
        return self.info.tokens_per_image

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Image embeddings ``(images, tokens_per_image, hidden)`` of a batch of pixel values."""
        out = self.vision_tower(pixel_values.to(self.multi_modal_projector.linear_1.weight.dtype))
        feats = [out.hidden_states[i] for i in self.feature_layers]
        if self.info.select_strategy == "default":
            feats = [f[:, 1:] for f in feats]
        return self.multi_modal_projector(torch.cat(feats, dim=-1) if len(feats) > 1 else feats[0])

    def forward(self, input_ids, positions, meta: AttentionMetadata, intermediate=None, mm_embeds=None):
        if mm_embeds is not None and intermediate is None:
            assert self.model.embed_tokens is not None
            intermediate = (
                embed_with_images(self.model.embed_tokens, input_ids, self.info.image_token_id, mm_embeds),
                None,
            )
        return super().forward(input_ids, positions, meta, intermediate)
