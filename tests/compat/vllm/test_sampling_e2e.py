"""vLLM's end-to-end ``SamplingParams`` scenarios, run on dfllm's ``LLM``.

Follows vLLM's ``tests/v1/sample/test_sampling_params_e2e.py`` (n, best_of, penalties, stop,
stop_token_ids, detokenize, bad_words, logits_processors, allowed_token_ids, seed), plus
``tests/samplers/test_ignore_eos.py``, ``tests/samplers/test_no_bad_words.py`` and
``tests/samplers/test_logprobs.py``. The model is the tiny random Llama of the fixtures
(SmolLM2 tokenizer), so expected texts are taken from the model's own greedy output, as
vLLM's tests do.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dfllm import LLM, SamplingParams

PROMPT = "Hello my name is Robert and I"
BAD_WORDS_PROMPT = "Hi! How are"
BAD_PHRASE_PROMPT = "The capital of France is"
EXAMPLE_PROMPTS = ["Hello, my name is", "The capital of France is", "The future of AI is"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, max_num_seqs=8, max_model_len=128)


def gen(llm, prompt, params):
    return llm.generate(prompt, params, use_tqdm=False)


def greedy(llm, prompt=PROMPT, **kw):
    return gen(llm, prompt, SamplingParams(temperature=0, **kw))[0].outputs[0]


# ---- tests/v1/sample/test_sampling_params_e2e.py ------------------------------------------


def test_n_gt_1(llm):
    outs = gen(llm, PROMPT, SamplingParams(n=3))
    assert len(outs) == 1 and len(outs[0].outputs) == 3
    assert sorted(c.index for c in outs[0].outputs) == [0, 1, 2]


def test_best_of_is_refused(llm):
    with pytest.raises(ValueError):
        gen(llm, PROMPT, SamplingParams(n=2, best_of=3))


def test_penalties_apply_without_error(llm):
    params = SamplingParams(
        temperature=1.2,
        presence_penalty=1.2,
        frequency_penalty=1.2,
        repetition_penalty=1.2,
        min_p=0.5,
        top_p=0.5,
        top_k=3,
    )
    out = gen(llm, PROMPT, params)[0].outputs[0]
    assert len(out.token_ids) > 0


def test_stop_word_cut_or_kept(llm):
    words = greedy(llm).text.split()
    stop_idx = 5
    assert words[stop_idx] not in " ".join(words[:stop_idx])  # the scenario needs its first occurrence there
    out = greedy(llm, stop=words[stop_idx])
    assert len(out.text.split()) == stop_idx
    out = greedy(llm, stop=words[stop_idx], include_stop_str_in_output=True)
    assert len(out.text.split()) == stop_idx + 1


def test_stop_token_ids_either_order(llm):
    ids = greedy(llm).token_ids
    first, second = ids[5], ids[6]
    assert first not in ids[:5]
    for stop_ids in ([second, first], [first, second]):
        out = greedy(llm, stop_token_ids=stop_ids)
        assert out.token_ids[-1] == first


def test_detokenize_false_leaves_text_empty(llm):
    out = gen(llm, PROMPT, SamplingParams(detokenize=False))[0].outputs[0]
    assert len(out.token_ids) > 0 and len(out.text) == 0


def test_detokenize_false_with_logprobs(llm):
    # vLLM's scenario (its prompt_logprobs half is skipped below): no text, and every
    # Logprob.decoded_token is None
    out = gen(llm, PROMPT, SamplingParams(detokenize=False, logprobs=3))[0].outputs[0]
    assert len(out.token_ids) > 0 and len(out.text) == 0
    assert len(out.logprobs) > 1
    for position in out.logprobs:
        assert 3 <= len(position) <= 4
        assert all(lp.decoded_token is None for lp in position.values())


def test_detokenize_false_with_prompt_logprobs(llm):
    out = gen(llm, PROMPT, SamplingParams(detokenize=False, logprobs=3, prompt_logprobs=3))[0]
    assert len(out.outputs[0].token_ids) > 0 and len(out.outputs[0].text) == 0
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None
    for position in out.prompt_logprobs[1:]:
        assert 3 <= len(position) <= 4
        assert all(lp.decoded_token is None for lp in position.values())


def test_bad_words_two_rounds(llm):
    # vLLM bans a phrase after a space only when it tokenizes into as many tokens as the bare
    # phrase: true of this prompt's words (and of the last word once the
    # first two are banned) with the SmolLM2 tokenizer (Llama-2's in vLLM's test)
    words = greedy(llm, BAD_PHRASE_PROMPT, max_tokens=12).text.split()
    bad_1 = " ".join(words[:2])
    assert _bannable(llm.get_tokenizer(), bad_1)
    text = greedy(llm, BAD_PHRASE_PROMPT, max_tokens=12, bad_words=[bad_1]).text
    assert bad_1 not in text
    bad_2 = text.split()[-1]
    assert _bannable(llm.get_tokenizer(), bad_2)
    text = greedy(llm, BAD_PHRASE_PROMPT, max_tokens=12, bad_words=[bad_1, bad_2]).text
    assert bad_1 not in text and bad_2 not in text


def test_logits_processors_are_refused(llm):
    def pick_ith(token_ids, logits):
        logits[len(token_ids)] = float("inf")
        return logits

    with pytest.raises(ValueError):
        gen(llm, PROMPT, SamplingParams(logits_processors=[pick_ith]))


def test_allowed_token_ids(llm):
    out = gen(llm, PROMPT, SamplingParams(allowed_token_ids=[10]))[0].outputs[0]
    assert out.token_ids[-1] == 10
    with pytest.raises(ValueError):
        gen(llm, PROMPT, SamplingParams(allowed_token_ids=[]))
    with pytest.raises(ValueError):
        gen(llm, PROMPT, SamplingParams(allowed_token_ids=[-1]))
    with pytest.raises(ValueError):
        gen(llm, PROMPT, SamplingParams(allowed_token_ids=[10000000]))


def test_seed_decides_randomness(llm):
    texts = [gen(llm, PROMPT, SamplingParams(seed=s))[0].outputs[0].text for s in (42, 42, 43)]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


# ---- tests/samplers/test_ignore_eos.py -----------------------------------------------------


def test_ignore_eos_reaches_max_tokens(llm):
    max_tokens = 48
    for prompt in EXAMPLE_PROMPTS:
        out = gen(llm, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].outputs[0]
        assert len(out.token_ids) == max_tokens


def test_ignore_eos_even_when_eos_is_likeliest(llm):
    eos = llm.get_tokenizer().eos_token_id
    out = gen(llm, PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={eos: 100.0}))[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    out = gen(llm, PROMPT, SamplingParams(max_tokens=8, logit_bias={eos: 100.0}))[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None


# ---- tests/samplers/test_no_bad_words.py ----------------------------------------------------


def _bannable(tok, word):
    bare = tok.encode(word, add_special_tokens=False)
    spaced = tok.encode(" " + word, add_special_tokens=False)
    return len(bare) == len(spaced) and bare[0] != spaced[0]


def test_one_token_bad_word(llm):
    tok = llm.get_tokenizer()
    ref = greedy(llm, "How old are you? I am 10").token_ids
    # the first generated word that is one token with or without its leading space
    target = next(
        t
        for t in ref
        if len(tok.encode(tok.decode([t]).strip(), add_special_tokens=False)) == 1 and tok.decode([t]).startswith(" ")
    )
    out = greedy(llm, "How old are you? I am 10", bad_words=[tok.decode([target]).strip()])
    assert target not in out.token_ids


def _contains(seq, sub):
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_two_token_bad_word(llm):
    tok = llm.get_tokenizer()
    ref = greedy(llm, BAD_WORDS_PROMPT).token_ids
    word = tok.decode(ref[:2]).strip()  # a word the model writes as two tokens
    assert tok.encode(" " + word, add_special_tokens=False) == ref[:2] and _bannable(tok, word)
    out = greedy(llm, BAD_WORDS_PROMPT, bad_words=[word]).token_ids
    # the first token is still free; only the completion of the word is banned
    assert out[0] == ref[0]
    assert out[:2] != ref[:2]
    assert not _contains(out, ref[:2])
    neighbour = tok.decode(out[:2]).strip()
    assert _bannable(tok, neighbour)
    out2 = greedy(llm, BAD_WORDS_PROMPT, bad_words=[word, neighbour]).token_ids
    assert out2[0] == ref[0]
    assert not _contains(out2, ref[:2]) and not _contains(out2, out[:2])


# ---- tests/samplers/test_logprobs.py --------------------------------------------------------


def test_sample_logprobs_match_transformers(llm, tiny_llama):
    k, max_tokens = 6, 5
    outs = gen(llm, EXAMPLE_PROMPTS, SamplingParams(max_tokens=max_tokens, logprobs=k, temperature=0.0))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for result in outs:
        c = result.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == max_tokens
        assert all(len(position) == k for position in c.logprobs)
        top_text = "".join(next(iter(position.values())).decoded_token for position in c.logprobs)
        assert c.text == top_text
        ids = torch.tensor([result.prompt_token_ids + c.token_ids[:-1]])
        with torch.inference_mode():
            ref = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
        start = len(result.prompt_token_ids) - 1
        for i, position in enumerate(c.logprobs):
            for token_id, lp in position.items():
                torch.testing.assert_close(lp.logprob, ref[start + i, token_id].item(), atol=1e-2, rtol=1e-2)
                assert isinstance(lp.decoded_token, str)


def test_prompt_logprobs_match_transformers(llm, tiny_llama):
    k = 6
    outs = gen(llm, EXAMPLE_PROMPTS, SamplingParams(max_tokens=2, prompt_logprobs=k, temperature=0.0))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for result in outs:
        ids = result.prompt_token_ids
        assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(ids)
        assert result.prompt_logprobs[0] is None
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        for pos, position in enumerate(result.prompt_logprobs[1:], start=1):
            assert ids[pos] in position and len(position) in (k, k + 1)
            for token_id, lp in position.items():
                torch.testing.assert_close(lp.logprob, ref[pos - 1, token_id].item(), atol=1e-2, rtol=1e-2)
                assert isinstance(lp.decoded_token, str)
