"""LLM(tensor_parallel_size=2) against one rank: the same greedy tokens (float32) and tok/s of each.

python benchmarks/gpu/tp_check.py OUT_DIR {cuda,cpu}   # writes OUT_DIR/tp.json
"""

import gc
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from dfllm import LLM, SamplingParams
from dfllm.models.bundled import resolve_model


def run(model_dir, tok_dir, device, tp, prompts, params):
    """(generated ids, tok/s) of one LLM with ``tp`` ranks, stopped afterwards."""
    cuda = device == "cuda"
    llm = LLM(
        model_dir,
        tokenizer=tok_dir,
        device=device,
        dtype="float32",
        tensor_parallel_size=tp,
        kv_cache_memory_bytes=(1 << 30) if cuda else (64 << 20),
        max_model_len=512,
    )
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t0
    llm.shutdown()
    del llm
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in outs], len(prompts) * params.max_tokens / secs


def main():
    out, device = Path(sys.argv[1]), sys.argv[2]
    cuda = device == "cuda"
    # SmolLM2's 9 heads do not split in two: a random Llama (std 0.2: peaked logits) with its tokenizer
    tok_dir = resolve_model("smollm2-135m-instruct")
    hidden, layers = (1024, 8) if cuda else (128, 2)
    cfg = LlamaConfig(
        vocab_size=49155,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model_dir = out / "tp-llama"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(model_dir)
    g = torch.Generator().manual_seed(1)
    n_prompts, max_tokens = (32, 64) if cuda else (4, 12)
    prompts = [
        {"prompt_token_ids": torch.randint(20, 49152, (int(n),), generator=g).tolist()}
        for n in torch.randint(8, 200 if cuda else 40, (n_prompts,), generator=g)
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    one, one_tok_s = run(model_dir, tok_dir, device, 1, prompts, params)
    two, two_tok_s = run(model_dir, tok_dir, device, 2, prompts, params)
    same = sum(a == b for a, b in zip(one, two))
    res = {
        "prompts": n_prompts,
        "max_tokens": max_tokens,
        "identical": same,
        "tp1_tok_s": one_tok_s,
        "tp2_tok_s": two_tok_s,
        "backend": "nccl" if cuda else "gloo",
        "model": f"random Llama h{hidden} x{layers} layers, 8/4 heads, fp32",
    }
    json.dump(res, open(out / "tp.json", "w"), indent=2)
    print(json.dumps(res))
    # NCCL's reduction order may flip a near-tie: one prompt in eight may part
    if same < 0.875 * n_prompts:
        sys.exit(f"tp=2 differs from one rank on {n_prompts - same} of {n_prompts} prompts")


if __name__ == "__main__":  # the ranks are spawned: they import this file again
    main()
