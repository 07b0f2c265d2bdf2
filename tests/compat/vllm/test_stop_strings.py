"""vLLM's stopping scenarios (stop strings, stop token ids, stop reasons, min_tokens), on dfllm.

Follows vLLM's ``tests/detokenizer/test_stop_strings.py`` (basic, multi-token and partial-token
stop strings, stop token ids, with and without ``include_stop_str_in_output``),
``tests/detokenizer/test_stop_reason.py``, ``tests/detokenizer/test_stop_token_ids.py`` and
``tests/detokenizer/test_min_tokens.py``. Expected texts are cut from the tiny random Llama's
own greedy output, where vLLM's tests hard-code Llama-2's.
"""

from __future__ import annotations

import pytest

from dfllm import LLM, SamplingParams

PROMPT = "Hello my name is Robert and I"
EXAMPLE_PROMPTS = ["Hello, my name is", "The capital of France is", "The future of AI is"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, max_num_seqs=8, max_model_len=128)


@pytest.fixture(scope="module")
def ref(llm):
    """The greedy completion with no stop, and the text of each of its tokens."""
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)[0].outputs[0]
    pieces = [llm.get_tokenizer().decode(out.token_ids[: i + 1]) for i in range(len(out.token_ids))]
    assert pieces[-1] == out.text
    return out


def run(llm, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **kw)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


def check_stop(llm, ref, stop, stop_list=None):
    assert stop in ref.text
    cut = ref.text.index(stop)
    for include, expected in ((False, ref.text[:cut]), (True, ref.text[: cut + len(stop)])):
        out = run(llm, stop=stop_list or [stop], include_stop_str_in_output=include)
        assert out.text == expected
        assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_basic(llm, ref):
    # a whole word, like vLLM's "."
    check_stop(llm, ref, ref.text.split()[5])


def test_stop_multi_tokens(llm, ref):
    # a stop string spanning a token boundary, listed with one that never occurs
    words = ref.text.split()
    check_stop(llm, ref, f"{words[4]} {words[5][:4]}", [f"{words[4]} {words[5][:4]}", "zzzz-never"])


def test_stop_partial_token(llm, ref):
    # a stop string that ends inside a token (vLLM's "gani" of " organization")
    word = ref.text.split()[1]
    assert len(word) > 5
    check_stop(llm, ref, word[1:5])


