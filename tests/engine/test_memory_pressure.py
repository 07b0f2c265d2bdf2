"""Memory pressure: a KV cache with room for about two sequences, and many requests.

Every request must still complete, by preemption and recomputation, with exactly the output
of an engine whose cache holds the whole batch; the tests assert that preemption happened
(the scheduler's counter and the ``dfllm_num_preemptions`` metric), so they can fail.
"""

from __future__ import annotations

import pandas as pd
import pytest

import dfllm  # noqa: F401  (registers the accessors)
from dfllm import LLM, SamplingParams

from helpers import random_prompts

BLOCK = 4
MAX_LEN = 64
N = 12
# the tiny Llama: K and V, 2 layers, 2 KV heads of 16 dims, float32, per block of 4 tokens
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4
SMALL = (MAX_LEN // BLOCK + 4) * BLOCK_BYTES  # 20 blocks = 80 tokens: about two sequences of ~40
PROMPTS = random_prompts(N, 9, 25, seed=11)
MAX_TOKENS = [20, 7, 24, 13, 20, 3, 18, 24, 11, 16, 22, 9]


def metric(llm: LLM, name: str) -> float:
    return next(m for m in llm.get_metrics() if m.name == name).value


@pytest.fixture(scope="module")
def roomy(tiny_llama):
    return LLM(tiny_llama, block_size=BLOCK, max_model_len=MAX_LEN, kv_cache_memory_bytes=4 * 2**20)


def run(llm: LLM, params: list[SamplingParams]):
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def greedy_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def seeded_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.9, seed=100 + i, max_tokens=n, ignore_eos=True) for i, n in enumerate(MAX_TOKENS)
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "params,prefix_caching",
    [(greedy_params, True), (greedy_params, False), (seeded_params, True)],
    ids=["greedy", "greedy-no-prefix-cache", "seeded"],
)
def test_tiny_kv_cache_completes_every_request_exactly(tiny_llama, roomy, prefix_caching, params):
    tight = LLM(
        tiny_llama,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        kv_cache_memory_bytes=SMALL,
        enable_prefix_caching=prefix_caching,
    )
    # vLLM's admission (a watermark, no reserve for the decodes' growth), so that the tight
    # cache must preempt; the growth reserve's own effect is tested below
    tight.engine.scheduler.reserve_growth = False
    assert tight.engine.num_blocks == MAX_LEN // BLOCK + 4
    assert roomy.engine.num_blocks * BLOCK >= sum(len(p) for p in PROMPTS) + sum(MAX_TOKENS)
    expected = run(roomy, params())
    assert roomy.engine.scheduler.num_preemptions == 0
    got = run(tight, params())
    assert len(got) == N
    for g, e, p, n in zip(got, expected, PROMPTS, MAX_TOKENS):
        assert g.prompt_token_ids == p and g.finished
        assert g.outputs[0].token_ids == e.outputs[0].token_ids and len(g.outputs[0].token_ids) == n
        assert g.outputs[0].text == e.outputs[0].text and g.outputs[0].finish_reason == "length"
    preempted = tight.engine.scheduler.num_preemptions
    assert preempted > 0, "the cache was large enough: nothing was preempted, so nothing was tested"
    assert metric(tight, "dfllm_num_preemptions") == preempted
    assert sum(o.metrics.num_preemptions for o in got) == preempted
    assert not tight.engine.has_unfinished_requests()
    assert tight.engine.stats().num_free_blocks == tight.engine.num_blocks  # nothing leaked


def test_one_sequence_at_a_time_still_serves_a_queue(tiny_llama, roomy):
    """A cache of exactly max_model_len tokens: sequences that grow past half of it evict each other."""
    tight = LLM(
        tiny_llama,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        kv_cache_memory_bytes=(MAX_LEN // BLOCK) * BLOCK_BYTES,
        max_num_seqs=64,
    )
    tight.engine.scheduler.reserve_growth = False  # vLLM's admission: sequences are admitted, then evicted
    long = [SamplingParams(temperature=0.0, max_tokens=MAX_LEN - len(p), ignore_eos=True) for p in PROMPTS[:5]]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:5]]
    got = tight.generate(prompts, long, use_tqdm=False)
    expected = roomy.generate(prompts, long, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [e.outputs[0].token_ids for e in expected]
    assert all(len(p["prompt_token_ids"]) + len(g.outputs[0].token_ids) == MAX_LEN for p, g in zip(prompts, got))
    assert tight.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_growth_reserve_admits_what_can_finish(tiny_llama, roomy):
    """The same queue with the growth reserve (the default): a sequence is admitted only while
    the running ones keep room for the tokens they are expected to add, so the cache of one
    full-length sequence serves them one after another without preempting any."""
    tight = LLM(
        tiny_llama,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        kv_cache_memory_bytes=(MAX_LEN // BLOCK) * BLOCK_BYTES,
        max_num_seqs=64,
    )
    long = [SamplingParams(temperature=0.0, max_tokens=MAX_LEN - len(p), ignore_eos=True) for p in PROMPTS[:5]]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:5]]
    got = tight.generate(prompts, long, use_tqdm=False)
    expected = roomy.generate(prompts, long, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [e.outputs[0].token_ids for e in expected]
    assert tight.engine.scheduler.num_preemptions == 0


@pytest.mark.slow
def test_dataframe_rows_complete_under_memory_pressure(tiny_llama, roomy):
    """The same pressure through ``df.llm.generate`` (the shared engine and its driver thread)."""
    from dfllm.worker.engine_cache import get_engine

    texts = [f"Row {i}: tell me something about the number {i * 7}." for i in range(10)]
    sp = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    engine_kwargs = dict(block_size=BLOCK, max_model_len=MAX_LEN, kv_cache_memory_bytes=SMALL)
    df = pd.DataFrame({"q": texts}, index=range(100, 110))
    llm = get_engine(str(tiny_llama), engine_kwargs)  # the engine the accessor will use
    llm.engine.scheduler.reserve_growth = False  # admit as vLLM does, so that the cache must preempt
    out = df.llm.generate("q", model=str(tiny_llama), sampling_params=sp, **engine_kwargs)
    assert llm.engine.num_blocks == MAX_LEN // BLOCK + 4 and llm.engine.scheduler.num_preemptions > 0
    expected = roomy.generate(texts, SamplingParams(**sp), use_tqdm=False)
    assert list(out.index) == list(df.index) and out.llm_error.isna().all()
    assert out.generated_text.tolist() == [e.outputs[0].text for e in expected]
    assert out.num_generated_tokens.tolist() == [24] * 10
