"""Offline generation throughput: dfllm vs Hugging Face transformers, same workload, same run.

Workload
--------
``--num-prompts`` (default 128) chat prompts built deterministically from a seeded RNG: a
mix of short questions and longer instructions carrying a paragraph of words drawn from a
fixed word list, rendered through the tokenizer's chat template with
``add_generation_prompt=True`` (about 30-300 prompt tokens each). Every prompt has its own
``max_tokens`` drawn uniformly from [16, 128]. Decoding is greedy (temperature 0) in
float32 and both engines are forced to generate exactly ``max_tokens`` tokens per prompt
(dfllm: ``ignore_eos=True``; transformers: ``min_new_tokens``).

- dfllm: one ``llm.generate`` call over all pre-tokenized prompts with per-prompt
  ``SamplingParams``, after a short warm-up call (the prefix cache is reset before each
  timed run so that repeats do not reuse a previous run's prompts).
- transformers: ``AutoModelForCausalLM`` on the same checkpoint, static batches of
  ``--hf-batch-size`` prompts in input order, left padding, ``model.generate`` with
  ``max_new_tokens = min_new_tokens =`` the batch's largest ``max_tokens``, under
  ``torch.inference_mode``, after one warm-up batch. A static batch runs until its
  longest request is done; only each prompt's own ``max_tokens`` count as output.

Throughput is useful generated tokens / wall seconds. The script also prints the fraction
of prompts whose dfllm tokens equal transformers' first ``max_tokens`` tokens (compared up
to dfllm's first end-of-sequence token, which transformers' ``min_new_tokens`` forbids),
and a matmul ceiling: float32 ``torch.mm`` FLOP/s measured on the model's decode GEMM
shapes at batch 128, divided by the model's matmul FLOPs per token (2 x linear-layer
parameters, lm_head included).

Run (from the repository root)::

    python benchmarks/bench_generate.py                      # full run, 128 prompts
    python benchmarks/bench_generate.py --num-prompts 16     # quick check
    python benchmarks/bench_generate.py --repeats 3 --json bench.json

Run it on an otherwise idle machine: with other processes competing for the cores, torch's
thread pool is oversubscribed and both engines (and the ceiling) slow down a lot
(``--threads`` sets torch's thread count for everything measured).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from dfllm import LLM, SamplingParams

SEED = 1234
MIN_NEW, MAX_NEW = 16, 128
CEILING_BATCH = 128

WORDS = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book
eye job word business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body information back
parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education river garden engine
bridge market signal network window planet forest ocean mountain village library machine
theory energy pattern memory language music picture science season winter summer harvest
simple quiet rapid ancient modern bright careful gentle heavy hidden honest narrow obvious
patient private public rare rough silent strange sudden useful warm wild build carry choose
describe explain follow gather improve measure notice prepare protect reach remember repair
share support travel visit wonder compare balance collect design observe predict translate
""".split()

QUESTIONS = [
    "What is the difference between a {0} and a {1}?",
    "Why does a {0} need {1}?",
    "How can I {2} my {0} before the {1} season?",
    "Give me three facts about the {0}.",
    "Can you {2} how a {0} works?",
    "What should a {0} know about {1}?",
]

INSTRUCTIONS = [
    "Summarize the following notes in a few sentences.",
    "Rewrite the text below as a short, clear paragraph.",
    "Read the passage below and list its main ideas.",
    "Translate the following notes into plain English and explain them.",
    "Write a short story inspired by the words below.",
]

VERBS = "build carry choose describe explain follow gather improve measure protect repair".split()


# ---- workload ----------------------------------------------------------------------------
def make_messages(rng: random.Random) -> list[dict]:
    """One chat: a short question (40%) or an instruction with a paragraph of 20-200 words."""
    if rng.random() < 0.4:
        text = rng.choice(QUESTIONS).format(rng.choice(WORDS), rng.choice(WORDS), rng.choice(VERBS))
    else:
        n = rng.randint(20, 200)
        sentences, words = [], [rng.choice(WORDS) for _ in range(n)]
        while words:
            k = rng.randint(5, 14)
            chunk, words = words[:k], words[k:]
            sentences.append(" ".join(chunk).capitalize() + ".")
        text = rng.choice(INSTRUCTIONS) + "\n\n" + " ".join(sentences)
    return [{"role": "user", "content": text}]


