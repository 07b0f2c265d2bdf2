"""Greedy outputs close to Hugging Face transformers' ``generate`` by vLLM's log-probability
criterion (:mod:`fidelity`), and equal token for token between dfllm configurations
(preemption or not, prefix cache hit or not, chunked prefill or not)."""

from __future__ import annotations

import pytest
import torch
from fidelity import (
    check_logprobs_close,
    dfllm_greedy_logprobs,
    from_outputs,
    greedy_params,
    hf_greedy_logprobs,
    token_ids,
)

from dfllm import LLM, SamplingParams

from helpers import build_tiny_model, random_prompts

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0, ignore_eos=True)


def run(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_greedy_matches_transformers(tmp_path, smollm2_dir, arch, heads, kv_heads):
    path = build_tiny_model(
        tmp_path, smollm2_dir, arch=arch, heads=heads, kv_heads=kv_heads, hidden=48 if heads == 6 else 64
    )
    prompts = random_prompts(6, 3, 41, seed=heads)
    max_tokens = [7, 12, 1, 20, 9, 15]
    llm = LLM(path, max_num_seqs=8)
    check_logprobs_close(
        dfllm_greedy_logprobs(llm, prompts, max_tokens),
        hf_greedy_logprobs(path, prompts, max_tokens),
        "dfllm",
        "transformers",
    )


@pytest.mark.parametrize(
    "arch,extra",
    [
        (
            "llama",
            dict(
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 256,
                }
            ),
        ),
        ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=500000.0)),
        ("qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})),
        ("llama", dict(attention_bias=True, mlp_bias=True)),
        ("mistral", dict(sliding_window=None, head_dim=24)),
    ],
)
def test_config_variants_match_transformers(tmp_path, smollm2_dir, arch, extra):
    """Scaled rope types, Llama's attention/MLP biases, and a Mistral config with explicit head_dim."""
    path = build_tiny_model(tmp_path, smollm2_dir, arch=arch, **extra)
    prompts = random_prompts(3, 5, 300, seed=6)
    max_tokens = [8, 5, 11]
    check_logprobs_close(
        dfllm_greedy_logprobs(LLM(path), prompts, max_tokens),
        hf_greedy_logprobs(path, prompts, max_tokens),
        "dfllm",
        "transformers",
    )


def test_unsupported_rope_type_is_named(tmp_path, smollm2_dir):
    path = build_tiny_model(tmp_path, smollm2_dir, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(NotImplementedError, match="rope type 'dynamic'"):
        LLM(path)


def test_chunked_prefill_mixed_with_decodes(tiny_llama):
    """A 16-token budget splits every prompt into chunks scheduled beside running decodes; the
    outputs equal those of whole-prompt prefill."""
    prompts = random_prompts(5, 30, 70, seed=1)
    max_tokens = [10, 6, 14, 3, 8]
    llm = LLM(tiny_llama, max_num_seqs=4, max_num_batched_tokens=16)
    out = run(llm, prompts, max_tokens)
    assert out == run(LLM(tiny_llama, max_num_seqs=4), prompts, max_tokens)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_by_recomputation(tiny_llama, prefix_caching):
    """A KV cache too small for the batch forces preemption; outputs are unchanged."""
    prompts = random_prompts(8, 9, 25, seed=2)
    max_tokens = [24] * 8
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # K+V, 2 layers, block 4, 2 kv heads, head dim 16, fp32
    llm = LLM(
        tiny_llama,
        block_size=4,
        kv_cache_memory_bytes=40 * block_bytes,
        max_model_len=64,
        enable_prefix_caching=prefix_caching,
    )
    assert llm.engine.num_blocks == 40
    out = run(llm, prompts, max_tokens)
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.stats().num_free_blocks == 40
    roomy = LLM(tiny_llama, max_model_len=64)
    assert out == run(roomy, prompts, max_tokens)  # exactly as without preemption
    assert roomy.engine.stats().num_preemptions == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching_reuses_blocks(tiny_qwen2, prefix_caching):
    shared = random_prompts(1, 67, 67, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts(4, 3, 9, seed=4)]
    llm = LLM(tiny_qwen2, block_size=16, enable_prefix_caching=prefix_caching)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(11), use_tqdm=False)
    cached = [o.num_cached_tokens for o in outs]
    assert cached == ([64] * 4 if prefix_caching else [0] * 4)
    check_logprobs_close(from_outputs(outs), hf_greedy_logprobs(tiny_qwen2, prompts, 11), "dfllm", "transformers")


