"""Images on the engine: dfllm's own vision towers against transformers', LLaVA generation
against transformers' ``generate`` (mixed batches, chunked prefill, preemption), the prefix
cache keyed by image, the processed-image cache and vLLM's multimodal prompt forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dfllm.models.loader import load_weights
from dfllm.models.vision import CLIPVisionTransformer, SiglipVisionTransformer

VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=28, patch_size=7
)


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


# ---- a tiny LLaVA (CLIP tower + Llama), saved with its processor ------------------------------
IMAGE_TOKEN = "<image>"


def build_tiny_llava(root, tokenizer_dir, seed: int = 0):
    """A random LLaVA-1.5-style model (CLIP tower 28px/7px patches: 16 tokens per image, a tiny
    Llama) with the SmolLM2 tokenizer plus ``<image>``, and its LlavaProcessor, saved in ``root``."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    text = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    vision = CLIPVisionConfig(**{**VISION, "num_hidden_layers": 2})
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_id,
        image_seq_length=16,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # images must move the outputs: larger random vision and projector weights
        for name, p in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                p.add_(torch.randn_like(p) * 0.2)
    path = root / "tiny-llava"
    model.save_pretrained(path)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
        tokenizer=tok,
        patch_size=7,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
    )
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory, smollm2_dir):
    return build_tiny_llava(tmp_path_factory.mktemp("llava"), smollm2_dir)


def _images():
    from PIL import Image

    rng = np.random.default_rng(0)
    sizes = [(28, 28), (40, 30), (17, 33), (64, 64)]
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def hf_llava_greedy(path, requests, max_new_tokens: int):
    """transformers' own LLaVA ``generate`` (greedy), one request at a time: (text, images)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    processor = AutoProcessor.from_pretrained(path, backend="pil")
    outs = []
    with torch.inference_mode():
        for text, images in requests:
            inputs = processor(text=text, images=images or None, return_tensors="pt")
            y = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outs.append(y[0, inputs["input_ids"].shape[1] :].tolist())
    return outs


def _llm(path, **kw):
    from dfllm import LLM

    kw.setdefault("kv_cache_memory_bytes", 2 * 2**20)
    kw.setdefault("max_model_len", 256)
    return LLM(path, **kw)


def _mixed_requests():
    a, b, c, d = _images()
    return [
        ("USER: <image>\nWhat is this? ASSISTANT:", [a]),
        ("USER: <image>\nWhat is this? ASSISTANT:", [b]),  # same text, another image
        ("USER: no image here, just text. ASSISTANT:", []),
        ("USER: <image> and <image>, compare. ASSISTANT:", [c, d]),
        ("USER: <image>\nWhat is this? ASSISTANT:", [a]),  # the first again
        ("<image>", [d]),
    ]


def _prompts(requests):
    return [{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t for t, ims in requests]


@pytest.mark.slow
def test_llava_greedy_equals_transformers(tiny_llava):
    from dfllm import SamplingParams

    requests = _mixed_requests()
    want = hf_llava_greedy(tiny_llava, requests, 8)
    assert want[0] != want[1], "the image must change the output (else this test proves nothing)"
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = _llm(tiny_llava)
    got = [o.outputs[0].token_ids for o in llm.generate(_prompts(requests), sp, use_tqdm=False)]
    assert got == want
    # chunked prefill splitting image placeholder runs (12-token chunks, 16 tokens an image), and preemption under a
    # KV cache too small for the batch: the same tokens
    block = 2 * 4 * 2 * 16 * 2 * 4  # layers x block size 4 x kv heads x head size x (k, v) x float32
    small = _llm(
        tiny_llava, max_model_len=64, max_num_batched_tokens=12, block_size=4, kv_cache_memory_bytes=17 * block
    )
    small.llm_engine.scheduler.reserve_growth = False  # vLLM's admission: the tight cache must preempt
    got = [o.outputs[0].token_ids for o in small.generate(_prompts(requests), sp, use_tqdm=False)]
    assert got == want
    stats = small.llm_engine.scheduler.stats()
    assert stats.num_preemptions > 0, stats


@pytest.mark.slow
def test_chunked_prefill_encodes_a_split_image_once(tiny_llava, llava_want):
    """An image whose placeholders two chunks share is encoded once, even with no cache at all
    (its embeddings are pinned for the sequence until its last placeholder is prefilled)."""
    llm = _llm(tiny_llava, max_num_batched_tokens=8, enable_prefix_caching=False)
    cache = llm.llm_engine.runner.encoder_cache
    cache.max_bytes = 0  # nothing kept across requests
    text, images = _mixed_requests()[0]  # 16 image tokens from position 3: over three 8-token chunks
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, _greedy(), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == llava_want[0]
    assert cache.images_encoded == 1 and not cache.entries and not cache.pins
    llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, _greedy(), use_tqdm=False)
    assert cache.images_encoded == 2  # not cached: encoded again, once


@pytest.fixture(scope="module")
def llava_llm(tiny_llava):
    return _llm(tiny_llava, block_size=4, limit_mm_per_prompt={"image": 2})


@pytest.fixture(scope="module")
def llava_want(tiny_llava):
    """transformers' greedy tokens of the mixed requests (computed once)."""
    return hf_llava_greedy(tiny_llava, _mixed_requests(), 8)


