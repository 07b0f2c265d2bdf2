"""CLIP and SigLIP as embedding models (``runner="pooling"``): text and image prompts into one
space, equal to transformers' ``get_text_features``/``get_image_features`` (cosine >= 0.9999)
on tiny random models saved as real Hugging Face directories with their own tokenizer and
image processor; the image cache; bad image prompts refused naming the prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import (
    AutoImageProcessor,
    CLIPTokenizer,
)
from transformers import CLIPModel as HFCLIPModel
from transformers import SiglipModel as HFSiglipModel

from dfllm import LLM
from dfllm.errors import InvalidRequestError
from dfllm.pooling_params import PoolingParams

from image_data import build_tiny_clip, png_bytes, random_image

TEXTS = ["a photo of a cat", "two dogs playing in the snow", "x"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> Path:
    return build_tiny_clip(tmp_path_factory.mktemp("clip"), "clip")


@pytest.fixture(scope="module")
def siglip_dir(tmp_path_factory) -> Path:
    return build_tiny_clip(tmp_path_factory.mktemp("siglip"), "siglip")


def _hf_features(path: Path, kind: str, texts: list[str], images: list[Image.Image]):
    cls = HFCLIPModel if kind == "clip" else HFSiglipModel
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    tok = CLIPTokenizer.from_pretrained(path)
    proc = AutoImageProcessor.from_pretrained(path, backend="pil")
    with torch.inference_mode():
        text = [model.get_text_features(input_ids=torch.tensor([tok(t)["input_ids"]])).pooler_output[0] for t in texts]
        pixels = proc(images=images, return_tensors="pt")["pixel_values"]
        image = model.get_image_features(pixel_values=pixels).pooler_output
    return torch.stack(text), image


def _cos(a, b) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(
        torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), dim=-1
    )


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_text_and_image_embeddings_equal_transformers(kind, clip_dir, siglip_dir):
    path = clip_dir if kind == "clip" else siglip_dir
    images = [random_image(1), random_image(2, (64, 30)), random_image(3, (32, 32))]
    hf_text, hf_image = _hf_features(path, kind, TEXTS, images)
    llm = LLM(model=path, runner="pooling", max_num_seqs=2)  # 2: images go through the encoder in 2 batches
    # mixed in one call, in vLLM's prompt forms: text, {"prompt": ...}, image with an empty or no prompt
    prompts = [
        TEXTS[0],
        {"multi_modal_data": {"image": images[0]}},
        {"prompt": TEXTS[1]},
        {"prompt": "", "multi_modal_data": {"image": images[1]}},
        TEXTS[2],
        {"multi_modal_data": {"image": [images[2]]}},
    ]
    raw = llm.embed(prompts, PoolingParams(normalize=False), use_tqdm=False)
    got = [torch.tensor(o.outputs.embedding) for o in raw]
    want = [hf_text[0], hf_image[0], hf_text[1], hf_image[1], hf_text[2], hf_image[2]]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert float(_cos(g, w)) >= 0.9999
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert raw[1].prompt_token_ids == [] and raw[0].prompt_token_ids[-1] == 513  # text: its ids, ending in EOS
    # by default, as vLLM: normalised, so that a dot product is the cosine similarity of text and image
    normed = llm.embed([TEXTS[0], {"multi_modal_data": {"image": images[0]}}], use_tqdm=False)
    for o, w in zip(normed, [hf_text[0], hf_image[0]]):
        v = torch.tensor(o.outputs.embedding)
        assert abs(float(v.norm()) - 1) < 1e-5 and float(_cos(v, w)) >= 0.9999


def test_image_forms_cache_and_errors(clip_dir, tmp_path):
    llm = LLM(model=clip_dir, runner="pooling")
    engine = llm.pooling_engine
    assert engine is not None
    img = random_image(7)
    file = tmp_path / "cat.png"
    file.write_bytes(png_bytes(img))
    # the same pixels as a PIL image, PNG bytes, a path, a file:// URL: one image, encoded once
    forms = [img, png_bytes(img), str(file), file.as_uri()]
    before = dict(engine.image_stats)
    outs = llm.embed([{"multi_modal_data": {"image": f}} for f in forms], use_tqdm=False)
    assert engine.image_stats["encoded"] - before["encoded"] == 1
    assert engine.image_stats["reused"] - before["reused"] == 3
    first = outs[0].outputs.embedding
    assert all(o.outputs.embedding == first for o in outs)
    # a later call reuses the cached features; reset_mm_cache forgets them
    llm.embed({"multi_modal_data": {"image": img}}, use_tqdm=False)
    assert engine.image_stats["encoded"] - before["encoded"] == 1
    engine.reset_mm_cache()
    again = llm.embed({"multi_modal_data": {"image": img}}, use_tqdm=False)
    assert engine.image_stats["encoded"] - before["encoded"] == 2
    assert again[0].outputs.embedding == pytest.approx(first, abs=1e-6)
    # a grayscale image is converted to RGB first, as vLLM does
    gray = random_image(8, mode="L")
    g = llm.embed({"multi_modal_data": {"image": gray}}, use_tqdm=False)[0].outputs.embedding
    rgb = llm.embed({"multi_modal_data": {"image": gray.convert("RGB")}}, use_tqdm=False)[0].outputs.embedding
    assert g == pytest.approx(rgb, abs=1e-6)
    # bad prompts: each refused before any work, naming the prompt and the problem
    bad = [
        ({"prompt": "a cat", "multi_modal_data": {"image": img}}, "not both"),
        ({"multi_modal_data": {"image": b"not an image"}}, "cannot decode image"),
        ({"multi_modal_data": {"image": [img, img]}}, "one image, got 2"),
        ({"multi_modal_data": {"video": img}}, "multi_modal_data must be"),
        ({"multi_modal_data": {"image": str(tmp_path / "missing.png")}}, "image not found"),
        ({"multi_modal_data": {"image": 3.5}}, "type float"),
    ]
    for prompt, message in bad:
        with pytest.raises(InvalidRequestError, match=message) as err:
            llm.embed(["fine", prompt], use_tqdm=False)
        assert "prompt 1" in str(err.value)
    # score compares texts; the embeddings of texts and images share one space (a dot product)
    s = llm.score("a photo of a cat", ["a photo of a cat", "x"], use_tqdm=False)
    assert s[0].outputs.score == pytest.approx(1.0, abs=1e-5)


@pytest.mark.slow
def test_text_only_model_refuses_images(tiny_llama):
    llm = LLM(model=tiny_llama, runner="pooling", max_model_len=64)
    with pytest.raises(InvalidRequestError, match="text-only model"):
        llm.embed({"multi_modal_data": {"image": random_image(0)}}, use_tqdm=False)
