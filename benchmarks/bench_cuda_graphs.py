"""Decode throughput with CUDA graphs vs ``enforce_eager=True`` (dfllm.engine.cuda_graphs).

Two legs, each run by both engines (one at a time, the GPU emptied in between), after a warm-up
call (which captures the graphs):

- ``batch``: ``--num-prompts`` prompts of random token ids (32-128 tokens), ``--max-tokens``
  generated tokens each (``ignore_eos``, greedy), one ``generate`` call: tok/s = generated
  tokens / wall seconds (prefill included, as a user sees it);
- ``single``: one prompt, ``--single-tokens`` generated tokens: the launch-bound case.

Fidelity: the share of the batch's greedy sequences that are identical with and without graphs
(in bfloat16 the graphs' attention splits the keys differently, so a near-tie may flip late in a
sequence). Exits 1 when the graphs were not used, or when fewer than half the sequences match.
On a machine without CUDA it prints why it is skipped and exits 0.

    python benchmarks/bench_cuda_graphs.py [--model smollm2-135m-instruct] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch


def _run(
    model: str,
    dtype: str,
    eager: bool,
    prompts: list[list[int]],
    max_tokens: int,
    single_tokens: int,
    max_num_seqs: int,
) -> dict:
    from dfllm import LLM, SamplingParams

    llm = LLM(
        model,
        device="cuda",
        dtype=dtype,
        enforce_eager=eager,
        max_num_seqs=max_num_seqs,
        kv_cache_memory_bytes=4 << 30,
        max_model_len=1024,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:max_num_seqs]],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )  # warm-up: kernels, graphs
    llm.reset_prefix_cache()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    torch.cuda.synchronize()
    batch_s = time.perf_counter() - t0
    llm.reset_prefix_cache()
    one = SamplingParams(temperature=0.0, max_tokens=single_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompts[0]}], one, use_tqdm=False)
    torch.cuda.synchronize()
    single_s = time.perf_counter() - t0
    assert llm.engine is not None
    graphs = getattr(llm.engine.runner, "decode_graphs", None)
    res = {
        "batch_tok_s": len(prompts) * max_tokens / batch_s,
        "single_tok_s": single_tokens / single_s,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "graph_sizes": list(graphs.sizes) if graphs is not None and graphs.captured else [],
        "replays": graphs.replays if graphs is not None else 0,
    }
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model directory or bundled alias")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--single-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        why = "no CUDA device: CUDA graphs need a GPU"
        print(f"skipped: {why}")
        if args.json:
            json.dump({"skipped": why}, open(args.json, "w"), indent=2)
        return 0
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(20, 40000, (int(n),), generator=g).tolist()
        for n in torch.randint(32, 129, (args.num_prompts,), generator=g)
    ]
    graphs, eager = (
        _run(args.model, args.dtype, eager_mode, prompts, args.max_tokens, args.single_tokens, args.max_num_seqs)
        for eager_mode in (False, True)
    )
    same = sum(a == b for a, b in zip(graphs["tokens"], eager["tokens"]))
    res: dict[str, object] = {
        "model": args.model,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "single_tokens": args.single_tokens,
        "graph_sizes": graphs["graph_sizes"],
        "replays": graphs["replays"],
        "identical": same,
    }
    for leg in ("batch", "single"):
        fast, slow = float(graphs[f"{leg}_tok_s"]), float(eager[f"{leg}_tok_s"])
        res.update({f"{leg}_graphs": fast, f"{leg}_eager": slow, f"{leg}_speedup": fast / slow})
    print(json.dumps(res))
    if args.json:
        json.dump(res, open(args.json, "w"), indent=2)
    if not graphs["graph_sizes"] or not graphs["replays"]:
        print("FAIL: no CUDA graph was captured or replayed (see the log for the reason)")
        return 1
    if same < 0.5 * args.num_prompts:
        print(f"FAIL: only {same} of {args.num_prompts} greedy sequences equal with and without graphs")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
