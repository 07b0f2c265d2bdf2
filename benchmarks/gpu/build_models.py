"""Random-weight models for the GPU check, built where they run, with SmolLM2's real tokenizer.

The GPU machine has no network and what travels to it is small, so no checkpoint goes there:
each model is built from a config, its weights drawn with a fixed seed at standard deviation
0.2 (Hugging Face's 0.02 gives near-uniform logits, whose greedy near-ties flip between any two
kernels; at 0.2 the logits are peaked, so equality checks between two dfllm paths mean
something), saved as safetensors in the check's dtype, with the tokenizer files beside it.

    python benchmarks/gpu/build_models.py OUT_DIR --tokenizer DIR [--models smollm2 llama-1b] [--dtype bfloat16]

Shapes (``SHAPES``): ``smollm2`` is SmolLM2-135M's (hidden 576, 30 layers, 9/3 heads, MLP
1536), ``llama-1b`` Llama-3.2-1B's (hidden 2048, 16 layers, 32/8 heads of 64, MLP 8192) with
SmolLM2's 49,152-token vocabulary, ``tiny`` a 2-layer model of hidden 64 for the ``--cpu`` dry run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
VOCAB = 49152  # SmolLM2's tokenizer
STD = 0.2  # peaked logits (module docstring)

SHAPES: dict[str, dict] = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "smollm2": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
    ),
}


def build(name: str, out: Path, tokenizer: Path, dtype: torch.dtype, device: str, seed: int = 0) -> Path:
    """Save the random ``name`` model (a Llama) with the tokenizer files into ``out/name``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        initializer_range=STD,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        rope_theta=100000.0,
        **SHAPES[name],
    )
    torch.manual_seed(seed)
    with torch.device(device):  # drawing a billion weights is seconds on a GPU, a minute on 2 cores
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.to(dtype)
    path = out / name
    model.save_pretrained(path)
    for f in TOKENIZER_FILES:
        if (tokenizer / f).exists():
            shutil.copy(tokenizer / f, path / f)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a directory with SmolLM2's tokenizer files")
    ap.add_argument("--models", nargs="+", default=["smollm2", "llama-1b"], choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    built = {}
    for name in args.models:
        t0 = time.perf_counter()
        path = build(name, args.out, args.tokenizer, getattr(torch, args.dtype), args.device)
        built[name] = {"path": str(path), "seconds": round(time.perf_counter() - t0, 1), **SHAPES[name]}
        print(f"built {name} in {built[name]['seconds']} s: {path}", flush=True)
    (args.out / "models.json").write_text(json.dumps(built, indent=2))


if __name__ == "__main__":
    main()