def build_workload(tokenizer, num_prompts: int, seed: int = SEED) -> tuple[list[list[int]], list[int]]:
    """Token ids of the chat-rendered prompts and each prompt's max_tokens."""
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for _ in range(num_prompts):
        text = tokenizer.apply_chat_template(make_messages(rng), tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
        max_tokens.append(rng.randint(MIN_NEW, MAX_NEW))
    return prompts, max_tokens


# ---- dfllm -------------------------------------------------------------------------------
def reset_prefix_cache(llm: LLM) -> None:
    """Forget cached prompt blocks, so a timed run never reuses a previous run's prompts."""
    llm.reset_prefix_cache()


def run_dfllm(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]]]:
    """Seconds for one generate call over all prompts, and the generated ids."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    reset_prefix_cache(llm)
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


def warm_up_dfllm(llm: LLM, tokenizer) -> None:
    prompts, _ = build_workload(tokenizer, 4, seed=SEED + 1)
    run_dfllm(llm, prompts, [8] * len(prompts))


# ---- transformers ------------------------------------------------------------------------
def load_hf(path, device: str = "cpu") -> tuple[torch.nn.Module, object]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def hf_batch(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """One static, left-padded batch; every row generates exactly ``new_tokens`` tokens."""
    enc = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(model.device)
    out = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    return out[:, enc["input_ids"].shape[1]:].tolist()


@torch.inference_mode()
def run_hf(model, tokenizer, prompts: list[list[int]], max_tokens: list[int],
           batch_size: int) -> tuple[float, list[list[int]]]:
    """Seconds for all static batches in input order, and each prompt's generated ids."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outputs += hf_batch(model, tokenizer, prompts[i:i + batch_size], max(max_tokens[i:i + batch_size]))
    seconds = time.perf_counter() - start
    return seconds, outputs


def warm_up_hf(model, tokenizer) -> None:
    prompts, _ = build_workload(tokenizer, 4, seed=SEED + 1)
    run_hf(model, tokenizer, prompts, [8] * len(prompts), batch_size=4)


def match_fraction(df_outs, hf_outs, max_tokens, eos_ids) -> tuple[float, int, int]:
    """Fraction of compared prompts whose dfllm ids equal transformers' first max_tokens ids.

    Only tokens before dfllm's first EOS are compared: with ``min_new_tokens`` transformers
    masks EOS, so the two continuations legitimately part there. Returns (fraction,
    prompts compared, prompts in which dfllm produced an EOS).
    """
    same = compared = hit_eos = 0
    for df, hf, n in zip(df_outs, hf_outs, max_tokens):
        cut = next((j for j, t in enumerate(df) if t in eos_ids), len(df))
        hit_eos += cut < len(df)
        if cut == 0 or not hf:
            continue
        compared += 1
        same += df[:cut] == hf[:n][:cut]
    return (same / compared if compared else float("nan")), compared, hit_eos


# ---- matmul ceiling ----------------------------------------------------------------------
def linear_shapes(cfg) -> list[tuple[int, int, int]]:
    """(in_features, out_features, count) of every linear layer of a Llama/Qwen-style model."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return [
        (h, heads * head_dim, layers),      # q_proj
        (h, kv * head_dim, 2 * layers),     # k_proj, v_proj
        (heads * head_dim, h, layers),      # o_proj
        (h, inter, 2 * layers),             # gate_proj, up_proj
        (inter, h, layers),                 # down_proj
        (h, cfg.vocab_size, 1),             # lm_head (tied or not, it is a matmul)
    ]


def flops_per_token(cfg) -> int:
    return sum(2 * k * n * c for k, n, c in linear_shapes(cfg))


def time_mm(m: int, k: int, n: int, reps: int = 7) -> float:
    """Median seconds of a float32 [m, k] x [k, n] torch.mm."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(2):
        torch.mm(a, b)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_ceiling(cfg, batch: int = CEILING_BATCH) -> dict:
    """FLOP/s of the model's decode GEMMs at ``batch`` rows (weighted by how often each
    shape occurs in a forward pass), and the tokens/s that would allow."""
    total_flops = total_secs = 0.0
    for k, n, count in linear_shapes(cfg):
        total_flops += 2 * batch * k * n * count
        total_secs += time_mm(batch, k, n) * count
    flop_s = total_flops / total_secs
    per_token = flops_per_token(cfg)
    return {"batch": batch, "flop_s": flop_s, "flops_per_token": per_token, "tok_s": flop_s / per_token}


