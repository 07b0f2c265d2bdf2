"""SigLIP's vision transformer, as transformers' ``SiglipVisionModel``.

Patch embedding (a strided convolution with a bias), learned positions, no class token, the
encoder layers CLIP has, a post-layernorm over every token, and optionally (``vision_use_head``)
the multi-head attention-pooling head (a learned probe attending over the tokens) giving the
pooled vector. Parameter names follow transformers' (q/k/v fused as in
:mod:`dfllm.models.vision.clip_vision`; the head keeps ``nn.MultiheadAttention``'s names).
"""

from __future__ import annotations

import torch
from torch import nn

from dfllm.models.vision.clip_vision import (
    VisionEncoder,
    VisionMLP,
    VisionOutput,
    VisionSpec,
    _beyond,
    _check_pixels,
    strip_vision_model,
)


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            spec.num_channels, spec.hidden_size, kernel_size=spec.patch_size, stride=spec.patch_size
        )
        self.num_patches = (spec.image_size // spec.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches, spec.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipAttentionPoolingHead(nn.Module):
    """A learned probe attends over the tokens; a layernormed MLP with a residual follows."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        h = spec.hidden_size
        self.probe = nn.Parameter(torch.zeros(1, 1, h))
        self.attention = nn.MultiheadAttention(h, spec.num_attention_heads, batch_first=True)
        self.layernorm = nn.LayerNorm(h, eps=spec.layer_norm_eps)
        self.mlp = VisionMLP(h, spec.intermediate_size, spec.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probe = self.probe.expand(x.shape[0], 1, -1)
        x = self.attention(probe, x, x, need_weights=False)[0]
        x = x + self.mlp(self.layernorm(x))
        return x[:, 0]


class SiglipVisionTransformer(nn.Module):
    """SigLIP's vision tower (``num_layers`` as for :class:`CLIPVisionTransformer`; a tower built
    with fewer layers than the config's skips the post-layernorm and head: LLaVA-style models
    read an inner layer's raw states)."""

    def __init__(self, config, num_layers: int | None = None, use_head: bool | None = None):
        super().__init__()
        spec = config if isinstance(config, VisionSpec) else VisionSpec.from_hf(config)
        self.spec = spec
        self.embeddings = SiglipVisionEmbeddings(spec)
        self.encoder = VisionEncoder(spec, num_layers)
        self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        use_head = spec.vision_use_head if use_head is None else use_head
        self.head = SiglipAttentionPoolingHead(spec) if use_head else None

    @property
    def num_positions(self) -> int:
        """Tokens per image: one per patch."""
        return self.embeddings.num_patches

    def forward(self, pixel_values: torch.Tensor) -> VisionOutput:
        _check_pixels(pixel_values, self.spec)
        states = self.encoder(self.embeddings(pixel_values))
        last = self.post_layernorm(states[-1])
        pooled = self.head(last) if self.head is not None else None
        return VisionOutput(last, states, pooled)

    def checkpoint_name(self, name: str) -> str | None:
        """Parameter key of a checkpoint tensor (None: a layer or head this tower does not build)."""
        name = strip_vision_model(name)
        if _beyond(name, len(self.encoder.layers)) or (self.head is None and name.startswith("head.")):
            return None
        return name
