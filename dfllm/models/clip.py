"""CLIP as an embedding model (``CLIPModel``, ``runner="pooling"``): text and images into
one space, as vLLM serves it.

A text prompt runs the text tower (causal attention, learned positions), is pooled at its
first end-of-text token (at the highest token id for old configs whose ``eos_token_id`` is
2, as transformers does) and projected by ``text_projection``; an image runs the vision
tower from :mod:`dfllm.models.vision` (our own forward pass), whose class token, after
``post_layernorm``, is projected by ``visual_projection``. Images are preprocessed by the
model's own transformers image processor (the Pillow backend). The module tree mirrors
Hugging Face's names, so checkpoints load as they are. SigLIP (:mod:`dfllm.models.siglip`)
shares the text encoder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str, where: str):
    """The activation function called ``name``; ``ValueError`` naming ``where`` for another."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{where}: hidden_act {name!r} is not supported ({sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class EncoderAttention(nn.Module):
    """Multi-head attention with a mask; q/k/v fused into ``qkv_proj`` (the loader fills it
    from the checkpoint's ``q_proj``/``k_proj``/``v_proj``, as for the vision towers)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        # torch's stubs type nn.Module.__setattr__'s value as Tensor | Module (it takes any value)
        self.qkv_proj.output_sizes = [hidden, hidden, hidden]  # type: ignore[assignment]
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv_proj(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=mask)
        return self.out_proj(o.transpose(1, 2).reshape(b, n, -1))


class EncoderMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    """A pre-norm transformer layer: CLIP's and SigLIP's ``EncoderLayer``."""

    def __init__(self, config: PretrainedConfig, where: str):
        super().__init__()
        h = config.hidden_size
        self.layer_norm1 = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.self_attn = EncoderAttention(h, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.mlp = EncoderMLP(h, config.intermediate_size, activation(config.hidden_act, where))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, config: PretrainedConfig, where: str):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config, where) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return x


class TextEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.token_embedding(ids) + self.position_embedding(torch.arange(ids.shape[1], device=ids.device))


class TextTransformer(nn.Module):
    """The text tower: ``forward`` gives the final-layer-normed states ``[batch, length, h]``
    of right-padded ids (``causal``: CLIP's causal mask; else SigLIP's padding mask)."""

    def __init__(self, config: PretrainedConfig, causal: bool, where: str):
        super().__init__()
        self.causal = causal
        self.embeddings = TextEmbeddings(config)
        self.encoder = Encoder(config, where)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        mask: torch.Tensor | None
        if self.causal:  # padding is on the right: a causal mask never lets a real token see it
            mask = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        else:
            mask = None if bool(valid.all()) else valid[:, None, None, :]
        return self.final_layer_norm(self.encoder(self.embeddings(ids), mask))


def load_image_processor(path: Path) -> Any:
    """The model directory's own transformers image processor, on its Pillow backend (no
    torchvision)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path, backend="pil")


class ImageTextModel(nn.Module):
    """A text tower and an image tower (CLIP, SigLIP), built from the whole (nested) config.
    ``forward`` (the pooling engine's encoder call) gives the text tower's states."""

    #: takes images (``{"multi_modal_data": {"image": ...}}`` prompts) besides text
    image_text = True
    text_model: TextTransformer

    def __init__(self, config: PretrainedConfig):
        super().__init__()

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> ImageTextModel:
        return cls(config)

    def forward(self, ids: torch.Tensor, token_type_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.text_model(ids, valid)


class CLIPModel(ImageTextModel):
    """CLIP's two towers and projections: :meth:`pool_text` the projected text embeddings and
    :meth:`image_features` the projected image embeddings."""

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        from dfllm.models.vision.clip_vision import CLIPVisionTransformer

        text, vision = config.text_config, config.vision_config
        self.eos_token_id = text.eos_token_id
        self.text_model = TextTransformer(text, causal=True, where="CLIP text_config")
        self.vision_model = CLIPVisionTransformer(vision)
        self.text_projection = nn.Linear(text.hidden_size, config.projection_dim, bias=False)
        self.visual_projection = nn.Linear(vision.hidden_size, config.projection_dim, bias=False)

    def pool_text(self, hidden: torch.Tensor, prompts: list[list[int]]) -> torch.Tensor:
        """Projected embeddings ``[batch, projection_dim]`` of the text states ``hidden`` of
        ``prompts``: each at its first end-of-text token (the highest id where the config's
        ``eos_token_id`` is the legacy 2; the last token where a prompt has none)."""
        at = []
        for p in prompts:
            if self.eos_token_id == 2:
                at.append(max(range(len(p)), key=p.__getitem__))
            else:
                at.append(p.index(self.eos_token_id) if self.eos_token_id in p else len(p) - 1)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return self.text_projection(hidden[rows, torch.tensor(at, device=hidden.device)])

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Projected embeddings ``[images, projection_dim]`` of preprocessed images."""
        return self.visual_projection(self.vision_model(pixel_values).pooler_output)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """Checkpoint tensor name -> parameter name (None: ``logit_scale``, unused here)."""
        return None if name == "logit_scale" else name
