"""Phi-3 (fused qkv_proj/gate_up_proj checkpoints, partial rotary, longrope) against
transformers: greedy tokens log-prob close to transformers' (:mod:`fidelity`), and exactly
the default engine's through chunked prefill, prefix caching, forced preemption and two
tensor-parallel ranks (each fused tensor split into its parts before sharding)."""

from __future__ import annotations

import pytest
import torch
from decoder_builders import build_decoder, greedy
from fidelity import (
    check_logprobs_close,
    dfllm_greedy_logprobs,
    from_outputs,
    greedy_params,
    hf_greedy_logprobs,
    token_ids,
)
from transformers import Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dfllm import LLM

from helpers import random_prompts

ORIGINAL = 32  # original_max_position_embeddings of the longrope model


def longrope(head_dim: int, partial: float) -> dict:
    half = int(head_dim * partial) // 2
    return dict(
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)],
        },
        original_max_position_embeddings=ORIGINAL,
        max_position_embeddings=256,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("phi3")
    return {
        "default": build_decoder(root, smollm2_dir, Phi3Config, "phi3-default", heads=4, kv_heads=2),
        # Phi-4-mini style: 3/4 of each head rotates, longrope with distinct short/long factors
        "longrope": build_decoder(
            root,
            smollm2_dir,
            Phi3Config,
            "phi3-longrope",
            heads=4,
            kv_heads=4,
            seed=1,
            partial_rotary_factor=0.75,
            **longrope(16, 0.75),
        ),
    }


PROMPTS = random_prompts(4, 7, 17, seed=40)  # with MAX_TOKENS, within ORIGINAL positions
MAX_TOKENS = [9, 1, 14, 6]


@pytest.fixture(scope="module")
def references(models):
    return {name: hf_greedy_logprobs(path, PROMPTS, MAX_TOKENS) for name, path in models.items()}


@pytest.fixture(scope="module")
def engine_outputs(models):
    """The default engine's greedy outputs (longrope within its original length), the exact
    reference of the other engine configurations."""
    return {
        name: dfllm_greedy_logprobs(
            LLM(path, **({"max_model_len": ORIGINAL} if name == "longrope" else {})), PROMPTS, MAX_TOKENS
        )
        for name, path in models.items()
    }


@pytest.mark.slow
def test_checkpoint_holds_fused_tensors(models):
    from safetensors import safe_open

    with safe_open(str(models["default"] / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names


@pytest.mark.slow
@pytest.mark.parametrize("which", ["default", "longrope"])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(max_num_batched_tokens=8, max_num_seqs=3, enable_prefix_caching=False),  # chunked prefill
    ],
)
def test_phi3_greedy_matches_transformers(models, references, engine_outputs, which, kwargs):
    """Short sequences: within ``original_max_position_embeddings`` transformers uses the short
    factors, and so does an engine whose ``max_model_len`` stays within it. Chunked prefill
    gives exactly the default engine's tokens."""
    if not kwargs:
        check_logprobs_close(engine_outputs[which], references[which], "dfllm", "transformers")
        return
    if which == "longrope":
        kwargs = dict(kwargs, max_model_len=ORIGINAL)
    assert greedy(LLM(models[which], **kwargs), PROMPTS, MAX_TOKENS) == token_ids(engine_outputs[which])


def test_longrope_long_sequences_match_transformers(models):
    """Prompts longer than ``original_max_position_embeddings``: transformers rotates every
    position with the long factors, as an engine with a longer ``max_model_len`` always does
    (vLLM's rule: the factors never change under cached keys)."""
    prompts, max_tokens = random_prompts(3, 33, 61, seed=41), [12, 5, 9]
    llm = LLM(models["longrope"], max_model_len=128, max_num_batched_tokens=24)
    check_logprobs_close(
        dfllm_greedy_logprobs(llm, prompts, max_tokens),
        hf_greedy_logprobs(models["longrope"], prompts, max_tokens),
        "dfllm",
        "transformers",
    )


@pytest.mark.parametrize("max_model_len,factors", [(ORIGINAL, "short"), (ORIGINAL + 1, "long")])
def test_longrope_factors_follow_max_model_len(models, max_model_len, factors):
    """The cos/sin table: short factors while ``max_model_len`` fits the original length, long
    ones beyond it, both as transformers' own initialiser computes them (with the attention
    scaling of ``max_position_embeddings / original_max_position_embeddings``)."""
    llm = LLM(models["longrope"], max_model_len=max_model_len)
    rotary = llm.engine.runner.model.model.rotary_emb
    config = Phi3Config.from_pretrained(models["longrope"])
    short, scale = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"))
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"), seq_len=ORIGINAL + 1)
    assert not torch.allclose(short, long) and short.shape == (6,) and scale > 1.0
    pos = torch.arange(max_model_len, dtype=torch.float32).unsqueeze(1)
    inv_freq = short if factors == "short" else long
    torch.testing.assert_close(rotary.cos, (pos * inv_freq).cos() * scale)
    torch.testing.assert_close(rotary.sin, (pos * inv_freq).sin() * scale)


@pytest.mark.slow
def test_phi3_prefix_caching_and_preemption(models, references):
    """A 16-block cache forces preemption (outputs equal the roomy engine's); a second pass
    over a prompt reads its blocks from the prefix cache and gives the same tokens, log-prob
    close to transformers'."""
    path = models["default"]
    prompts, max_tokens = random_prompts(6, 9, 25, seed=34), [14] * 6
    roomy = LLM(path, block_size=4)
    reference = greedy(roomy, prompts, max_tokens)
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # K+V, 2 layers, block 4, 2 kv heads, head dim 16, fp32
    llm = LLM(path, block_size=4, kv_cache_memory_bytes=16 * block_bytes, max_model_len=64)
    assert greedy(llm, prompts, max_tokens) == reference
    assert llm.engine.stats().num_preemptions > 0
    params = greedy_params(MAX_TOKENS[2])
    first, second = (roomy.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens >= 4 * ((len(PROMPTS[2]) - 1) // 4) > 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    check_logprobs_close(from_outputs([first]), references["default"][2:3], "dfllm", "transformers")


@pytest.mark.slow
def test_phi3_tensor_parallel_matches_one_rank(models, engine_outputs):
    """Two ranks: each takes its slice of q, k and v (one kv head each) and of gate and up;
    the tokens are exactly one rank's."""
    llm = LLM(models["default"], tensor_parallel_size=2, max_model_len=128)
    try:
        assert greedy(llm, PROMPTS[:3], MAX_TOKENS[:3]) == token_ids(engine_outputs["default"][:3])
    finally:
        llm.shutdown()
