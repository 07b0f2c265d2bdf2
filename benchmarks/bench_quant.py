"""What ``quantization="int8"`` (and ``dtype="bfloat16"``) cost in quality and gain in speed
on CPU, on the bundled SmolLM2 (``LLM(None)``).

Quality, against the same model in float32:

- prompt log-probabilities of a fixed text (``--text-tokens``, default 256 tokens):
  the mean and max absolute difference of each token's log-probability, and how often the
  most likely next token agrees (``SamplingParams(prompt_logprobs=1)``);
- greedy generation on a few chat prompts (``--greedy-tokens`` each): the tokens equal to
  float32's until the first divergence, how many rows are identical, and whether every
  divergence is a near tie (each side's token in the other's top-5 there).

Speed: generated tokens per second of one ``generate`` call over a fixed batch
(``--num-prompts`` chat prompts from ``bench_generate``'s workload, each forced to
``--max-tokens`` tokens; prefill included), after a warm-up call, and the float32 matmul
ceiling of ``bench_generate.matmul_ceiling`` at the batch size. int8 is printed as a ratio to
float32 and to that ceiling.

Run: ``python benchmarks/bench_quant.py`` (a few minutes on 2 cores; the speed figures are
only meaningful on a quiet machine).

Measured 2026-12-01 on a 2-core Xeon with AVX512-VNNI (``--num-prompts 32 --max-tokens 16
--greedy-tokens 32 --text-tokens 256``, machine shared with other jobs, so tok/s are noisy):
int8 mean/max |delta logprob| 0.199/0.945 nats, top-1 agreement 0.871, greedy prefix 12.2 of
32 tokens (every divergence a near tie: top-5 criterion holds), 2.3x float32's tok/s; bf16
0.035/0.152, 0.980, 21.2 of 32, 1.1x.

Measured 2026-12-04 on a 2-core AMD EPYC with AVX2 only (same arguments, idle): int8 with
7-bit weights (this CPU's kernel has no VNNI) 0.220/1.164 nats, top-1 agreement 0.867, top-5
criterion holds, 1.27-1.44x float32's tok/s; before, with 7-bit activations, 0.388/1.570,
0.780, the criterion broken on 2 of 6 chats. bf16 (emulated here) 0.032/0.175, 0.961, 0.17x.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from bench_generate import build_workload, matmul_ceiling

from dfllm import LLM, SamplingParams

TEXT = (
    "The river town woke slowly. Fishermen pulled their boats onto the gravel, and the baker on the corner "
    "opened his shutters to let the smell of bread drift across the square. Children ran to school along the "
    "old stone bridge, counting the swans that nested under its arches every spring. In the library, the "
    "librarian sorted a box of letters found in an attic: notes about harvests, weddings, storms and the "
    "price of salt, written by people whose names no one remembered. She read them carefully, because each "
    "one described a small piece of a world that had vanished. One letter explained how the villagers had "
    "repaired the mill after the great flood of the winter, carrying stones from the quarry on their backs "
    "and working at night by the light of lanterns. Another described a traveling teacher who came every "
    "summer with a cart full of books, maps and a telescope, and who taught the children to measure the "
    "height of the mountain by the length of its shadow. The librarian decided to collect the letters into "
    "a small book, so that the town would remember how much its people had built, shared and protected "
    "together. When the book was finished, she placed a copy in the window of the library, and by evening a "
    "line of neighbors had formed outside, each hoping to find the name of a grandmother, a cousin or a "
    "forgotten friend among its pages. Some of them laughed at the old complaints about the weather; others "
    "were quiet for a long time after reading a letter about a child who had crossed the mountain alone to "
    "fetch a doctor during the fever year."
)

CHATS = [
    "What is the capital of France, and why is it famous?",
    "Explain in a few sentences how a bicycle stays upright.",
    "Give me three tips for keeping a garden healthy in summer.",
    "Write a short poem about the ocean at night.",
    "How do vaccines train the immune system?",
    "What is the difference between weather and climate?",
]

VARIANTS = (("fp32", {}), ("int8", {"quantization": "int8"}), ("bf16", {"dtype": "bfloat16"}))


def make_llm(kwargs: dict, max_num_seqs: int) -> LLM:
    return LLM(None, max_model_len=1024, max_num_seqs=max_num_seqs, kv_cache_memory_bytes=512 * 2**20, **kwargs)


def prompt_logprobs(llm: LLM, ids: list[int]) -> tuple[list[float], list[int]]:
    """Each prompt token's log-probability (from the second) and the most likely token there."""
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.prompt_logprobs is not None
    own, top = [], []
    for tok, entry in zip(ids[1:], out.prompt_logprobs[1:]):
        assert entry is not None
        own.append(entry[tok].logprob)
        top.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return own, top