def _greedy(n: int = 8):
    from dfllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_prefix_cache_keys_include_the_image(llava_llm, llava_want):
    llm = llava_llm
    a, b = _images()[:2]
    system = "SYSTEM: a long shared instruction that fills a few KV blocks before the image. "
    text = system + "USER: <image>\nWhat is this? ASSISTANT:"
    llm.reset_prefix_cache()
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": a}}, _greedy(), use_tqdm=False)[0]
    # (on CPU freed blocks are reused first, so the same image runs before the other evicts its blocks)
    same = llm.generate({"prompt": text, "multi_modal_data": {"image": a.copy()}}, _greedy(), use_tqdm=False)[0]
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": b}}, _greedy(), use_tqdm=False)[0]
    image_at = first.prompt_token_ids.index(llm.get_tokenizer().convert_tokens_to_ids(IMAGE_TOKEN))
    assert first.num_cached_tokens == 0
    # another image: only the text blocks before the image are shared
    assert 0 < other.num_cached_tokens <= image_at
    # the same image (another PIL object, same pixels): the image's blocks too
    assert same.num_cached_tokens >= image_at + 16
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    # and each equals a fresh engine's answer for its image
    fresh = _llm(llm.config.model_path, block_size=4, enable_prefix_caching=False)
    for out, image in ((first, a), (other, b)):
        want = fresh.generate({"prompt": text, "multi_modal_data": {"image": image}}, _greedy(), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_image_cache_counts_and_reset_mm_cache(tiny_llava):
    llm = _llm(tiny_llava, enable_prefix_caching=False)
    engine = llm.llm_engine
    mm, enc = engine.input_processor.mm, engine.runner.encoder_cache
    a, b = _images()[:2]
    prompts = [
        {"prompt": f"USER: <image>\nQuestion {i}? ASSISTANT:", "multi_modal_data": {"image": im}}
        for i, im in enumerate([a, b, a, a.copy()])
    ]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(4), use_tqdm=False)]
    assert (mm.images_processed, enc.images_encoded) == (2, 2)  # two distinct images, four rows
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(4), use_tqdm=False)]
    assert again == first
    assert (mm.images_processed, enc.images_encoded) == (2, 2)  # every image from the caches
    llm.reset_mm_cache()
    assert not mm.cache and not enc.entries
    third = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(4), use_tqdm=False)]
    assert third == first
    assert (mm.images_processed, enc.images_encoded) == (4, 4)  # computed again after the reset
    # processor settings are part of the key: other kwargs, other pixels, computed anew
    other = {**prompts[0], "mm_processor_kwargs": {"do_normalize": False}}
    llm.generate(other, _greedy(2), use_tqdm=False)
    assert (mm.images_processed, enc.images_encoded) == (5, 5)


