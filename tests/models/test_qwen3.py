"""Qwen3 (per-head q/k RMSNorm, explicit head_dim, no qkv bias) against transformers: greedy
tokens log-prob close to transformers' (:mod:`fidelity`), and exactly the default engine's
through chunked prefill, no prefix cache, forced preemption and two tensor-parallel ranks."""

from __future__ import annotations

import pytest
from decoder_builders import build_decoder, greedy
from fidelity import (
    check_logprobs_close,
    dfllm_greedy_logprobs,
    from_outputs,
    greedy_params,
    hf_greedy_logprobs,
    token_ids,
)
from transformers import Qwen3Config

from dfllm import LLM

from helpers import random_prompts


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, smollm2_dir):
    # head_dim 24 differs from hidden / heads = 16
    return build_decoder(tmp_path_factory.mktemp("qwen3"), smollm2_dir, Qwen3Config, "qwen3", head_dim=24)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, 9, 45, seed=30)


MAX_TOKENS = [9, 4, 14, 1, 11]


@pytest.fixture(scope="module")
def reference(qwen3, prompts):
    """The default engine's greedy outputs (with top-5 logprobs), the exact reference of the others."""
    return dfllm_greedy_logprobs(LLM(qwen3), prompts, MAX_TOKENS)


def test_qwen3_has_its_norms_and_no_bias(qwen3):
    llm = LLM(qwen3)
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (24,) and attn.k_norm.weight.shape == (24,)
    assert attn.qkv_proj.bias is None and attn.o_proj.bias is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(max_num_batched_tokens=16, max_num_seqs=3),  # chunked prefill beside decodes
        dict(enable_prefix_caching=False),
    ],
)
def test_qwen3_greedy_matches_transformers(qwen3, prompts, reference, kwargs):
    if not kwargs:
        check_logprobs_close(reference, hf_greedy_logprobs(qwen3, prompts, MAX_TOKENS), "dfllm", "transformers")
    else:
        assert greedy(LLM(qwen3, **kwargs), prompts, MAX_TOKENS) == token_ids(reference)


def test_qwen3_prefix_cache_hits(qwen3):
    """Prompts sharing a 24-token prefix read it from the cache once one of them has run."""
    shared = random_prompts(1, 24, 24, seed=32)[0][:24]
    prompts = [shared + tail for tail in random_prompts(3, 3, 9, seed=33)]
    llm = LLM(qwen3, block_size=4, enable_prefix_caching=True)
    first = dfllm_greedy_logprobs(llm, prompts[:1], [3])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(7), use_tqdm=False)
    cached = [o.num_cached_tokens for o in outs]
    assert cached[0] >= 24 and cached[1:] == [24, 24]
    check_logprobs_close(
        first + from_outputs(outs),
        hf_greedy_logprobs(qwen3, prompts[:1] + prompts, [3, 7, 7, 7]),
        "dfllm",
        "transformers",
    )


@pytest.mark.slow
def test_qwen3_preemption(qwen3):
    """A KV cache of 16 four-token blocks is too small for the batch: a sequence is preempted
    and recomputed, and every output equals exactly the roomy engine's."""
    prompts, max_tokens = random_prompts(6, 9, 25, seed=34), [14] * 6
    reference = greedy(LLM(qwen3), prompts, max_tokens)
    block_bytes = 2 * 2 * 4 * 2 * 24 * 4  # K+V, 2 layers, block 4, 2 kv heads, head dim 24, fp32
    llm = LLM(qwen3, block_size=4, kv_cache_memory_bytes=16 * block_bytes, max_model_len=64)
    assert llm.engine.num_blocks == 16
    assert greedy(llm, prompts, max_tokens) == reference
    assert llm.engine.stats().num_preemptions > 0


@pytest.mark.slow
def test_qwen3_attention_bias_matches_transformers(tmp_path, smollm2_dir):
    path = build_decoder(
        tmp_path,
        smollm2_dir,
        Qwen3Config,
        "qwen3-bias",
        head_dim=16,
        attention_bias=True,
        heads=4,
        kv_heads=4,
        hidden=48,
        seed=1,
    )
    prompts, max_tokens = random_prompts(2, 5, 21, seed=31), [6, 8]
    check_logprobs_close(
        dfllm_greedy_logprobs(LLM(path), prompts, max_tokens),
        hf_greedy_logprobs(path, prompts, max_tokens),
        "dfllm",
        "transformers",
    )


@pytest.mark.slow
def test_qwen3_tensor_parallel_matches_one_rank(qwen3, prompts, reference):
    llm = LLM(qwen3, tensor_parallel_size=2, max_model_len=128, max_num_batched_tokens=32)
    try:
        assert greedy(llm, prompts[:3], MAX_TOKENS[:3]) == token_ids(reference[:3])  # exactly one rank's
    finally:
        llm.shutdown()