def greedy(llm: LLM, n: int) -> list[tuple[list[int], list[dict]]]:
    """Greedy tokens and their top-5 log-probabilities, one row per chat prompt."""
    params = SamplingParams(temperature=0, max_tokens=n, logprobs=5, ignore_eos=True)
    outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs or [])) for o in outs]


def agreement(ref: list[tuple[list[int], list[dict]]], other: list[tuple[list[int], list[dict]]]) -> dict:
    """Tokens equal until the first divergence (mean over rows), identical rows, and whether at
    every divergence each side's token is in the other's top-5."""
    prefixes, identical, near_ties = [], 0, 0
    for (a, la), (b, lb) in zip(ref, other):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            identical += 1
            prefixes.append(min(len(a), len(b)))
            continue
        prefixes.append(k)
        near_ties += a[k] in lb[k] and b[k] in la[k]
    diverged = len(ref) - identical
    return {
        "prefix": statistics.mean(prefixes),
        "identical": identical,
        "rows": len(ref),
        "top5_ok": near_ties == diverged,
        "near_ties": near_ties,
        "diverged": diverged,
    }


def speed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Generated tokens per second of one greedy call over ``prompts`` (after a warm-up)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def machine() -> str:
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text-tokens", type=int, default=256)
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    results: dict[str, dict] = {}
    ceiling = None
    for name, kwargs in VARIANTS:
        llm = make_llm(kwargs, args.num_prompts)
        tok = llm.get_tokenizer()
        ids = tok.encode(TEXT, add_special_tokens=False)[: args.text_tokens]
        prompts, _ = build_workload(tok, args.num_prompts)
        own, top = prompt_logprobs(llm, ids)
        results[name] = {
            "own": own,
            "top": top,
            "greedy": greedy(llm, args.greedy_tokens),
            "tok_s": speed(llm, prompts, args.max_tokens),
        }
        if ceiling is None:
            ceiling = matmul_ceiling(llm.config.hf_config, args.num_prompts)["tok_s"]
        del llm
        gc.collect()

    ref = results["fp32"]
    print(
        f"SmolLM2-135M (bundled), {len(ids)}-token text, {len(CHATS)} chats x {args.greedy_tokens} greedy "
        f"tokens, {args.num_prompts} prompts x {args.max_tokens} tokens for speed"
    )
    print(
        f"{'variant':8} {'mean|dlp|':>10} {'max|dlp|':>9} {'top1 agree':>10} {'greedy prefix':>14} "
        f"{'identical':>9} {'top-5 ok':>8} {'tok/s':>8} {'x fp32':>7} {'x ceiling':>9}"
    )
    for name, r in results.items():
        deltas = [abs(a - b) for a, b in zip(r["own"], ref["own"])]
        top1 = sum(a == b for a, b in zip(r["top"], ref["top"])) / len(ref["top"])
        g = agreement(ref["greedy"], r["greedy"])
        ok = "yes" if g["top5_ok"] else f"{g['near_ties']}/{g['diverged']}"
        print(
            f"{name:8} {statistics.mean(deltas):10.4f} {max(deltas):9.4f} {top1:10.3f} "
            f"{g['prefix']:8.1f}/{args.greedy_tokens:<5} {g['identical']:>3}/{g['rows']:<5} {ok:>8} "
            f"{r['tok_s']:8.1f} {r['tok_s'] / ref['tok_s']:7.2f} {r['tok_s'] / ceiling:9.2f}"
        )
    print(f"fp32 matmul ceiling at batch {args.num_prompts}: {ceiling:.1f} tok/s")
    print(f"{datetime.date.today().isoformat()} on {machine()}")


if __name__ == "__main__":
    main()