def test_stop_token_id(llm, ref):
    tok = llm.get_tokenizer()
    idx = 5
    stop_id = ref.token_ids[idx]
    assert stop_id not in ref.token_ids[:idx]
    out = run(llm, stop_token_ids=[stop_id])
    assert out.text == tok.decode(ref.token_ids[:idx])
    assert out.token_ids == ref.token_ids[: idx + 1]  # the stop token stays in token_ids
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    out = run(llm, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert out.text == tok.decode(ref.token_ids[: idx + 1])
    assert out.stop_reason == stop_id


def test_stop_string_and_stop_token_id_together(llm, ref):
    # the stop string comes first: text cut there, the later stop id plays no part
    tok = llm.get_tokenizer()
    word = ref.text.split()[2]
    later_id = ref.token_ids[-2]
    assert ref.text.index(word) < len(tok.decode(ref.token_ids[:-2]))
    out = run(llm, stop=[word], stop_token_ids=[later_id])
    assert out.text == ref.text[: ref.text.index(word)]
    assert out.stop_reason == word


def test_stop_token_id_groups(llm, ref):
    # vLLM's _stop_token_id_multi: a group ends the output when the tokens end with it; its
    # reason is the group as a string; groups are checked before single ids
    ids, tok = ref.token_ids, llm.get_tokenizer()
    assert len(set(ids[:8])) == 8  # the positions used below are first occurrences

    def text(n):
        return tok.decode(ids[:n])

    def check(stop_token_ids, include, expected, reason, detokenize=True):
        out = run(llm, stop_token_ids=stop_token_ids, include_stop_str_in_output=include, detokenize=detokenize)
        assert (out.text if detokenize else tok.decode(out.token_ids)) == expected
        assert out.finish_reason == "stop" and out.stop_reason == reason

    group, never = ids[5:8], next(t for t in range(3, 1000) if t not in ids)
    check([[ids[4]]], False, text(4), f"[{ids[4]}]")  # a single grouped id
    check([[ids[4]]], True, text(5), f"[{ids[4]}]")
    check([group, never], False, text(5), str(group))  # a group beside a single id
    check([group, never], True, text(8), str(group))
    for include in (False, True):  # no detokenizer: the token ids keep the group either way
        check([group, never], include, text(8), str(group), detokenize=False)
    check([ids[5], group], False, text(5), ids[5])  # the single id comes first
    check([ids[5], group], True, text(6), ids[5])
    check([ids[7], group], True, text(8), str(group))  # both end here: the group wins
    check([ids[7], group], True, text(8), str(group), detokenize=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[[]])


# ---- tests/detokenizer/test_stop_reason.py -------------------------------------------------


def test_stop_reason_stop_token(llm):
    seeded = SamplingParams(ignore_eos=True, seed=42, max_tokens=MAX_TOKENS)
    firsts = llm.generate(EXAMPLE_PROMPTS, seeded, use_tqdm=False)
    params = [
        SamplingParams(ignore_eos=True, seed=42, max_tokens=MAX_TOKENS, stop_token_ids=[o.outputs[0].token_ids[8]])
        for o in firsts
    ]
    for out, p in zip(llm.generate(EXAMPLE_PROMPTS, params, use_tqdm=False), params):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == p.stop_token_ids[0]


def test_stop_reason_stop_string(llm):
    firsts = llm.generate(
        EXAMPLE_PROMPTS, SamplingParams(ignore_eos=True, seed=42, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    stops = [o.outputs[0].text.split()[2][:3] for o in firsts]
    params = [SamplingParams(ignore_eos=True, seed=42, max_tokens=MAX_TOKENS, stop=s) for s in stops]
    for out, stop in zip(llm.generate(EXAMPLE_PROMPTS, params, use_tqdm=False), stops):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop


def test_stop_reason_eos(llm):
    for out in llm.generate(EXAMPLE_PROMPTS, SamplingParams(seed=42, max_tokens=MAX_TOKENS), use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "length" or (c.finish_reason == "stop" and c.stop_reason is None)
    # the end-of-sequence token made likeliest: it ends the completion, in token_ids, not in text
    eos = llm.get_tokenizer().eos_token_id
    forced = SamplingParams(max_tokens=MAX_TOKENS, logit_bias={eos: 100.0})
    c = llm.generate(PROMPT, forced, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason is None
    assert c.token_ids == [eos] and c.text == ""


# ---- tests/detokenizer/test_min_tokens.py, test_stop_token_ids.py ----------------------------


@pytest.mark.parametrize("stop", [None, "e"])
def test_min_tokens_zero_with_stop(llm, ref, stop):
    out = run(llm, stop=stop, min_tokens=0)
    truth = ref.text if stop is None else ref.text[: ref.text.index(stop)]
    assert out.text == truth


def test_stop_token_id_before_min_tokens_is_held_back(llm, ref):
    # vLLM bans stop ids (and EOS) while fewer than min_tokens tokens are out
    stop_id = ref.token_ids[1]
    out = run(llm, stop_token_ids=[stop_id], min_tokens=5)
    assert stop_id not in out.token_ids[:5]
    assert out.finish_reason == "length" or (out.token_ids[-1] == stop_id and len(out.token_ids) > 5)
    eos = llm.get_tokenizer().eos_token_id
    out = run(llm, min_tokens=3, logit_bias={eos: 100.0})
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos and out.finish_reason == "stop"


def test_stop_string_is_not_looked_for_in_the_min_tokens_text(llm, ref):
    """vLLM (its incremental detokenizer) ignores stop strings in the text of the first
    min_tokens tokens: the first "e" after that text stops the completion."""
    tok = llm.get_tokenizer()
    for k in (3, 5):
        held = tok.decode(ref.token_ids[:k])  # the text of the first k tokens
        after = ref.text.find("e", len(held))
        out = run(llm, stop=["e"], min_tokens=k)
        if after < 0:
            assert out.text == ref.text and out.finish_reason == "length"
        else:
            assert out.text == ref.text[:after] and out.stop_reason == "e"
