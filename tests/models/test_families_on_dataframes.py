"""Every new decoder family from a dataframe: ``df.llm.generate`` on a pandas frame gives, row
by row, the engine's own text, whose greedy tokens are log-prob close (:mod:`fidelity`) to
those transformers' own implementation gives for the same prompt tokens."""

from __future__ import annotations

import pandas as pd
import pytest
from decoder_builders import build_decoder
from fidelity import TOPK, check_logprobs_close, from_outputs, hf_greedy_logprobs
from transformers import (
    DeepseekV2Config,
    Gemma2Config,
    Gemma3TextConfig,
    MixtralConfig,
    Phi3Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

import dfllm  # noqa: F401  (registers the accessors)
from dfllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

SP = dict(temperature=0.0, max_tokens=5, ignore_eos=True)
FAMILIES = {
    "qwen3": (Qwen3Config, dict(head_dim=24)),
    "phi3": (Phi3Config, dict()),
    "gemma2": (
        Gemma2Config,
        dict(
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3": (Gemma3TextConfig, dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16)),
    "mixtral": (MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    "qwen3_moe": (
        Qwen3MoeConfig,
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=24),
    ),
    "deepseek_v2": (
        DeepseekV2Config,
        dict(
            kv_heads=4,
            intermediate_size=128,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            first_k_dense_replace=2,
            pad_token_id=None,
        ),
    ),
}
TEXTS = ["Describe the sea in winter.", "List three prime numbers and explain why each is prime, briefly."]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dataframe_generate_matches_transformers(tmp_path, smollm2_dir, family):
    config_cls, kwargs = FAMILIES[family]
    path = build_decoder(tmp_path, smollm2_dir, config_cls, family, **kwargs)
    engine = dict(max_model_len=128, kv_cache_memory_bytes=2**22)
    df = pd.DataFrame({"q": TEXTS}, index=[10, 20])
    out = df.llm.generate("q", model=str(path), sampling_params=SP, **engine)
    assert list(out.index) == [10, 20] and out.llm_error.isna().all()
    direct = LLM(path, **engine).generate(TEXTS, SamplingParams(**SP, logprobs=TOPK), use_tqdm=False)
    assert out.generated_text.tolist() == [o.outputs[0].text for o in direct]
    prompts = [list(o.prompt_token_ids) for o in direct]
    check_logprobs_close(
        from_outputs(direct), hf_greedy_logprobs(path, prompts, SP["max_tokens"]), "dfllm", "transformers"
    )