def test_vllm_prompt_forms_and_chat_parts(llava_llm, llava_want, tmp_path, smollm2_dir):
    import base64
    import io

    llm = llava_llm
    a = _images()[0]
    text, images = _mixed_requests()[0]
    # token ids with one image token, as vLLM takes them
    ids = llm.get_tokenizer().encode(text)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [a]}}, _greedy(), use_tqdm=False)
    assert out[0].outputs[0].token_ids == llava_want[0]
    assert len(out[0].prompt_token_ids) == len(ids) + 15  # the image token expanded to 16
    # chat: image_url (data: URL, path, file:// URL) and image_pil parts; the string-content
    # template gets "<image>\n" before the text, as vLLM renders it
    buf = io.BytesIO()
    a.save(buf, format="PNG")
    path = tmp_path / "a.png"
    path.write_bytes(buf.getvalue())
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    question = {"type": "text", "text": "What is this?"}
    parts = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_url", "image_url": {"url": str(path)}},
        {"type": "image_url", "image_url": {"url": "file://" + str(path)}},
        {"type": "image_pil", "image_pil": a},
    ]
    convs = [[{"role": "user", "content": [p, question]}] for p in parts]
    outs = llm.chat(convs, _greedy(), use_tqdm=False)
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "<image>\nWhat is this?"}], tokenize=False, add_generation_prompt=True
    )
    # a template that renders image parts itself gets Hugging Face's {"type": "image"} parts
    template = (
        "{% for m in messages %}{{ m['role'] }}: {% for p in m['content'] %}{% if p['type'] == 'image' %}"
        "<image>\n{% else %}{{ p['text'] }}{% endif %}{% endfor %}\n{% endfor %}ASSISTANT:"
    )
    own = llm.chat(convs[0], _greedy(), chat_template=template, use_tqdm=False)[0]
    hf_parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    own_text = tok.apply_chat_template(hf_parts, chat_template=template, tokenize=False)
    assert own.prompt == own_text and own_text.startswith("user: <image>\nWhat is this?")
    want, want_own = hf_llava_greedy(llm.config.model_path, [(rendered, [a]), (own_text, [a])], 8)
    assert [o.outputs[0].token_ids for o in outs] == [want] * 4
    assert own.outputs[0].token_ids == want_own


@pytest.mark.parametrize(
    "prompt,match",
    [
        ({"prompt": "<image> <image> <image>", "multi_modal_data": {"image": [1, 2, 3]}}, "limit_mm_per_prompt"),
        ({"prompt": "no placeholder", "multi_modal_data": {"image": "IMG"}}, "0 image placeholder token"),
        ({"prompt": "<image>", "multi_modal_data": {"image": b"not an image"}}, r"prompt 0: .*cannot decode"),
        ({"prompt": "<image>", "multi_modal_data": {"image": 42}}, "type int"),
        ({"prompt": "<image>", "multi_modal_data": {"video": "x"}}, "images only"),
        ({"prompt": "<image>", "multi_modal_data": "IMG"}, "must be a dict"),
    ],
)
def test_bad_image_inputs_are_refused_by_name(llava_llm, prompt, match):
    from dfllm import InvalidRequestError

    a = _images()[0]
    data = prompt.get("multi_modal_data")
    if isinstance(data, dict) and data.get("image") in ("IMG", [1, 2, 3]):
        prompt = {**prompt, "multi_modal_data": {"image": [a, a, a] if data["image"] == [1, 2, 3] else a}}
    with pytest.raises(InvalidRequestError, match=match):
        llava_llm.generate(prompt, _greedy(), use_tqdm=False)


def test_text_only_model_refuses_images(tiny_llama):
    from dfllm import LLM, InvalidRequestError

    llm = LLM(tiny_llama, kv_cache_memory_bytes=2**20, max_model_len=64)
    a = _images()[0]
    with pytest.raises(InvalidRequestError, match="takes no images"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": a}}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": a}]}], use_tqdm=False)
    llm.reset_mm_cache()  # nothing to reset: a no-op


