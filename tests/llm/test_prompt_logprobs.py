"""``SamplingParams.prompt_logprobs``: each prompt token's log-probability given the tokens
before it, as transformers computes it, whatever the engine does to the prompt (chunked
prefill, prefix cache, preemption, ``n > 1``), and priority scheduling's order."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dfllm import LLM, SamplingParams

from helpers import random_prompts


def as_prompts(ids: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in ids]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def log_softmax(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)

    return log_softmax


def check_against_reference(prompt: list[int], got: list, ref: torch.Tensor, k: int) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        entries, row, token = got[pos], ref[pos - 1], prompt[pos]
        assert list(entries)[0] == token  # the prompt token first, as in vLLM
        lp = row[token]  # its rank, up to ties within float noise
        assert int((row > lp + 1e-4).sum()) + 1 <= entries[token].rank <= int((row > lp - 1e-4).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert set(entries) == set(top) | {token}
        for t, lp in entries.items():
            assert lp.logprob == pytest.approx(float(row[t]), abs=1e-4)
            assert isinstance(lp.decoded_token, str)
        assert [entries[t].rank for t in top] == list(range(1, k + 1))


def test_prompt_logprobs_match_transformers(tiny_llama, reference):
    prompts = random_prompts(3, 9, 40, seed=21)
    llm = LLM(tiny_llama, max_model_len=128)
    outs = llm.generate(
        as_prompts(prompts), SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=4), use_tqdm=False
    )
    for prompt, out in zip(prompts, outs):
        check_against_reference(prompt, out.prompt_logprobs, reference(prompt), 4)
    plain = llm.generate(as_prompts(prompts[:1]), SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


@pytest.mark.slow
def test_chunked_prefill_prefix_cache_and_preemption_give_the_same_prompt_logprobs(tiny_llama, reference):
    prompts = random_prompts(6, 30, 60, seed=22)
    shared = prompts[0][:32]
    prompts = [shared + p for p in prompts]  # a common prefix the cache would serve
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)
    one_pass = LLM(tiny_llama, max_model_len=128, block_size=16, enable_prefix_caching=False)
    whole = one_pass.generate(as_prompts(prompts), sp, use_tqdm=False)
    # chunks of 16 tokens, a prefix cache warmed with the same prompts, and a KV cache of
    # 12 blocks of 16 tokens for 6 prompts of ~80 tokens: prefills are split and sequences preempted
    llm = LLM(
        tiny_llama,
        max_model_len=128,
        max_num_batched_tokens=16,
        block_size=16,
        kv_cache_memory_bytes=12 * one_pass.llm_engine.runner.block_bytes,
    )
    llm.generate(as_prompts(prompts), SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    before = llm.llm_engine.stats()
    outs = llm.generate(as_prompts(prompts), sp, use_tqdm=False)
    after = llm.llm_engine.stats()
    assert after.num_preemptions > before.num_preemptions
    assert all(o.num_cached_tokens == 0 for o in outs)  # no prefix hit for a prompt_logprobs request
    for prompt, a, b in zip(prompts, whole, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        check_against_reference(prompt, b.prompt_logprobs, reference(prompt), 2)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert list(x) == list(y)
            assert [v.logprob for v in x.values()] == pytest.approx([v.logprob for v in y.values()], abs=1e-5)
    # the cache still serves requests that do not ask for prompt logprobs
    hit = llm.generate(as_prompts(prompts[:1]), SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0


def test_zero_means_the_prompt_token_only_and_n_samples_share_them(tiny_llama, reference):
    prompt = random_prompts(1, 17, 17, seed=23)[0]
    llm = LLM(tiny_llama, max_model_len=128)
    out = llm.generate(
        as_prompts([prompt]),
        SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, prompt_logprobs=0),
        use_tqdm=False,
    )[0]
    assert len(out.outputs) == 3
    assert [list(d) for d in out.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]
    ref = reference(prompt)
    for pos in range(1, len(prompt)):
        assert out.prompt_logprobs[pos][prompt[pos]].logprob == pytest.approx(
            float(ref[pos - 1, prompt[pos]]), abs=1e-4
        )
    undecoded = llm.generate(
        as_prompts([prompt]), SamplingParams(max_tokens=1, prompt_logprobs=1, detokenize=False), use_tqdm=False
    )[0]
    assert all(v.decoded_token is None for d in undecoded.prompt_logprobs[1:] for v in d.values())


@pytest.mark.slow
def test_whole_vocabulary_and_a_one_token_prompt(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=128, max_logprobs=-1)
    prompt = random_prompts(1, 5, 5, seed=24)[0]
    out = llm.generate(
        as_prompts([prompt, prompt[:1]]), SamplingParams(max_tokens=1, prompt_logprobs=-1), use_tqdm=False
    )
    vocab = llm.llm_engine.cfg.model.vocab_size
    assert all(len(d) == vocab for d in out[0].prompt_logprobs[1:])
    assert out[1].prompt_logprobs == [None]