# ---- report ------------------------------------------------------------------------------
def summarize(name: str, secs: list[float], tokens: int) -> dict:
    s = statistics.median(secs)
    return {"engine": name, "tokens": tokens, "seconds": s, "tok_s": tokens / s, "all_seconds": secs}


def print_report(results: list[dict], ceiling: dict, meta: dict, match) -> None:
    print()
    print(f"{'engine':<14}{'gen tokens':>12}{'seconds':>10}{'tok/s':>10}")
    for r in results:
        print(f"{r['engine']:<14}{r['tokens']:>12}{r['seconds']:>10.2f}{r['tok_s']:>10.1f}")
    if len(results) == 2:
        print(f"ratio dfllm/transformers: {results[0]['tok_s'] / results[1]['tok_s']:.2f}x")
    if match is not None:
        frac, compared, eos = match
        print(f"greedy match vs transformers: {frac:.3f} of {compared} prompts "
              f"(dfllm emitted EOS in {eos}; compared up to it)")
    print(f"matmul FLOP/s (float32, decode GEMMs at batch {ceiling['batch']}): {ceiling['flop_s'] / 1e9:.1f} GFLOP/s; "
          f"{ceiling['flops_per_token'] / 1e6:.1f} MFLOP/token")
    print(f"matmul ceiling: {ceiling['tok_s']:.1f} tok/s")
    print(f"date {meta['date']}, torch {meta['torch']}, transformers {meta['transformers']}, "
          f"CPUs {meta['cpu_count']} (torch threads {meta['torch_threads']}), {meta['machine']}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--model", default=None, help="model directory or bundled alias (default: bundled SmolLM2)")
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1,
                   help="run each engine this many times, alternately; report medians")
    p.add_argument("--skip-hf", action="store_true", help="run dfllm only")
    p.add_argument("--device", default="auto",
                   help="'auto' (CUDA when available), 'cpu' or 'cuda'; both engines use it")
    p.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for both engines and the ceiling (default: torch's choice)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype="float32", device=args.device)
    tokenizer = llm.get_tokenizer()
    prompts, max_tokens = build_workload(tokenizer, args.num_prompts)
    useful = sum(max_tokens)
    lens = sorted(len(p) for p in prompts)
    print(f"workload: {len(prompts)} prompts, prompt tokens {lens[0]}-{lens[-1]} (median {lens[len(lens) // 2]}, "
          f"total {sum(lens)}), max_tokens {min(max_tokens)}-{max(max_tokens)}, {useful} tokens to generate")

    warm_up_dfllm(llm, tokenizer)
    hf = None if args.skip_hf else load_hf(llm.config.model_path, str(llm.config.device))
    if hf:
        warm_up_hf(*hf)

    df_secs, hf_secs, df_outs, hf_outs = [], [], None, None
    for r in range(args.repeats):
        secs, outs = run_dfllm(llm, prompts, max_tokens)
        df_secs.append(secs)
        df_outs = df_outs or outs
        assert [len(o) for o in outs] == max_tokens, "dfllm did not generate exactly max_tokens per prompt"
        print(f"run {r + 1}: dfllm {secs:.2f}s ({useful / secs:.1f} tok/s)", end="", flush=True)
        if hf:
            secs, outs = run_hf(*hf, prompts, max_tokens, args.hf_batch_size)
            hf_secs.append(secs)
            hf_outs = hf_outs or outs
            print(f", transformers {secs:.2f}s ({useful / secs:.1f} tok/s)", end="")
        print()

    results = [summarize("dfllm", df_secs, useful)]
    match = None
    if hf:
        results.append(summarize("transformers", hf_secs, useful))
        eos_ids = getattr(llm.engine, "eos_token_ids", None) or {tokenizer.eos_token_id}
        match = match_fraction(df_outs, hf_outs, max_tokens, eos_ids)
    ceiling = matmul_ceiling(llm.config.hf_config)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine()}
    print_report(results, ceiling, meta, match)

    if args.json:
        figures = {"args": vars(args), "results": results, "ceiling": ceiling, "meta": meta,
                   "ratio": results[0]["tok_s"] / results[1]["tok_s"] if hf else None,
                   "match": None if match is None else dict(zip(("fraction", "compared", "dfllm_eos"), match))}
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