def test_unsupported_llava_variants_are_refused(tmp_path, tiny_llava):
    import json
    import shutil

    from dfllm.config import EngineConfig
    from dfllm.engine_args import EngineArgs

    bad = tmp_path / "pixtral-llava"
    shutil.copytree(tiny_llava, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["vision_config"]["model_type"] = "pixtral"
    (bad / "config.json").write_text(json.dumps(cfg))
    from dfllm import LLM

    with pytest.raises(ValueError, match="'pixtral' vision tower is not supported"):
        LLM(bad, kv_cache_memory_bytes=2**20, max_model_len=64)
    cfg["vision_config"]["model_type"] = "clip_vision_model"
    cfg["text_config"]["model_type"] = "gemma"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'gemma' text model is not supported"):
        EngineConfig.create(EngineArgs(bad))


def test_qwen2_vl_vision_tower_matches_transformers():
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    from dfllm.models.vision.qwen2_vl_vision import Qwen2VisionTransformer

    torch.manual_seed(0)
    cfg = Qwen2VLConfig(
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=4,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        )
    ).vision_config
    hf = Qwen2VisionTransformerPretrainedModel(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = Qwen2VisionTransformer(cfg)
    missing = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not missing.missing_keys and not missing.unexpected_keys
    grids = [(1, 4, 6), (1, 2, 2), (2, 4, 4)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14)
    with torch.no_grad():
        want = hf(pixels, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(pixels, grids)
    want = torch.cat(list(want)) if isinstance(want, (list, tuple)) else want
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---- a tiny Qwen2-VL ----------------------------------------------------------------------------
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def build_tiny_qwen2_vl(root, tokenizer_dir, seed: int = 0, v25: bool = False):
    """A random Qwen2-VL (2-block vision tower, 14px patches, 2x2 merge; a 2-layer Qwen2 text model
    with mrope_section [2, 3, 3]) with the SmolLM2 tokenizer plus Qwen's vision tokens, and its
    image processor (56x56 to 112x112 pixels), saved in ``root``; ``v25``: Qwen2.5-VL (window
    attention over 56px windows in its first block, full attention in its second)."""
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    start, end, pad, video = tok.convert_tokens_to_ids(QWEN_TOKENS)
    vision = (
        dict(
            depth=2,
            hidden_size=32,
            intermediate_size=48,
            num_heads=4,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        )
        if v25
        else dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=4,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        )
    )
    config_cls, model_cls = (
        (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration)
        if v25
        else (Qwen2VLConfig, Qwen2VLForConditionalGeneration)
    )
    cfg = config_cls(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            initializer_range=0.2,
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
        vision_config=vision,
        image_token_id=pad,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                p.add_(torch.randn_like(p) * 0.2)
    path = root / ("tiny-qwen2.5-vl" if v25 else "tiny-qwen2-vl")
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def hf_qwen2_vl_greedy(path, requests, max_new_tokens: int):
    """transformers' Qwen2-VL ``generate`` (greedy), one request at a time; the image pad token
    expanded to each image's size as Qwen2VLProcessor does (its class needs torchvision here)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tok = AutoTokenizer.from_pretrained(path)
    ip = AutoImageProcessor.from_pretrained(path, backend="pil")
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    outs = []
    with torch.inference_mode():
        for text, images in requests:
            kw = {}
            ids = tok.encode(text)
            if images:
                kw = dict(ip(images=images, return_tensors="pt"))
                sizes = iter([int(g.prod()) // 4 for g in kw["image_grid_thw"]])
                ids = [x for t in ids for x in ([pad] * next(sizes) if t == pad else [t])]
            x = torch.tensor([ids])
            kw["mm_token_type_ids"] = (x == pad).int()
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                **kw,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


@pytest.fixture(scope="module")
def tiny_qwen2_vl(tmp_path_factory, smollm2_dir):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2vl"), smollm2_dir)


def _qwen_requests():
    a, b, c, d = _images()
    return [
        (f"USER: {QWEN_IMAGE}\nWhat is this? ASSISTANT:", [a]),
        (f"USER: {QWEN_IMAGE}\nWhat is this? ASSISTANT:", [b]),  # same text, another image (of another size)
        ("USER: only text here. ASSISTANT:", []),
        (f"USER: {QWEN_IMAGE} and {QWEN_IMAGE}, compare. ASSISTANT:", [c, d]),
    ]


@pytest.fixture(scope="module")
def qwen_want(tiny_qwen2_vl):
    return hf_qwen2_vl_greedy(tiny_qwen2_vl, _qwen_requests(), 8)


@pytest.mark.slow
def test_qwen2_vl_greedy_equals_transformers(tiny_qwen2_vl, qwen_want):
    a = _images()[0]
    requests, want = _qwen_requests(), qwen_want
    assert want[0] != want[1]
    llm = _llm(tiny_qwen2_vl)
    got = [o.outputs[0].token_ids for o in llm.generate(_prompts(requests), _greedy(), use_tqdm=False)]
    assert got == want
    # chunked prefill (5-token chunks split the images' placeholders) and preemption (a tight cache)
    block = 2 * 4 * 2 * 16 * 2 * 4
    small = _llm(
        tiny_qwen2_vl, max_num_batched_tokens=5, max_model_len=48, block_size=4, kv_cache_memory_bytes=13 * block
    )
    small.llm_engine.scheduler.reserve_growth = False
    got = [o.outputs[0].token_ids for o in small.generate(_prompts(requests), _greedy(), use_tqdm=False)]
    assert got == want
    assert small.llm_engine.scheduler.stats().num_preemptions > 0
    # chat image parts become <|vision_start|><|image_pad|><|vision_end|> before the text
    out = llm.chat(
        [
            {
                "role": "user",
                "content": [{"type": "image_pil", "image_pil": a}, {"type": "text", "text": "What is this?"}],
            }
        ],
        _greedy(),
        use_tqdm=False,
    )
    rendered = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": f"{QWEN_IMAGE}\nWhat is this?"}], tokenize=False, add_generation_prompt=True
    )
    assert out[0].outputs[0].token_ids == hf_qwen2_vl_greedy(tiny_qwen2_vl, [(rendered, [a])], 8)[0]


@pytest.mark.slow
def test_parallel_ranks_replicate_the_vision_tower(tiny_llava, llava_want, tiny_qwen2_vl, qwen_want):
    """Tensor parallel LLaVA and pipeline parallel Qwen2-VL (worker processes, gloo on CPU): rank 0
    encodes the images, the text model is split; the same tokens as transformers'."""
    llm = _llm(tiny_llava, tensor_parallel_size=2, max_num_batched_tokens=24)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(_prompts(_mixed_requests()), _greedy(), use_tqdm=False)]
        assert got == llava_want
    finally:
        llm.shutdown()
    llm = _llm(tiny_qwen2_vl, pipeline_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(_prompts(_qwen_requests()), _greedy(), use_tqdm=False)]
        assert got == qwen_want
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_llava_checkpoint_name_forms(tmp_path, tiny_llava, llava_want):
    """transformers 4's tensor names (``vision_tower.vision_model.*``, as llava-hf checkpoints) and
    5's in-memory ones (``model.language_model.*``, ``model.vision_tower.*``) load alike."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_llava / "model.safetensors"))
    forms = {
        "v4": lambda k: k.replace("vision_tower.", "vision_tower.vision_model.", 1),
        "v5": lambda k: (
            "model." + k
            if k.startswith(("vision_tower.", "multi_modal_projector."))
            else k.replace("language_model.model.", "model.language_model.", 1).replace(
                "language_model.lm_head.", "lm_head.", 1
            )
        ),
    }
    requests = _mixed_requests()[:1]
    for name, rename in forms.items():
        path = tmp_path / name
        shutil.copytree(tiny_llava, path)
        save_file({rename(k): v for k, v in tensors.items()}, str(path / "model.safetensors"))
        llm = _llm(path)
        assert [
            o.outputs[0].token_ids for o in llm.generate(_prompts(requests), _greedy(), use_tqdm=False)
        ] == llava_want[:1], name


def test_qwen25_vl_vision_tower_matches_transformers():
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from dfllm.models.loader import load_weights
    from dfllm.models.vision.qwen2_vl_vision import Qwen25VisionTransformer

    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=48,
            num_heads=4,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        )
    ).vision_config
    hf = Qwen2_5_VisionTransformerPretrainedModel(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    import tempfile
    from pathlib import Path

    ours = Qwen25VisionTransformer(cfg)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        load_weights(ours, Path(d))  # gate_proj/up_proj fused by the loader
    grids = [(1, 12, 8), (1, 2, 2), (2, 4, 6)]  # windows of 2x2 merge units: some padded
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14)
    with torch.no_grad():
        want = hf(pixels, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(pixels, grids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_qwen25_vl_greedy_equals_transformers(tmp_path, smollm2_dir):
    path = build_tiny_qwen2_vl(tmp_path, smollm2_dir, v25=True)
    a, b, c, d = _images()
    requests = [
        (f"USER: {QWEN_IMAGE}\nWhat is this? ASSISTANT:", [d]),  # 112x112: four 56px windows
        (f"USER: {QWEN_IMAGE} and {QWEN_IMAGE}? ASSISTANT:", [b, c]),
        ("USER: text only. ASSISTANT:", []),
    ]
    want = hf_qwen2_vl_greedy(path, requests, 8)
    llm = _llm(path, max_num_batched_tokens=7)
    assert [o.outputs[0].token_ids for o in llm.generate(_prompts(requests), _greedy(), use_tqdm=False)] == want
