"""Images in the batch: dfllm vs transformers on the same 256 image rows, same run.

Workload: ``--rows`` (default 256) rows, each with one image drawn from ``--distinct``
(default 160) seeded random RGB images of mixed sizes (24 to 160 pixels a side, so the
image processor resizes and crops every one), so that some images repeat (the rest of the
rows). Two tiny random models, built as the tests build them and saved as real Hugging Face
directories:

- LLaVA (a CLIP tower of 2 layers, hidden 64, 32 px images in patches of 8; a Llama of 2
  layers, hidden 64): a caption of ``--max-tokens`` (default 16) greedy tokens per row,
  ``LLM.generate`` with ``multi_modal_data`` vs transformers' ``generate`` in batches of
  ``--hf-batch`` (default 16, left-padded, through ``LlavaProcessor``);
- CLIP (the same tower, a 2-layer text tower): an image embedding per row, ``LLM.embed``
  vs transformers' ``get_image_features`` in batches of 32 (through ``CLIPImageProcessor``).

Printed: images/s and generated tokens/s of each, their ratio, whether dfllm's greedy
tokens equal transformers' row for row (and the minimum cosine of the embeddings), and the
share of image encodings the caches saved (images encoded vs rows with an image). Every
engine runs in float32 on the CPU; transformers' processor and dfllm's are the same Pillow
image processor. These tiny models measure overheads (decoding, preprocessing, batching,
scheduling), not the matmuls of a real vision model.

    python benchmarks/bench_images.py
    python benchmarks/bench_images.py --rows 64 --distinct 40     # quick check
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def images(rows: int, distinct: int, seed: int = 0) -> list[Image.Image]:
    """``rows`` images, ``distinct`` of them different (mixed sizes), repeats spread out."""
    rng = np.random.default_rng(seed)
    pool = []
    for _ in range(distinct):
        w, h = (int(v) for v in rng.integers(24, 161, 2))
        pool.append(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
    order = list(range(distinct)) + [int(v) for v in rng.integers(0, distinct, rows - distinct)]
    rng.shuffle(order)
    return [pool[k] for k in order[:rows]]


def bench_llava(path: Path, imgs: list[Image.Image], max_tokens: int, hf_batch: int) -> dict:
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    from dfllm import LLM, SamplingParams

    prompts = [f"<image>\nDescribe item {i}:" for i in range(len(imgs))]
    llm = LLM(model=path, max_model_len=256)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    warm = Image.new("RGB", (40, 40), (120, 30, 200))
    llm.generate({"prompt": "<image>\nWarm up:", "multi_modal_data": {"image": warm}}, sp, use_tqdm=False)
    llm.reset_mm_cache()
    cache = llm.engine.runner.encoder_cache
    encoded0 = cache.images_encoded
    start = time.perf_counter()
    outs = llm.generate(
        [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, imgs)], sp, use_tqdm=False
    )
    ours = time.perf_counter() - start
    encoded = cache.images_encoded - encoded0

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    proc = LlavaProcessor.from_pretrained(path, backend="pil")
    proc.tokenizer.padding_side = "left"
    if proc.tokenizer.pad_token is None:
        proc.tokenizer.pad_token = proc.tokenizer.eos_token
    theirs_tokens: list[list[int]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(prompts), hf_batch):
            inputs = proc(
                text=prompts[b : b + hf_batch], images=imgs[b : b + hf_batch], padding=True, return_tensors="pt"
            )
            out = model.generate(
                **inputs, max_new_tokens=max_tokens, do_sample=False, pad_token_id=proc.tokenizer.pad_token_id
            )
            theirs_tokens += out[:, inputs["input_ids"].shape[1] :].tolist()
    theirs = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    same = sum(list(o.outputs[0].token_ids) == t for o, t in zip(outs, theirs_tokens))
    return {
        "rows": len(imgs),
        "dfllm_s": round(ours, 3),
        "hf_s": round(theirs, 3),
        "dfllm_images_per_s": round(len(imgs) / ours, 1),
        "hf_images_per_s": round(len(imgs) / theirs, 1),
        "dfllm_tokens_per_s": round(tokens / ours, 1),
        "hf_tokens_per_s": round(tokens / theirs, 1),
        "speedup": round(theirs / ours, 2),
        "rows_equal_to_hf": same,
        "images_encoded": encoded,
        "encodings_saved": round(1 - encoded / len(imgs), 3),
    }


def bench_clip(path: Path, imgs: list[Image.Image]) -> dict:
    from transformers import AutoImageProcessor, CLIPModel

    from dfllm import LLM, PoolingParams

    llm = LLM(model=path, runner="pooling")
    engine = llm.pooling_engine
    llm.embed({"multi_modal_data": {"image": Image.new("RGB", (40, 40), (120, 30, 200))}}, use_tqdm=False)  # warm-up
    engine.reset_mm_cache()
    before = engine.image_stats["encoded"]
    start = time.perf_counter()
    outs = llm.embed(
        [{"multi_modal_data": {"image": im}} for im in imgs], PoolingParams(normalize=False), use_tqdm=False
    )
    ours = time.perf_counter() - start
    encoded = engine.image_stats["encoded"] - before

    model = CLIPModel.from_pretrained(path, dtype=torch.float32).eval()
    proc = AutoImageProcessor.from_pretrained(path, backend="pil")
    feats = []
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(imgs), 32):
            pixels = proc(images=imgs[b : b + 32], return_tensors="pt")["pixel_values"]
            feats.append(model.get_image_features(pixel_values=pixels).pooler_output)
    theirs = time.perf_counter() - start
    ref = torch.cat(feats)
    got = torch.tensor([o.outputs.embedding for o in outs])
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    return {
        "rows": len(imgs),
        "dfllm_s": round(ours, 3),
        "hf_s": round(theirs, 3),
        "dfllm_images_per_s": round(len(imgs) / ours, 1),
        "hf_images_per_s": round(len(imgs) / theirs, 1),
        "speedup": round(theirs / ours, 2),
        "min_cosine_to_hf": round(float(cos.min()), 6),
        "images_encoded": encoded,
        "encodings_saved": round(1 - encoded / len(imgs), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--distinct", type=int, default=160)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--hf-batch", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    from dfllm.models.bundled import resolve_model

    from image_data import build_tiny_clip, build_tiny_llava

    root = Path(tempfile.mkdtemp(prefix="bench_images_"))
    llava = build_tiny_llava(root, resolve_model("smollm2-135m-instruct"))
    clip = build_tiny_clip(root, "clip")
    imgs = images(args.rows, args.distinct)
    result = {
        "date": datetime.now().strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}",
        "distinct_images": args.distinct,
        "llava_generate": bench_llava(llava, imgs, args.max_tokens, args.hf_batch),
        "clip_embed": bench_clip(clip, imgs),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
