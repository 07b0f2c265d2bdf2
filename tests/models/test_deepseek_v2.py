"""DeepSeek-V2/V3 multi-head latent attention with its compressed KV cache, and DeepSeek's MoE
layers: greedy tokens equal transformers' (float32) through decodes, chunked prefill, prefix
caching and preemption, and the cache really holds only ``kv_lora_rank + qk_rope_head_dim``
features per token and layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from decoder_builders import build_decoder
from fidelity import GreedyLogprobs, check_logprobs_close, dfllm_greedy_logprobs, hf_greedy_logprobs, token_ids
from transformers import DeepseekV2Config, DeepseekV3Config

from dfllm import LLM, SamplingParams

from helpers import random_prompts

GREEDY = dict(temperature=0.0, ignore_eos=True)
KV_LORA_RANK, ROPE_DIM, LAYERS = 16, 8, 2
LATENT_WIDTH = KV_LORA_RANK + ROPE_DIM


def build_deepseek(root: Path, tokenizer_dir: Path, name: str, version: int = 2, **overrides) -> Path:
    """A random all-dense DeepSeek-V2 (or V3) with the SmolLM2 tokenizer, saved to ``root/name``."""
    kwargs = dict(
        intermediate_size=128,
        q_lora_rank=32,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM,
        qk_nope_head_dim=16,
        v_head_dim=16,
        first_k_dense_replace=LAYERS,
        tie_word_embeddings=False,
        pad_token_id=None,
    )
    kwargs.update(overrides)

    def init(model: torch.nn.Module) -> None:
        for buffer, tensor in model.named_buffers():
            if buffer.endswith("e_score_correction_bias"):  # V3 initialises it to zeros: make it matter
                tensor.copy_(torch.rand(tensor.shape) * 0.3)

    return build_decoder(
        root,
        tokenizer_dir,
        DeepseekV2Config if version == 2 else DeepseekV3Config,
        name,
        kv_heads=4,
        layers=LAYERS,
        init=init,
        **kwargs,
    )


def run(llm: LLM, prompts: list[list[int]], max_tokens: list[int] | int) -> list[list[int]]:
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def deepseek_v2(tmp_path_factory, smollm2_dir) -> Path:
    return build_deepseek(tmp_path_factory.mktemp("models"), smollm2_dir, "deepseek-v2")


@pytest.fixture(scope="module")
def workload(deepseek_v2) -> tuple[list[list[int]], list[int], list[GreedyLogprobs]]:
    """Prompts (three sharing a 35-token prefix), their lengths of output, and transformers'
    tokens with their top-5 logprobs."""
    shared = random_prompts(1, 35, 35, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts(3, 3, 9, seed=4)] + random_prompts(2, 30, 45, seed=5)
    max_tokens = [9, 4, 12, 6, 10]
    return prompts, max_tokens, hf_greedy_logprobs(deepseek_v2, prompts, max_tokens)


def test_greedy_matches_transformers(tmp_path, smollm2_dir):
    """Decodes (the absorbed path) and whole-prompt prefills (the decompressed path); the
    cache tensor is one latent row per token and layer, no values."""
    path = build_deepseek(tmp_path, smollm2_dir, "ds-dense")
    max_tokens = [6, 10, 1]
    prompts = random_prompts(len(max_tokens), 3, 41, seed=1)
    llm = LLM(path, max_num_seqs=8)
    check_logprobs_close(
        dfllm_greedy_logprobs(llm, prompts, max_tokens),
        hf_greedy_logprobs(path, prompts, max_tokens),
        "dfllm",
        "transformers",
    )
    runner = llm.engine.runner
    assert runner.kv.shape == (1, LAYERS, llm.engine.num_blocks, 16, 1, LATENT_WIDTH)
    attn = runner.model.model.layers[0].self_attn
    assert attn.k_cache.shape[-1] == LATENT_WIDTH and attn.v_cache is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "version,extra",
    [
        (
            2,
            dict(
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "mscale": 1.0,
                    "mscale_all_dim": 0.8,
                    "original_max_position_embeddings": 256,
                }
            ),
        ),
        (3, dict(rope_interleave=False)),
    ],
)
def test_rope_variants_match_transformers(tmp_path, smollm2_dir, version, extra):
    """Yarn (scaled rope and the softmax mscale), and DeepSeek-V3's rope by halves (its default,
    interleaved pairs, runs in the MoE test)."""
    path = build_deepseek(tmp_path, smollm2_dir, "ds-variant", version=version, **extra)
    prompts = random_prompts(2, 5, 300, seed=6)
    max_tokens = [8, 6]
    check_logprobs_close(
        dfllm_greedy_logprobs(LLM(path), prompts, max_tokens),
        hf_greedy_logprobs(path, prompts, max_tokens),
        "dfllm",
        "transformers",
    )


MOE = dict(
    first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=16
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "version,extra",
    [
        (2, dict(q_lora_rank=None)),  # greedy top-k; queries from q_proj (no q LoRA)
        (2, dict(topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=1.5)),
        (3, dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    ],
)
def test_moe_layers_match_transformers(tmp_path, smollm2_dir, version, extra):
    """A dense first layer, then routed plus shared experts: V2's greedy and group-limited
    routing, V3's sigmoid routing with its score-correction bias and renormalised weights."""
    path = build_deepseek(tmp_path, smollm2_dir, "ds-moe", version=version, **MOE, **extra)
    prompts = random_prompts(2, 5, 40, seed=7)
    max_tokens = [8, 6]
    check_logprobs_close(
        dfllm_greedy_logprobs(LLM(path), prompts, max_tokens),
        hf_greedy_logprobs(path, prompts, max_tokens),
        "dfllm",
        "transformers",
    )


