"""Request validation as vLLM does it: one error class, vLLM's phrases, ``max_logprobs``.

Every refused request raises :class:`dfllm.InvalidRequestError` (a ``ValueError``, vLLM's
``VLLMValidationError``) before any work starts. Its message keeps dfllm's wording (which
prompt, which field) and carries vLLM's own phrase (from ``vllm/v1/engine/input_processor.py``
and ``vllm/sampling_params.py``), so code matching vLLM's messages keeps working, and so do
the dataframe accessors' per-row errors. Real tiny models throughout.
"""

from __future__ import annotations

import pickle

import pandas as pd
import pytest

from dfllm import LLM, InvalidRequestError, PoolingParams, SamplingParams, VLLMValidationError
from dfllm.config import EngineConfig
from dfllm.engine_args import EngineArgs

MAX_LEN = 64
ENGINE = dict(max_num_seqs=8, max_model_len=MAX_LEN, kv_cache_memory_bytes=2**22)
SP = dict(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, **ENGINE)


@pytest.fixture(scope="module")
def vocab(llm):
    return llm.config.model.vocab_size


@pytest.fixture(scope="module")
def embedder():
    return LLM("all-minilm-l6-v2")


def refused(call, *match: str) -> InvalidRequestError:
    """Run ``call``; it must raise InvalidRequestError whose message holds every ``match``."""
    with pytest.raises(InvalidRequestError) as info:
        call()
    for m in match:
        assert m in str(info.value), (m, str(info.value))
    return info.value


def test_the_error_class():
    assert issubclass(InvalidRequestError, ValueError) and VLLMValidationError is InvalidRequestError
    err = InvalidRequestError("prompt 0: bad", parameter="logprobs", value=21)
    back = pickle.loads(pickle.dumps(err))  # accessors' workers send errors back pickled
    assert (str(back), back.parameter, back.value) == ("prompt 0: bad", "logprobs", 21)


# ---- prompts --------------------------------------------------------------------------------
def test_empty_prompt(llm):
    err = refused(
        lambda: llm.generate(["ok", {"prompt_token_ids": []}], SamplingParams(**SP), use_tqdm=False),
        "prompt 1 is empty",
        "The decoder prompt cannot be empty",
    )
    assert isinstance(err, ValueError) and str(err).startswith("The decoder prompt cannot be empty (prompt 1")
    assert err.parameter is None  # vLLM names none
    assert llm.engine.get_num_unfinished_requests() == 0  # nothing was queued


def test_token_id_out_of_vocabulary(llm, vocab):
    refused(
        lambda: llm.generate({"prompt_token_ids": [1, vocab + 5]}, use_tqdm=False),
        "prompt 0: token id",
        f"Token id {vocab + 5} is out of vocabulary",
    )
    refused(lambda: llm.generate({"prompt_token_ids": [1, -1]}, use_tqdm=False), "Token id -1 is out of vocabulary")
    refused(lambda: llm.generate({"prompt_token_ids": [1, "2"]}, use_tqdm=False), "must be a list of ints")


def test_prompt_longer_than_max_model_len(llm):
    ids = list(range(1, MAX_LEN + 2))
    # vLLM 0.32's renderer's words (vllm/renderers/params.py), "at least" one token past the limit
    err = refused(
        lambda: llm.generate([{"prompt_token_ids": [1]}, {"prompt_token_ids": ids}], use_tqdm=False),
        f"prompt 1 has {MAX_LEN + 1} tokens, longer than max_model_len={MAX_LEN}",
        f"This model's maximum context length is {MAX_LEN} tokens. However, your prompt contains at least "
        f"{MAX_LEN + 1} input tokens, which exceeds this limit even without any output tokens.",
    )
    assert (err.parameter, err.value) == ("input_tokens", MAX_LEN + 1)
    err = refused(
        lambda: llm.generate({"prompt_token_ids": ids * 2}, use_tqdm=False),
        f"However, your prompt contains {2 * MAX_LEN + 2} input tokens, which exceeds this limit",
    )
    assert (err.parameter, err.value) == ("input_tokens", 2 * MAX_LEN + 2)
    # a text prompt: vLLM tokenizes it no further than one token past the limit
    err = refused(
        lambda: llm.generate("word " * 100, use_tqdm=False),
        f"This model's maximum context length is {MAX_LEN} tokens. However, your prompt contains at least "
        f"{MAX_LEN + 1} input tokens,",
        f"longer than max_model_len={MAX_LEN})",
    )
    assert (err.parameter, err.value) == ("input_tokens", MAX_LEN + 1)
    # and refuses it first by its length in characters, past what max_model_len of its longest tokens hold
    longest = max(len(t) for t in llm.get_tokenizer().get_vocab())
    chars = MAX_LEN * longest + 1
    err = refused(
        lambda: llm.generate("a" * chars, use_tqdm=False),
        f"This model's maximum context length is {MAX_LEN} tokens. However, your prompt contains {chars} characters "
        f"(more than {chars - 1} characters, which is the upper bound for {MAX_LEN} input tokens). Please reduce "
        "the length of the input prompt. (prompt 0 has",
    )
    assert (err.parameter, err.value) == ("input_text", chars)
    # exactly max_model_len tokens leave no room for an output token: refused, as vLLM does
    err = refused(
        lambda: llm.generate({"prompt_token_ids": ids[:MAX_LEN]}, SamplingParams(max_tokens=1), use_tqdm=False),
        f"The decoder prompt (length {MAX_LEN}) plus the number of requested output tokens (at least 1) is longer "
        f"than the maximum model length of {MAX_LEN}. Make sure that `max_model_len` is no smaller than the number "
        "of text tokens (prompt + requested output tokens).",
    )
    assert err.parameter is None  # vLLM names none
    assert llm.generate({"prompt_token_ids": ids[: MAX_LEN - 1]}, SamplingParams(max_tokens=1), use_tqdm=False)[
        0
    ].finished


