"""The engine hands KV blocks out without clearing them: what a slot held before its sequence
wrote it never reaches an output.

An engine whose whole cache starts as NaN gives, token for token and log-probability for
log-probability, the outputs of the same engine whose cache starts as zeros, on a schedule
that reuses blocks every way the engine does: a cache of about two sequences (preemption and
recomputation), shared prefixes (prefix-cache hits, and blocks freed with their contents
kept), prompts longer than a step's token budget (chunked prefill), decode groups of uneven
lengths (padded block tables). On the CPU kernels and on the PyTorch references; the
kernels' own property test is ``tests/kernels/test_unwritten_slots.py``.
"""

from __future__ import annotations

import pytest

from dfllm import LLM, SamplingParams

from helpers import random_prompts

BLOCK = 4
MAX_LEN = 64
# the tiny Llama: K and V, 2 layers, 2 KV heads of 16 dims, float32, per block of 4 tokens
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4
PREFIX = list(range(300, 313))  # 13 tokens: three full blocks shared, the fourth not
PROMPTS = [PREFIX + p if i % 2 else p for i, p in enumerate(random_prompts(10, 5, 25, seed=4))]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=6 + 2 * i, ignore_eos=True, logprobs=2) for i in range(10)]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_a_cache_of_nan_gives_the_outputs_of_a_cache_of_zeros(tiny_llama, backend):
    outs = {}
    for fill in ("0", "nan"):
        llm = LLM(
            tiny_llama,
            block_size=BLOCK,
            max_model_len=MAX_LEN,
            kv_cache_memory_bytes=(MAX_LEN // BLOCK + 4) * BLOCK_BYTES,
            max_num_batched_tokens=24,
            enable_prefix_caching=True,
            attention_backend=backend,
        )
        llm.engine.scheduler.reserve_growth = False  # vLLM's admission: the tight cache must preempt
        llm.engine.runner.kv.fill_(float(fill))
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0, "nothing was preempted: the cache was too large"
        assert sum(o.num_cached_tokens for o in got) > 0, "no prefix-cache hit"
        assert max(len(p) for p in PROMPTS) > 24  # a prompt longer than a step's budget: chunked
        assert all(o.outputs[0].finish_reason == "length" for o in got), [o.outputs[0].error for o in got]
        outs[fill] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got]
    assert outs["nan"] == outs["0"]