@pytest.mark.slow
def test_chunked_prefill_and_prefix_caching(deepseek_v2, workload):
    """A 16-token budget chunks every prompt beside running decodes (later chunks read their
    prefix's latents from the cache), log-prob close to transformers; the shared prefix is then
    served from cached blocks and gives exactly the same tokens."""
    prompts, max_tokens, reference = workload
    llm = LLM(deepseek_v2, max_num_seqs=4, max_num_batched_tokens=16, block_size=16)
    got = dfllm_greedy_logprobs(llm, prompts, max_tokens)
    check_logprobs_close(got, reference, "dfllm", "transformers")
    expected = token_ids(got)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:3]],
        [SamplingParams(max_tokens=n, **GREEDY) for n in max_tokens[:3]],
        use_tqdm=False,
    )
    assert [o.num_cached_tokens for o in outs] == [32] * 3
    assert [o.outputs[0].token_ids for o in outs] == expected[:3]


def test_preemption_with_a_small_latent_cache(deepseek_v2):
    """The memory budget counts one latent row per token (not keys plus values per head): 16
    blocks' worth of bytes buys exactly 16 blocks, too few for the batch, so sequences are
    preempted and recomputed; the tokens equal those of a run with room to spare."""
    block_bytes = LAYERS * 4 * LATENT_WIDTH * 4  # 2 layers, block 4, 24 features, float32; no values
    prompts = random_prompts(6, 5, 13, seed=2)
    max_tokens = [16] * 6
    expected = run(LLM(deepseek_v2, block_size=4, max_model_len=64), prompts, max_tokens)
    llm = LLM(deepseek_v2, block_size=4, kv_cache_memory_bytes=16 * block_bytes, max_model_len=64)
    assert llm.engine.runner.block_bytes == block_bytes
    assert llm.engine.num_blocks == 16
    assert run(llm, prompts, max_tokens) == expected
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.stats().num_free_blocks == 16


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_parallelism_is_refused(deepseek_v2, parallel):
    with pytest.raises(NotImplementedError, match="tensor_parallel_size and pipeline_parallel_size must be 1"):
        LLM(deepseek_v2, **parallel)
