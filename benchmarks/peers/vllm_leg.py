"""vLLM's CPU backend as a leg of bench_generate.py, run with the python of vLLM's own virtual
environment (never dfllm's: vLLM is a peer, not a dependency).

It loads ``LLM(model, dtype=...)`` once, says ``{"ready": ...}`` on stdout, then answers one JSON
request per stdin line, ``{"prompts": [[ids...]], "max_tokens": [n...], "forced": bool}``, with
``{"secs": float, "rows": [[ids...]]}``: the seconds of one ``LLM.generate`` over every prompt
(greedy, each row its own ``max_tokens``, EOS ignored when forced) and each row's generated ids.
Only JSON goes to stdout; vLLM's logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=4)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM prints; keep stdout for the protocol

    from vllm import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0)
    import vllm

    out.write(json.dumps({"ready": True, "version": vllm.__version__}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=req["forced"]) for n in req["max_tokens"]]
        prompts = [{"prompt_token_ids": ids} for ids in req["prompts"]]
        llm.reset_prefix_cache()  # a timed run never reuses a previous run's prompts
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        secs = time.perf_counter() - start
        out.write(json.dumps({"secs": secs, "rows": [list(o.outputs[0].token_ids) for o in outs]}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