def test_prefix_hit_on_whole_prompt_recomputes_last_token(tiny_llama):
    """A prompt that is exactly cached blocks still computes its last token for logits."""
    prompt = random_prompts(1, 32, 32, seed=5)[0][:32]
    llm = LLM(tiny_llama, block_size=16)
    a = dfllm_greedy_logprobs(llm, [prompt], 6)
    b = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    assert b[0].num_cached_tokens == 16
    assert token_ids(a) == [b[0].outputs[0].token_ids]  # exact: the cache hit changes nothing
    check_logprobs_close(a, hf_greedy_logprobs(tiny_llama, [prompt], 6), "dfllm", "transformers")


@pytest.fixture(scope="module")
def smol_chat_prompts(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    questions = [
        "What is the capital of France?",
        "Write a haiku about autumn leaves.",
        "Explain in two sentences why the sky is blue.",
        "List three uses of a paperclip.",
        "Translate 'good morning' into Spanish and German.",
    ]
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module")
def smol_default(smollm2_dir, smol_chat_prompts):
    """dfllm's default engine on the chat prompts, the exact reference of the other variants."""
    return dfllm_greedy_logprobs(LLM(smollm2_dir), smol_chat_prompts, 24)


@pytest.mark.parametrize("variant", ["default", "chunked+preempt", "no-prefix-cache"])
def test_smollm2_matches_transformers(smollm2_dir, smol_chat_prompts, smol_default, variant):
    """The default engine is log-prob close to transformers; chunked prefill with preemption, and
    no prefix cache, give exactly the default engine's tokens."""
    if variant == "default":
        check_logprobs_close(
            smol_default, hf_greedy_logprobs(smollm2_dir, smol_chat_prompts, 24), "dfllm", "transformers"
        )
        return
    kwargs = {
        "chunked+preempt": dict(
            max_num_batched_tokens=32,
            block_size=16,
            max_model_len=128,
            kv_cache_memory_bytes=14 * 2 * 30 * 16 * 3 * 64 * 4,
        ),
        "no-prefix-cache": dict(enable_prefix_caching=False),
    }[variant]
    llm = LLM(smollm2_dir, **kwargs)
    if variant == "chunked+preempt":
        llm.engine.scheduler.reserve_growth = False  # admit as vLLM does, so that the small cache preempts
    assert run(llm, smol_chat_prompts, [24] * 5) == token_ids(smol_default)
    if variant == "chunked+preempt":
        assert llm.engine.stats().num_preemptions > 0


def test_bfloat16_kv_cache_is_logprob_close_to_the_float32_cache(smollm2_dir, smol_chat_prompts, smol_default):
    """kv_cache_dtype="bfloat16" under the float32 model: the cache holds bfloat16 (twice the
    blocks in the same bytes) and greedy outputs stay log-prob close to the float32 cache's."""
    import torch

    fp32_block = 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2-135M: K and V, 30 layers, 16 slots, 3 KV heads of 64
    llm = LLM(smollm2_dir, kv_cache_dtype="bfloat16", kv_cache_memory_bytes=64 * fp32_block, max_model_len=512)
    assert llm.config.kv_dtype == torch.bfloat16 and llm.config.dtype == torch.float32
    assert llm.engine.runner.kv.dtype == torch.bfloat16
    assert llm.engine.num_blocks == 128
    got = dfllm_greedy_logprobs(llm, smol_chat_prompts, 24)
    check_logprobs_close(got, smol_default, "kv bfloat16", "kv float32")
    assert LLM(smollm2_dir, kv_cache_dtype="bfloat16", dtype="bfloat16").config.kv_cache_dtype is None  # "auto" then


def test_bfloat16_model_is_logprob_close_to_transformers_float32(smollm2_dir, smol_chat_prompts):
    """dtype="bfloat16" (weights, activations and cache; GEMMs packed where the CPU has
    bfloat16 instructions: dfllm's own on AVX512-BF16 without AMX, oneDNN's with AMX) against
    transformers in float32, by vLLM's criterion."""
    from dfllm.models.cpu_linear import PackableLinear, bf16_gemm_isa, own_gemm_applies

    llm = LLM(smollm2_dir, dtype="bfloat16")

    def gemms_of(worker) -> list[str]:
        layers = [m for m in worker.model.modules() if isinstance(m, PackableLinear) and m._packed is not None]
        return sorted({m._gemm for m in layers})

    gemms = llm.collective_rpc(gemms_of)[0]
    if bf16_gemm_isa() is None:
        assert gemms == []
    else:
        assert gemms == (["dfllm"] if own_gemm_applies(torch.zeros(1, dtype=torch.bfloat16)) else ["onednn"])
    check_logprobs_close(
        dfllm_greedy_logprobs(llm, smol_chat_prompts, 24),
        hf_greedy_logprobs(smollm2_dir, smol_chat_prompts, 24),
        "dfllm bfloat16",
        "transformers float32",
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_bfloat16_tiny_models_are_logprob_close_to_transformers_float32(tmp_path, smollm2_dir, arch):
    path = build_tiny_model(tmp_path, smollm2_dir, arch=arch, initializer_range=0.05)
    prompts = random_prompts(4, 5, 60, seed=3)
    max_tokens = [10, 6, 12, 8]
    check_logprobs_close(
        dfllm_greedy_logprobs(LLM(path, dtype="bfloat16"), prompts, max_tokens),
        hf_greedy_logprobs(path, prompts, max_tokens),
        "dfllm bfloat16",
        "transformers float32",
    )


BF16_QUESTIONS = [
    "What is the capital of {}, and what is it known for?",
    "Write two sentences about the history of {}.",
    "Give three tips for a visitor to {}.",
    "Describe the weather in {} in spring.",
]
BF16_PLACES = ["France", "Japan", "Brazil", "Kenya", "Canada", "Norway"]


def greedy_share_before_divergence(ref: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(share of rows fully equal, mean share of a reference row before its first divergence)."""
    equal, shares = 0, []
    for a, b in zip(ref, other):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        equal += a == b
        shares.append(1.0 if a == b else k / max(len(a), 1))
    return equal / len(ref), sum(shares) / len(shares)


def test_bfloat16_greedy_stays_with_float32(smollm2_dir):
    """bfloat16's greedy tokens stay with float32's as long as measured after the numerics
    round (issue #50: float32 logits where they decide, RMSNorm and rotary rounded once): on 24
    chats of 48 tokens, at least the share of rows and of tokens before the first divergence
    measured then, with a margin (benchmarks/bench_fidelity.py measures the full workload)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": q.format(p)}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in BF16_QUESTIONS
        for p in BF16_PLACES
    ]
    params = SamplingParams(temperature=0, max_tokens=48)
    rows = {}
    for dtype in ("float32", "bfloat16"):
        outs = LLM(smollm2_dir, dtype=dtype).generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        rows[dtype] = [list(o.outputs[0].token_ids) for o in outs]
    equal, share = greedy_share_before_divergence(rows["float32"], rows["bfloat16"])
    print(f"bfloat16 vs float32: {equal:.3f} rows equal, {share:.3f} of a row before its first divergence")
    assert equal >= BF16_FLOOR["equal"] and share >= BF16_FLOOR["share"], (equal, share)


# measured 2026-12-05 (AMD EPYC, AVX512-BF16): 10/24 rows equal, 0.646 of a row; with the LM
# head's logits rounded to bfloat16 as before, 6/24 and 0.573
BF16_FLOOR = {"equal": 0.33, "share": 0.61}
