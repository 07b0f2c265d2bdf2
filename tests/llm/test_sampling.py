"""SamplingParams validation and the sampling, stopping and logprob behaviour of the engine."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from dfllm import LLM, SamplingParams

from helpers import build_tiny_model, random_prompts

BAD_PARAMS = [
    ("n", dict(n=0)),
    ("temperature", dict(temperature=-0.5)),
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)),
    ("min_p", dict(min_p=1.5)),
    ("seed", dict(seed=-5)),
    ("stop", dict(stop=["ok", ""])),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-3)),
    ("min_tokens", dict(min_tokens=20, max_tokens=10)),
    ("logprobs", dict(logprobs=-2)),
    ("presence_penalty", dict(presence_penalty=3.0)),
    ("frequency_penalty", dict(frequency_penalty=-2.5)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("n", dict(n=2, temperature=0.0)),
    ("stop strings are only supported when detokenize", dict(stop=["x"], detokenize=False)),
    ("bad_words", dict(bad_words=["ok", " "])),
    ("allowed_token_ids", dict(allowed_token_ids=[])),
    ("allowed_token_ids", dict(allowed_token_ids=[-1])),
    ("logit_bias", dict(logit_bias={3: float("nan")})),
    ("truncate_prompt_tokens", dict(truncate_prompt_tokens=0)),
    ("prompt_logprobs", dict(prompt_logprobs=-2)),
    ("logits_processors", dict(logits_processors=[lambda ids, logits: logits])),
    ("best_of", dict(n=2, best_of=1)),  # best_of above n is built, and refused by generate (as vLLM)
]


@pytest.mark.parametrize("field,kwargs", BAD_PARAMS)
def test_invalid_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens) == (1, 1.0, 1.0, 0, 16, 0)
    assert p.stop_strings == [] and SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams.from_dict({"temperature": 0.0}).is_greedy
    with pytest.raises(ValueError, match="unknown"):
        SamplingParams.from_dict({"temprature": 0.5})


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, max_num_seqs=16)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def as_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_seeded_request_is_independent_of_the_batch(llm):
    prompts = random_prompts(6, 5, 30, seed=7)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(as_prompts(prompts[:1]), seeded, use_tqdm=False)
    others = [SamplingParams(temperature=0.9, max_tokens=n, ignore_eos=True) for n in (5, 9, 3, 12, 7)]
    batched = llm.generate(as_prompts(prompts), [seeded] + others, use_tqdm=False)
    assert tokens(alone)[0] == tokens(batched)[0]
    other_seed = llm.generate(
        as_prompts(prompts[:1]),
        SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    assert tokens(other_seed)[0] != tokens(alone)[0]


def test_top_k_one_is_greedy_and_n_gives_distinct_samples(llm):
    prompt = as_prompts(random_prompts(1, 11, 11, seed=8))
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(
        prompt, SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    assert tokens(greedy) == tokens(top1)
    many = llm.generate(
        prompt, SamplingParams(n=4, temperature=1.5, seed=3, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in many.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in many.outputs}) > 1


def test_top_p_and_min_p_restrict_to_likely_tokens(llm, tiny_llama):
    prompt = random_prompts(1, 9, 9, seed=9)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.inference_mode():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], dim=-1)
    top = probs.argsort(descending=True)
    nucleus = set(top[: int((probs[top].cumsum(0) < 0.5).sum()) + 1].tolist())
    allowed_min_p = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    for seed in range(12):

        def first(seed=seed, **kw):
            return (
                llm.generate(as_prompts([prompt]), SamplingParams(max_tokens=1, seed=seed, **kw), use_tqdm=False)[0]
                .outputs[0]
                .token_ids[0]
            )

        assert first(top_p=0.5) in nucleus
        assert first(min_p=0.3) in allowed_min_p


def test_repetition_penalty_matches_transformers(llm, tiny_llama):
    prompts = random_prompts(3, 7, 19, seed=10)
    outs = llm.generate(
        as_prompts(prompts),
        SamplingParams(temperature=0, repetition_penalty=1.4, max_tokens=15, ignore_eos=True),
        use_tqdm=False,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    for p, o in zip(prompts, outs):
        x = torch.tensor([p])
        ref = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=15,
            do_sample=False,
            repetition_penalty=1.4,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        assert o.outputs[0].token_ids == ref


@pytest.mark.slow
def test_frequency_and_presence_penalties_match_reference(tmp_path, smollm2_dir):
    """Greedy decoding with OpenAI-style penalties, recomputed from transformers' logits.

    A model with small weights repeats itself, so the penalties change its output.
    """
    path = build_tiny_model(tmp_path, smollm2_dir, initializer_range=0.02)
    llm = LLM(path, max_num_seqs=4, kv_cache_memory_bytes=2**22)
    prompt = random_prompts(1, 5, 5, seed=11)[0]
    freq, pres = 1.5, 0.7
    out = (
        llm.generate(
            as_prompts([prompt]),
            SamplingParams(
                temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=freq, presence_penalty=pres
            ),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(12):
            logits = model(torch.tensor([prompt + generated])).logits[0, -1]
            counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.numel()).float()
            generated.append(int((logits - freq * counts - pres * (counts > 0).float()).argmax()))
    assert out == generated
    plain = (
        llm.generate(
            as_prompts([prompt]), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert plain != out  # the penalties changed the outcome on this prompt


def test_logprobs_are_raw_model_logprobs(llm, tiny_llama):
    prompt = random_prompts(1, 13, 13, seed=12)[0]
    out = llm.generate(
        as_prompts([prompt]), SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt + out.token_ids])).logits[0], dim=-1)
    total = 0.0
    for step, (tok, entries) in enumerate(zip(out.token_ids, out.logprobs)):
        assert len(entries) == 3 and entries[tok].rank == 1
        row = ref[len(prompt) - 1 + step]
        for t, lp in entries.items():
            assert lp.logprob == pytest.approx(float(row[t]), abs=1e-4)
            assert isinstance(lp.decoded_token, str)
        total += entries[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total)
    no_logprobs = llm.generate(as_prompts([prompt]), SamplingParams(max_tokens=2), use_tqdm=False)
    assert no_logprobs[0].outputs[0].logprobs is None


def test_sampled_token_always_in_logprobs(llm):
    prompt = as_prompts(random_prompts(1, 13, 13, seed=13))
    out = llm.generate(
        prompt, SamplingParams(temperature=2.0, seed=5, max_tokens=6, logprobs=0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    for tok, entries in zip(out.token_ids, out.logprobs):
        assert list(entries) == [tok] and entries[tok].rank >= 1 and not math.isnan(entries[tok].logprob)


# ---- vLLM's other sampling fields --------------------------------------------------------------------------
def test_allowed_token_ids_logit_bias_and_bad_words(llm):
    """allowed_token_ids restricts every draw; a large logit_bias forces a token; bad_words
    never appear, single- or multi-token; out-of-vocabulary ids are refused by name."""
    prompt = as_prompts(random_prompts(1, 9, 9, seed=21))
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    allowed = [101, 202, 303]
    out = llm.generate(
        prompt,
        SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed),
        use_tqdm=False,
    )
    assert set(tokens(out)[0]) <= set(allowed)
    forced = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={"777": 1e4}), use_tqdm=False
    )
    assert tokens(forced)[0] == [777] * 4
    first = tokens(free)[0][0]
    banned = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[llm.get_tokenizer().decode([first])]),
        use_tqdm=False,
    )
    assert first not in tokens(banned)[0] and tokens(banned)[0] != tokens(free)[0]
    tok = llm.get_tokenizer()
    two = tuple(tokens(free)[0][2:4])  # two generated tokens, a word after a space: " lower Sham"
    word = tok.decode(two)
    assert tuple(tok.encode(word, add_special_tokens=False)) == two
    text = (
        llm.generate(
            prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word]), use_tqdm=False
        )[0]
        .outputs[0]
        .token_ids
    )
    assert text[:3] == tokens(free)[0][:3] and text[3] != two[1]  # the first token may come, not the second
    with pytest.raises(ValueError, match="prompt 0: token id.*out of vocabulary"):
        llm.generate(prompt, SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)


def test_truncate_prompt_tokens_and_detokenize(llm):
    """truncate_prompt_tokens keeps the prompt's last tokens (as vLLM); detokenize=False
    gives the same tokens with no text."""
    prompt = random_prompts(1, 21, 21, seed=22)[0]
    sp = dict(temperature=0, max_tokens=5, ignore_eos=True)
    cut = llm.generate(as_prompts([prompt]), SamplingParams(truncate_prompt_tokens=7, **sp), use_tqdm=False)[0]
    tail = llm.generate(as_prompts([prompt[-7:]]), SamplingParams(**sp), use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-7:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    raw = llm.generate(as_prompts([prompt]), SamplingParams(detokenize=False, **sp), use_tqdm=False)[0].outputs[0]
    full = llm.generate(as_prompts([prompt]), SamplingParams(**sp), use_tqdm=False)[0].outputs[0]
    assert raw.token_ids == full.token_ids and raw.text == "" and full.text