def test_bad_prompt_types_and_chats(llm):
    refused(lambda: llm.generate(None, use_tqdm=False), "prompts must be")
    err = refused(lambda: llm.generate(["ok", 3.5], use_tqdm=False), "prompt 1: expected a str")
    assert str(err).startswith("Prompt should be a string, list of tokens, or dictionary (")  # vLLM 0.32's words
    refused(lambda: llm.generate("x \ud800", use_tqdm=False), "prompt 0 is not valid Unicode")
    refused(lambda: llm.generate("ok", PoolingParams(), use_tqdm=False), "sampling_params must be a SamplingParams")
    refused(
        lambda: llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False),
        "The lengths of prompts (2) and params (1) must be the same. (got 1 sampling_params for 2",
    )
    refused(lambda: llm.chat([{"role": "robot", "content": "x"}], use_tqdm=False), "conversation 0, message 0")
    refused(
        lambda: llm.chat(
            [{"role": "user", "content": "x"}], add_generation_prompt=True, continue_final_message=True, use_tqdm=False
        ),
        "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when",
        "(add_generation_prompt and continue_final_message cannot both be True)",
    )
    refused(lambda: llm.generate("ok", lora_request=object(), use_tqdm=False), "LoRA is not enabled")


def test_enqueue_refuses_and_queues_nothing(llm):
    refused(lambda: llm.enqueue(["fine", {"prompt_token_ids": []}]), "prompt 1 is empty")
    refused(lambda: llm.enqueue_chat([{"role": "user"}]), "content must be a str")
    assert llm.engine.get_num_unfinished_requests() == 0
    assert llm.wait_for_completion(use_tqdm=False) == []


# ---- sampling params checked against the model ----------------------------------------------
def test_token_ids_in_params_out_of_vocabulary(llm, vocab):
    big = vocab + 1
    refused(
        lambda: llm.generate("ok", SamplingParams(allowed_token_ids=[1, big]), use_tqdm=False),
        "prompt 0: token id",
        "allowed_token_ids contains out-of-vocab token id!",
    )
    refused(
        lambda: llm.generate("ok", SamplingParams(logit_bias={big: 1.0}), use_tqdm=False),
        f"token_id(s) [{big}] in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab}",
    )
    refused(
        lambda: llm.generate("ok", SamplingParams(stop_token_ids=[big]), use_tqdm=False),
        f"token_id(s) [{big}] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: {vocab}",
    )


def test_max_logprobs_default_is_vllms(llm, vocab):
    assert llm.config.max_logprobs == 20
    out = llm.generate("ok", SamplingParams(logprobs=20, **SP), use_tqdm=False)[0].outputs[0]
    assert all(len(step) >= 20 for step in out.logprobs)
    err = refused(
        lambda: llm.generate("ok", SamplingParams(logprobs=21, **SP), use_tqdm=False),
        "prompt 0: logprobs=21 exceeds max_logprobs=20",
        "Requested sample logprobs of 21, which is greater than max allowed: 20",
    )
    assert (err.parameter, err.value) == ("logprobs", 21)
    # -1 (the whole vocabulary) counts as the vocabulary size
    refused(
        lambda: llm.generate("ok", SamplingParams(logprobs=-1, **SP), use_tqdm=False),
        f"Requested sample logprobs of {vocab}, which is greater than max allowed: 20",
    )
    refused(
        lambda: llm.generate("ok", SamplingParams(prompt_logprobs=21, **SP), use_tqdm=False),
        "Requested prompt logprobs of 21, which is greater than max allowed: 20",
    )
    refused(
        lambda: llm.generate("ok", SamplingParams(logprobs=10**6, **SP), use_tqdm=False),
        "logprobs=1000000 exceeds the model's vocabulary",
        "max allowed: 20",
    )
    assert llm.engine.get_num_unfinished_requests() == 0


