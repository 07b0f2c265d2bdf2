"""Tiny random image models saved as real Hugging Face directories (CLIP, SigLIP, LLaVA-1.5)
and random images, shared by the multimodal, semantic, jobs and benchmark code."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    AutoTokenizer,
    CLIPConfig,
    CLIPImageProcessorPil,
    CLIPTokenizer,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    SiglipConfig,
    SiglipImageProcessorPil,
)
from transformers import CLIPModel as HFCLIPModel
from transformers import SiglipModel as HFSiglipModel


def _tokenizer() -> CLIPTokenizer:
    """A real CLIP tokenizer over byte-level characters (no merges): 514 tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    chars = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    return CLIPTokenizer(vocab=vocab, merges=[])


def build_tiny_clip(root: Path, kind: str = "clip", seed: int = 0, image_size: int = 32) -> Path:
    """A random CLIPModel or SiglipModel (hidden 64, 2 layers, ``image_size`` pixels in
    patches of 8) with a CLIP tokenizer and the model's own image processor, saved in ``root``."""
    tok = _tokenizer()
    tower = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    text = dict(
        tower,
        vocab_size=len(tok),
        max_position_embeddings=32,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    vision = dict(tower, image_size=image_size, patch_size=8)
    torch.manual_seed(seed)
    if kind == "clip":
        model = HFCLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=48))
        processor = CLIPImageProcessorPil(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
        )
    else:
        model = HFSiglipModel(SiglipConfig(text_config=dict(text, projection_size=64), vision_config=vision))
        processor = SiglipImageProcessorPil(size={"height": image_size, "width": image_size})
    with torch.no_grad():  # transformers' init leaves some tensors tiny; spread them so that errors show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = root / f"{kind}-s{seed}"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def build_tiny_llava(root: Path, tokenizer_dir: Path) -> Path:
    """A random LLaVA-1.5 (a tiny CLIP tower, a tiny Llama; SmolLM2's tokenizer with an
    ``<image>`` token) with its own LlavaProcessor, saved in ``root``."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(["<image>"], special_tokens=True)
    config = LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            bos_token_id=1,
            eos_token_id=2,
            initializer_range=0.2,
        ),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=16,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = root / "llava"
    model.save_pretrained(path)
    LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tok,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tok.chat_template,
    ).save_pretrained(path)
    return path


def random_image(seed: int, size: tuple[int, int] = (40, 56), mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).convert(mode)


def png_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()
