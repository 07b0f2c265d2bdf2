"""Images on the engine: dfllm's own vision towers against transformers', LLaVA generation
against transformers' ``generate`` (mixed batches, chunked prefill, preemption), the prefix
cache keyed by image, the processed-image cache and vLLM's multimodal prompt forms."""

from __future__ import annotations

import pytest
import torch

from dfllm.models.loader import load_weights
from dfllm.models.vision import CLIPVisionTransformer, SiglipVisionTransformer

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=28,
              patch_size=7)


@pytest.mark.parametrize("kind", ["clip", "siglip", "siglip_head"])
def test_vision_towers_match_transformers(tmp_path, kind):
    from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    if kind == "clip":
        cfg, hf_cls, ours = CLIPVisionConfig(**VISION), CLIPVisionModel, CLIPVisionTransformer
    else:
        cfg = SiglipVisionConfig(**VISION, vision_use_head=kind == "siglip_head")
        hf_cls, ours = SiglipVisionModel, SiglipVisionTransformer
    hf = hf_cls(cfg).eval()
    with torch.no_grad():  # random, non-trivial values everywhere (class token, probe, biases)
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path)
    model = ours(cfg)
    load_weights(model, tmp_path)
    model.eval()
    pixels = torch.randn(3, 3, 28, 28)
    with torch.no_grad():
        want = hf(pixel_values=pixels, output_hidden_states=True)
        got = model(pixels)
    assert len(got.hidden_states) == len(want.hidden_states) == 4
    for g, w in zip(got.hidden_states, want.hidden_states):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=1e-5, rtol=1e-5)
    if want.pooler_output is None:
        assert got.pooler_output is None
    else:
        torch.testing.assert_close(got.pooler_output, want.pooler_output, atol=1e-5, rtol=1e-5)
    # a tower cut at an inner layer (LLaVA's vision_feature_layer) loads and agrees up to it
    cut = ours(cfg, num_layers=2)
    load_weights(cut, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(cut(pixels).hidden_states[-1], want.hidden_states[2], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="pixel values of shape"):
        model(torch.randn(1, 3, 14, 14))