@pytest.mark.slow
def test_max_logprobs_set_and_unlimited(tiny_llama, vocab):
    five = LLM(tiny_llama, max_logprobs=5, **ENGINE)
    assert five.generate("ok", SamplingParams(logprobs=5, **SP), use_tqdm=False)[0].outputs[0].logprobs
    refused(
        lambda: five.generate(["ok", "fine"], [SamplingParams(**SP), SamplingParams(logprobs=6, **SP)], use_tqdm=False),
        "prompt 1: logprobs=6 exceeds max_logprobs=5",
        "Requested sample logprobs of 6, which is greater than max allowed: 5",
    )
    refused(lambda: five.enqueue("ok", SamplingParams(logprobs=6)), "max allowed: 5")
    everything = LLM(tiny_llama, max_logprobs=-1, **ENGINE)
    out = everything.generate("ok", SamplingParams(logprobs=-1, max_tokens=1), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs[0]) == vocab  # -1 with max_logprobs=-1: the whole vocabulary
    refused(
        lambda: everything.generate("ok", SamplingParams(logprobs=vocab + 1), use_tqdm=False),
        f"logprobs={vocab + 1} exceeds the model's vocabulary",
        f"Requested sample logprobs of {vocab + 1}, which is greater than max allowed: {vocab}",
    )


def test_max_logprobs_in_engine_config(tiny_llama):
    assert EngineConfig.create(EngineArgs(tiny_llama)).max_logprobs == 20
    assert EngineConfig.create(EngineArgs(tiny_llama, max_logprobs=None)).max_logprobs == 20
    assert EngineConfig.create(EngineArgs(tiny_llama, max_logprobs=-1)).max_logprobs == -1
    for bad in (-2, 1.5, True):
        with pytest.raises(ValueError, match="max_logprobs"):
            EngineConfig.create(EngineArgs(tiny_llama, max_logprobs=bad))


# ---- pooling --------------------------------------------------------------------------------
def test_pooling_requests(embedder):
    refused(
        lambda: embedder.embed(["ok", {"prompt_token_ids": []}], use_tqdm=False),
        "prompt 1 is empty",
        "The decoder prompt cannot be empty",
    )
    refused(
        lambda: embedder.embed({"prompt_token_ids": [101, 10**8]}, use_tqdm=False),
        "Token id 100000000 is out of vocabulary",
    )
    err = refused(lambda: embedder.embed(["ok", None], use_tqdm=False), "prompt 1: expected a str")
    assert str(err).startswith("Prompt should be a string, list of tokens, or dictionary (")  # vLLM 0.32's words
    refused(lambda: embedder.embed("ok", SamplingParams(), use_tqdm=False), "pooling_params must be a PoolingParams")
    refused(lambda: embedder.classify("ok", use_tqdm=False), "Unsupported task: 'classify'")
    refused(lambda: embedder.encode("ok", use_tqdm=False), "pooling_task must be one of")
    refused(
        lambda: embedder.embed("ok", PoolingParams(task="token_embed"), use_tqdm=False),
        "You cannot overwrite param.task='token_embed' with pooling_task='embed'!",
    )
    refused(lambda: embedder.score([], ["x"], use_tqdm=False), "At least one text element must be given")
    refused(lambda: embedder.embed("ok", truncate_prompt_tokens=0, use_tqdm=False), "truncate_prompt_tokens")


def test_generative_methods_on_the_wrong_model(llm):
    refused(lambda: llm.embed("ok"), "This model does not support pooling")


# ---- the dataframe accessors: the same messages per row --------------------------------------
@pytest.mark.slow
def test_dataframe_rows_carry_vllms_phrases(tiny_llama):
    df = pd.DataFrame({"q": ["fine", "word " * 200]})
    out = df.llm.generate("q", model=str(tiny_llama), sampling_params=SP, **ENGINE)
    assert pd.isna(out.llm_error[0])
    assert "longer than max_model_len=64" in out.llm_error[1]
    # the accessor tokenizes a column's texts together: a row's prompt is its token ids (and text)
    words = "This model's maximum context length is 64 tokens. However, your prompt contains 201 input tokens"
    assert words in out.llm_error[1]
    many = df[:1].llm.generate("q", model=str(tiny_llama), sampling_params={**SP, "logprobs": 25}, **ENGINE)
    assert "Requested sample logprobs of 25, which is greater than max allowed: 20" in many.llm_error[0]
    lifted = df[:1].llm.generate(
        "q", model=str(tiny_llama), sampling_params={**SP, "logprobs": 25}, max_logprobs=-1, **ENGINE
    )
    assert pd.isna(lifted.llm_error[0]) and isinstance(lifted.generated_text[0], str)
