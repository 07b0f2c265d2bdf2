"""vLLM's ``LLM.beam_search`` (issue #52), against a beam search computed directly from the
tiny model's logits (transformers' forward pass, no engine)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

import dfllm
from dfllm import LLM, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from dfllm.beam_search import beam_search_score

PROMPTS = [[1, 450, 7586, 338], [1, 12, 99, 5, 77, 3]]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, max_model_len=128, max_num_seqs=16, kv_cache_memory_bytes=2**22)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def reference(hf, prompt: list[int], width: int, max_tokens: int, eos: int, penalty: float = 1.0):
    """Beam search straight from the model's log-softmax: every beam extended by its 2 * width
    most likely tokens, eos-ended candidates completed, the best ``width`` kept by score."""

    def score(tokens, cum):
        return beam_search_score(tokens, cum, eos, penalty)

    beams, done = [(list(prompt), 0.0)], []
    with torch.inference_mode():
        for _ in range(max_tokens):
            candidates = []
            for tokens, cum in beams:
                lp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)
                values, ids = lp.topk(2 * width)
                for v, t in zip(values.tolist(), ids.tolist()):
                    (done if t == eos else candidates).append((tokens + [t], cum + v))
            beams = sorted(candidates, key=lambda b: score(*b), reverse=True)[:width]
            if not beams:
                break
    return sorted(done + beams, key=lambda b: score(*b), reverse=True)[:width]


@pytest.mark.slow
@pytest.mark.parametrize("width,max_tokens,penalty", [(1, 5, 1.0), (3, 6, 1.0), (4, 5, 0.5)])
def test_beams_equal_the_brute_force_search(llm, hf, width, max_tokens, penalty):
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    eos = llm.get_tokenizer().eos_token_id
    for prompt, out in zip(PROMPTS, outs):
        assert isinstance(out, BeamSearchOutput) and len(out.sequences) == width
        expected = reference(hf, prompt, width, max_tokens, eos, penalty)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in expected]
        for seq, (_, cum) in zip(out.sequences, expected):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
            assert seq.tokens[: len(prompt)] == prompt and len(seq.logprobs) == len(seq.tokens) - len(prompt)
            assert seq.cum_logprob == pytest.approx(
                sum(d[t].logprob for d, t in zip(seq.logprobs, seq.tokens[len(prompt) :])), abs=1e-4
            )
            assert seq.text == llm.get_tokenizer().decode(seq.tokens)  # vLLM's offline text: every token
        scores = [beam_search_score(s.tokens, s.cum_logprob, eos, penalty) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)


def test_width_one_is_greedy_and_text_prompts_work(llm):
    text = "The capital of France is"
    out = llm.beam_search([text], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))[0].sequences[0]
    greedy = llm.generate(text, dfllm.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert out.tokens == greedy[0].prompt_token_ids + greedy[0].outputs[0].token_ids


def test_concurrency_limit_and_prefix_cache_do_not_change_the_beams(llm, tiny_llama):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    together = llm.beam_search(prompts, params)
    one_at_a_time = llm.beam_search(prompts, params, concurrency_limit=1)
    uncached = LLM(tiny_llama, max_model_len=128, enable_prefix_caching=False).beam_search(prompts, params)
    for outs in (one_at_a_time, uncached):
        assert [[s.tokens for s in o.sequences] for o in outs] == [[s.tokens for s in o.sequences] for o in together]


def test_beams_share_their_prefix_through_the_prefix_cache(tiny_llama):
    """Each step re-sends every beam's tokens; the cache serves their common prefix (no KV copied)."""
    engine = LLM(tiny_llama, max_model_len=128, block_size=4)
    engine.beam_search([{"prompt_token_ids": PROMPTS[1] * 3}], BeamSearchParams(beam_width=3, max_tokens=6))
    hits = next(m.value for m in engine.get_metrics() if m.name == "vllm:prefix_cache_hits")
    assert hits >= 5 * 3 * 16  # steps 2..6, three beams, at least the prompt's 16 cached tokens each


def test_beams_stop_at_max_model_len(tiny_llama):
    short = LLM(tiny_llama, max_model_len=8)
    out = short.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=2, max_tokens=10))
    assert all(len(s.tokens) <= 8 for s in out[0].sequences) and out[0].sequences


def test_params_are_checked_and_exported_from_the_root():
    assert dfllm.BeamSearchSequence is BeamSearchSequence and "BeamSearchParams" in dfllm.__all__
    for bad in (
        dict(beam_width=0, max_tokens=1),
        dict(beam_width=2, max_tokens=0),
        dict(beam_width=1, max_tokens=1, temperature=-1),
    ):
        with pytest.raises(ValueError):
            BeamSearchParams(**bad)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=2, max_size=20), st.floats(-100, 0), st.floats(0, 2), st.integers(0, 50))
def test_score_is_vllms_length_penalised_logprob(tokens, cum, penalty, eos):
    length = len(tokens) - (tokens[-1] == eos)  # a final end-of-sequence token is not counted
    assert math.isclose(beam_search_score(tokens, cum, eos, penalty), cum / length**penalty)
