"""Gemma 2 and Gemma 3 (text) against transformers: greedy tokens for prompts longer than the
sliding window, through chunked prefill, small blocks and the prefix cache; prompt and sample
log-probabilities (Gemma 2's soft-capped final logits); a head_dim of 256."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from decoder_builders import build_decoder, greedy
from fidelity import check_logprobs_close, dfllm_greedy_logprobs, from_outputs, greedy_params, hf_greedy_logprobs
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

from dfllm import LLM, SamplingParams
from dfllm.engine.cuda_graphs import unsupported_reason

from helpers import random_prompts

WINDOW = 8


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, smollm2_dir) -> Path:
    # layer 0 sliding, layer 1 global; small caps so that both change the numbers;
    # query_pre_attn_scalar differs from head_dim
    return build_decoder(
        tmp_path_factory.mktemp("gemma2"),
        smollm2_dir,
        Gemma2Config,
        "gemma2",
        head_dim=16,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=3.0,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, smollm2_dir) -> Path:
    # sliding, global, sliding; the global layers' rope is scaled (linear) and has its own base
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
    }
    return build_decoder(
        tmp_path_factory.mktemp("gemma3"),
        smollm2_dir,
        Gemma3TextConfig,
        "gemma3",
        layers=3,
        head_dim=16,
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        rope_parameters=rope,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(4, 11, 33, seed=41)


MAX_TOKENS = [8, 3, 11, 5]


def _engine(path: Path, **kwargs) -> LLM:
    # 16-token chunks and 4-token blocks: windows cross chunk and block boundaries
    return LLM(path, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, max_model_len=128, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gemma2", "gemma3"])
def test_greedy_matches_transformers_past_the_window(request, model, prompts):
    path = request.getfixturevalue(model)
    llm = _engine(path)
    check_logprobs_close(
        dfllm_greedy_logprobs(llm, prompts, MAX_TOKENS),
        hf_greedy_logprobs(path, prompts, MAX_TOKENS),
        "dfllm",
        "transformers",
    )
    # prompts sharing a new 21-token prefix: the later ones are served partly from the prefix cache
    prefix = random_prompts(1, 21, 21, seed=43)[0]
    shared = [prefix + p[:6] for p in prompts]
    first = llm.generate([{"prompt_token_ids": shared[0]}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    outs = llm.generate([{"prompt_token_ids": p} for p in shared[1:]], [greedy_params(4)] * 3, use_tqdm=False)
    assert all(o.num_cached_tokens >= 16 for o in outs)
    check_logprobs_close(from_outputs(outs), hf_greedy_logprobs(path, shared[1:], 4), "dfllm", "transformers")


def hf_log_probs(path: Path, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax of its (soft-capped) logits at every position of ``ids``."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_gemma2_log_probs_see_the_capped_logits(gemma2, prompts):
    prompt = prompts[2]
    llm = _engine(gemma2)
    out = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=3),
        use_tqdm=False,
    )[0]
    tokens = out.outputs[0].token_ids
    want = hf_log_probs(gemma2, prompt + tokens)
    # transformers' logits are capped to (-3, 3), so every row's log-probabilities span less than 6
    assert (want.max(-1).values - want.min(-1).values).max() < 6.0
    for pos in range(1, len(prompt)):
        got = out.prompt_logprobs[pos]
        for tok, lp in got.items():
            assert lp.logprob == pytest.approx(want[pos - 1, tok].item(), abs=1e-4)
    for i, (tok, entries) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        row = want[len(prompt) - 1 + i]
        assert row[tok] >= row.max() - 1e-4  # the greedy token, up to float noise
        for t, lp in entries.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=1e-4)


def test_gemma3_head_dim_256(tmp_path, smollm2_dir, prompts):
    path = build_decoder(
        tmp_path,
        smollm2_dir,
        Gemma3TextConfig,
        "gemma3-hd256",
        hidden=32,
        heads=2,
        kv_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=WINDOW,
        tie_word_embeddings=True,
        layer_types=["sliding_attention", "full_attention"],
    )
    few, max_tokens = prompts[:2], [6, 3]
    check_logprobs_close(
        dfllm_greedy_logprobs(_engine(path), few, max_tokens),
        hf_greedy_logprobs(path, few, max_tokens),
        "dfllm",
        "transformers",
    )


@pytest.mark.slow
def test_gemma2_triton_backend(gemma2, prompts):
    """The Triton kernels (the interpreter on a CPU): windowed and soft-capped layers in one launch;
    decode steps stay eager, the class declaring no CUDA-graph support."""
    few, max_tokens = [prompts[0], prompts[2]], [4, 3]
    llm = _engine(gemma2, attention_backend="triton")
    check_logprobs_close(
        dfllm_greedy_logprobs(llm, few, max_tokens),
        hf_greedy_logprobs(gemma2, few, max_tokens),
        "dfllm-triton",
        "transformers",
    )
    assert "supports_cuda_graphs" in unsupported_reason(llm.engine.runner.model)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gemma2", "gemma3"])
def test_preemption_keeps_outputs(request, model, prompts):
    """A KV cache of 16 four-token blocks cannot hold the batch: sequences are preempted and
    recomputed (sliding and global layers alike) and every output equals exactly the roomy
    engine's."""
    path = request.getfixturevalue(model)
    roomy = _engine(path)
    block_bytes = roomy.engine.runner.block_bytes
    llm = LLM(
        path,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=4,
        max_model_len=64,
        kv_cache_memory_bytes=16 * block_bytes,
    )
    llm.engine.scheduler.reserve_growth = False  # admit as vLLM does, so that the small cache preempts
    assert greedy(llm, prompts, MAX_TOKENS) == greedy(roomy, prompts, MAX_TOKENS)
    assert llm.engine.stats().num_preemptions > 0


@pytest.mark.slow
def test_gemma2_tensor_parallel_matches_one_rank(gemma2, prompts):
    """Two ranks, each with half of the query and key/value heads and of the MLP columns, give
    exactly one rank's tokens."""
    one_rank = greedy(_engine(gemma2), prompts, MAX_TOKENS)
    llm = LLM(gemma2, tensor_parallel_size=2, max_num_batched_tokens=16, block_size=4, max_model_len=128)
    try:
        assert greedy(llm, prompts, MAX_TOKENS) == one_rank
    finally:
        llm.shutdown()
