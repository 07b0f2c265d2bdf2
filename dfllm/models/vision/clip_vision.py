"""CLIP's vision transformer (the tower of CLIP and of LLaVA-1.5), as transformers' ``CLIPVisionModel``.

Patch embedding (a strided convolution), a class token, learned positions, a pre-layernorm,
pre-norm encoder layers (bidirectional attention, an MLP with ``quick_gelu``/``gelu``) and a
post-layernorm applied to the class token's state (the pooled output). ``forward`` returns the
hidden states of every layer as well, so that LLaVA picks its ``vision_feature_layer``.

Parameter names follow transformers' (``embeddings.*``, ``pre_layrnorm``, ``encoder.layers.N.*``,
``post_layernorm``) except that q/k/v are fused into ``self_attn.qkv_proj`` (the loader fills it
from the three checkpoint tensors, as for the decoders). ``checkpoint_name`` drops a leading
``vision_model.`` (checkpoints saved by transformers 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "relu": F.relu,
    "silu": F.silu,
}


def vision_activation(name: str):
    """The activation function called ``name`` in a vision config; ``ValueError`` for an unknown one."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"vision tower: unsupported hidden_act {name!r} (supported: {sorted(_ACTIVATIONS)})") from None


@dataclass(frozen=True)
class VisionSpec:
    """What a vision tower reads from its config (``CLIPVisionConfig`` / ``SiglipVisionConfig``)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    hidden_act: str
    layer_norm_eps: float
    vision_use_head: bool = False

    @classmethod
    def from_hf(cls, config) -> VisionSpec:
        """The spec of a transformers vision config (an object or a dict)."""

        def get(key: str, default: Any = None) -> Any:
            return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)

        return cls(
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_hidden_layers=get("num_hidden_layers"),
            num_attention_heads=get("num_attention_heads"),
            image_size=get("image_size"),
            patch_size=get("patch_size"),
            num_channels=get("num_channels", 3),
            hidden_act=get("hidden_act", "quick_gelu"),
            layer_norm_eps=get("layer_norm_eps", 1e-5),
            vision_use_head=bool(get("vision_use_head", False)),
        )


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention with fused q/k/v (biases on all projections)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"vision tower: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        # the loader's fused-tensor layout (a plain attribute, as the decoders' fused layers have)
        object.__setattr__(self.qkv_proj, "output_sizes", [hidden, hidden, hidden])
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        qkv = self.qkv_proj(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.out_proj(out.transpose(1, 2).reshape(b, n, h))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """Pre-norm attention and MLP with residuals (CLIP's and SigLIP's encoder layer)."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        h = spec.hidden_size
        self.layer_norm1 = nn.LayerNorm(h, eps=spec.layer_norm_eps)
        self.self_attn = VisionAttention(h, spec.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(h, eps=spec.layer_norm_eps)
        self.mlp = VisionMLP(h, spec.intermediate_size, spec.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, spec: VisionSpec, num_layers: int | None = None):
        super().__init__()
        n = spec.num_hidden_layers if num_layers is None else num_layers
        self.layers = nn.ModuleList(VisionEncoderLayer(spec) for _ in range(n))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The input and every layer's output (``num_layers + 1`` tensors)."""
        states = [x]
        for layer in self.layers:
            x = layer(x)
            states.append(x)
        return states


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        h = spec.hidden_size
        self.class_embedding = nn.Parameter(torch.zeros(h))
        self.patch_embedding = nn.Conv2d(
            spec.num_channels, h, kernel_size=spec.patch_size, stride=spec.patch_size, bias=False
        )
        self.num_patches = (spec.image_size // spec.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches + 1, h)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


@dataclass
class VisionOutput:
    """A vision tower's outputs: the last layer's states, every layer's states (the encoder's
    input first, as transformers' ``hidden_states``) and the pooled vector (None without one)."""

    last_hidden_state: torch.Tensor
    hidden_states: list[torch.Tensor]
    pooler_output: torch.Tensor | None


def _check_pixels(pixel_values: torch.Tensor, spec: VisionSpec) -> None:
    if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (
        spec.num_channels,
        spec.image_size,
        spec.image_size,
    ):
        raise ValueError(
            f"vision tower: expected pixel values of shape (batch, {spec.num_channels}, "
            f"{spec.image_size}, {spec.image_size}), got {tuple(pixel_values.shape)}"
        )


def strip_vision_model(name: str) -> str:
    """A vision checkpoint tensor's name without transformers 4's ``vision_model.`` wrapper."""
    return name.removeprefix("vision_model.")


class CLIPVisionTransformer(nn.Module):
    """CLIP's vision tower; ``num_layers`` (default: all) builds only the first layers (LLaVA
    stops at its ``vision_feature_layer``; later layers' weights are then skipped when loading)."""

    def __init__(self, config, num_layers: int | None = None):
        super().__init__()
        spec = config if isinstance(config, VisionSpec) else VisionSpec.from_hf(config)
        self.spec = spec
        self.embeddings = CLIPVisionEmbeddings(spec)
        self.pre_layrnorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.encoder = VisionEncoder(spec, num_layers)
        self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)

    @property
    def num_positions(self) -> int:
        """Tokens per image: the patches and the class token."""
        return self.embeddings.num_patches + 1

    def forward(self, pixel_values: torch.Tensor) -> VisionOutput:
        _check_pixels(pixel_values, self.spec)
        states = self.encoder(self.pre_layrnorm(self.embeddings(pixel_values)))
        last = states[-1]
        return VisionOutput(last, states, self.post_layernorm(last[:, 0, :]))

    def checkpoint_name(self, name: str) -> str | None:
        """Parameter key of a checkpoint tensor (None: a layer this tower does not build)."""
        name = strip_vision_model(name)
        return None if _beyond(name, len(self.encoder.layers)) else name


def _beyond(name: str, num_layers: int) -> bool:
    """Whether ``name`` is an encoder layer's tensor at or past ``num_layers``."""
    if not name.startswith("encoder.layers."):
        return False
    return int(name.split(".")[2]) >= num_layers
