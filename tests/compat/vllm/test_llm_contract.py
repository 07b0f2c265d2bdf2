"""The rest of vLLM's offline ``LLM`` contract (issue #32), on the tiny Llama of the fixtures.

Written from vLLM's documented behaviour: ``wake_up`` answers whether the engine is fully
awake and goes through ``llm_engine`` only; ``skip_tokenizer_init=True`` takes token ids and
refuses only what needs a tokenizer, at ``generate``; ``priority=`` works on a default
engine; ``best_of`` fails at ``generate``, not when the params are built; vLLM's error texts
come first; Polars expressions have ``score``. Also: every output-deciding field of
``StructuredOutputsParams`` is part of a request's identity (deduplication, resume keys).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import polars as pl
import pytest

from dfllm import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams, VLLMValidationError

ENGINE = dict(max_num_seqs=8, max_model_len=128, kv_cache_memory_bytes=2**22)
PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, **ENGINE)


@pytest.fixture(scope="module")
def bare(tiny_llama):
    return LLM(tiny_llama, skip_tokenizer_init=True, **ENGINE)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def nothing_queued(llm) -> bool:
    return llm.engine.get_num_unfinished_requests() == 0


# ---- 1. wake_up answers whether the engine is fully awake ---------------------------------------
@pytest.mark.slow
def test_wake_up_returns_whether_fully_awake(tiny_llama):
    llm = LLM(tiny_llama, **ENGINE)
    want = token_ids(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))
    assert llm.wake_up() is True  # never slept
    llm.sleep(level=1)
    assert llm.wake_up(["weights"]) is False  # the KV cache is still released
    assert llm.wake_up(["scheduling"]) is False  # vLLM's tag: accepted, restores nothing here
    assert llm.wake_up(["kv_cache"]) is True
    assert token_ids(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == want
    llm.sleep(level=2)
    assert llm.wake_up() is True
    assert token_ids(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == want


def test_wake_up_goes_through_llm_engine_only(tiny_llama):
    """vLLM's contract: ``LLM.wake_up`` works on an object holding nothing but ``llm_engine``."""
    llm = LLM(tiny_llama, **ENGINE)
    llm.sleep(level=1)
    holder = SimpleNamespace(llm_engine=llm.llm_engine)
    assert LLM.wake_up(holder, ["weights"]) is False
    assert LLM.wake_up(holder, None) is True
    assert not llm.engine.asleep
    with pytest.raises(ValueError, match="wake_up tags"):
        LLM.wake_up(holder, ["everything"])


# ---- 2. skip_tokenizer_init=True --------------------------------------------------------------
def test_skip_tokenizer_init_takes_token_ids_and_gives_empty_text(llm, bare):
    prompts = [{"prompt_token_ids": ids} for ids in llm.get_tokenizer()(PROMPTS)["input_ids"]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    want, got = llm.generate(prompts, params, use_tqdm=False), bare.generate(prompts, params, use_tqdm=False)
    assert bare.tokenizer is None
    assert token_ids(got) == token_ids(want)
    assert all(o.outputs[0].text == "" for o in got) and all(o.outputs[0].text for o in want)
    assert [o.prompt_token_ids for o in got] == [p["prompt_token_ids"] for p in prompts]
    assert all(lp.decoded_token is None for step in got[0].outputs[0].logprobs for lp in step.values())
    stop_id = want[0].outputs[0].token_ids[2]  # token-level stops work without a tokenizer
    stopped = bare.generate(
        prompts[0],
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    free = bare.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    full = llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert (free.token_ids, free.finish_reason) == (full.token_ids, full.finish_reason)  # same end-of-sequence


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda m: m.generate("text", GREEDY, use_tqdm=False),
            "You cannot pass text prompts when `skip_tokenizer_init`",
        ),
        (lambda m: m.generate([{"prompt_token_ids": [1, 2]}, "text"], GREEDY, use_tqdm=False), "prompt 1"),
        (
            lambda m: m.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False),
            "Unable to get tokenizer because skip_tokenizer_init is True",
        ),
        (
            lambda m: m.generate({"prompt_token_ids": [1, 2]}, SamplingParams(stop=["x"]), use_tqdm=False),
            "stop cannot be used with 'skip_tokenizer_init'",
        ),
        (
            lambda m: m.generate({"prompt_token_ids": [1, 2]}, SamplingParams(bad_words=["x"]), use_tqdm=False),
            "bad_words cannot be used with 'skip_tokenizer_init'",
        ),
        (
            lambda m: m.generate(
                {"prompt_token_ids": [1, 2]}, SamplingParams(structured_outputs={"regex": "a+"}), use_tqdm=False
            ),
            "Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'",
        ),
        (lambda m: m.enqueue("text"), "You cannot pass text prompts"),
    ],
)
def test_skip_tokenizer_init_refuses_what_needs_a_tokenizer_at_generate(bare, call, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        call(bare)
    assert nothing_queued(bare)
    with pytest.raises(ValueError, match="Unable to get tokenizer because skip_tokenizer_init is True"):
        bare.get_tokenizer()
    with pytest.raises(ValueError, match="skip_tokenizer_init must be a bool"):
        LLM("/nonexistent/model", skip_tokenizer_init="yes")


def test_skip_tokenizer_init_on_a_pooling_model():
    full, bare = LLM("all-minilm-l6-v2"), LLM("all-minilm-l6-v2", skip_tokenizer_init=True)
    ids = full.get_tokenizer()("A cat sleeps.")["input_ids"]
    want = full.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding
    assert bare.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding == pytest.approx(want)
    with pytest.raises(ValueError, match="You cannot pass text prompts when `skip_tokenizer_init` is True"):
        bare.embed(["A cat sleeps."], use_tqdm=False)
    with pytest.raises(ValueError, match="You cannot pass text prompts when `skip_tokenizer_init` is True"):
        bare.score("a", "b", use_tqdm=False)


# ---- 3. priority on the default (fcfs) engine ---------------------------------------------------
def test_priority_on_a_default_engine(llm):
    assert llm.config.scheduling_policy == "fcfs"
    want = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert token_ids(llm.generate(PROMPTS, GREEDY, priority=[0] * len(PROMPTS), use_tqdm=False)) == want
    assert token_ids(llm.generate(PROMPTS, GREEDY, priority=1, use_tqdm=False)) == want
    assert token_ids(llm.generate(PROMPTS, GREEDY, priority=[3, -1, 2, 0], use_tqdm=False)) == want
    assert len(llm.generate(PROMPTS[0], GREEDY, priority=[0], use_tqdm=False)) == 1
    assert len(llm.generate(PROMPTS[0], GREEDY, priority=1, use_tqdm=False)) == 1
    conv = [{"role": "user", "content": "hi"}]
    assert len(llm.chat([conv, conv], GREEDY, priority=[5, 1], use_tqdm=False)) == 2
    ids = llm.enqueue(PROMPTS[:2], GREEDY, priority=7)
    assert [o.request_id for o in llm.wait_for_completion(use_tqdm=False)] == ids


@pytest.mark.parametrize("priority", [[0] * (len(PROMPTS) - 1), [], [0] * (len(PROMPTS) + 1)])
def test_priority_list_of_another_length_is_a_validation_error(llm, priority):
    with pytest.raises(VLLMValidationError) as info:
        llm.generate(PROMPTS, GREEDY, priority=priority, use_tqdm=False)
    assert str(info.value).startswith(
        f"The lengths of prompts ({len(PROMPTS)}) and priority ({len(priority)}) must be the same."
    )
    assert info.value.parameter == "priority" and nothing_queued(llm)


# ---- 4. best_of fails at generate, not when built --------------------------------------------
def test_best_of_is_refused_by_generate(llm):
    params = SamplingParams(n=2, best_of=3)  # built, as by vLLM
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(PROMPTS[:2], [SamplingParams(), params], use_tqdm=False)
    assert str(info.value).startswith("vLLM V1 does not yet support best_of.")
    assert "prompt 1" in str(info.value) and info.value.parameter == "best_of" and nothing_queued(llm)
    with pytest.raises(ValueError, match="does not yet support best_of"):
        llm.enqueue(PROMPTS[0], params)
    assert nothing_queued(llm)
    out = llm.generate(PROMPTS[0], SamplingParams(n=2, best_of=2, seed=1, max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs) == 2  # best_of == n asks nothing more
    with pytest.raises(
        ValueError, match=re.escape("best_of must be greater than or equal to n, got n=2 and best_of=1.")
    ):
        SamplingParams(n=2, best_of=1)


# ---- 5. vLLM's error texts first -------------------------------------------------------------
def test_empty_prompt_has_vllms_text(llm):
    for prompt in ([""], ["ok", {"prompt_token_ids": []}]):
        with pytest.raises(ValueError) as info:
            llm.generate(prompt, use_tqdm=False)
        assert str(info.value).startswith("The decoder prompt cannot be empty (")  # vLLM 0.32's words
        assert f"prompt {len(prompt) - 1} is empty" in str(info.value)  # then dfllm's: which one


@pytest.mark.parametrize(
    "grammar,vllm",
    [
        ("not a grammar", "Failed to convert the grammar from Lark to EBNF."),
        ("root ::= undefined_rule", "Failed to convert the grammar: Invalid grammar specification."),
    ],
)
def test_invalid_grammar_raises_vllms_validation_error_at_generate(llm, grammar, vllm):
    params = SamplingParams(
        temperature=0.8, top_p=0.95, max_tokens=20, structured_outputs=StructuredOutputsParams(grammar=grammar)
    )  # built, as by vLLM
    with pytest.raises(VLLMValidationError) as info:
        llm.generate(PROMPTS[0], sampling_params=params, use_tqdm=False)
    assert isinstance(info.value, ValueError) and str(info.value).startswith(vllm)
    assert "structured_outputs.grammar" in str(info.value) and nothing_queued(llm)
    good = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs={"grammar": 'root ::= "ab" | "cd"'})
    assert llm.generate(PROMPTS[0], good, use_tqdm=False)[0].outputs[0].text in ("ab", "cd")


VLLM_TEXTS = [  # (kwargs, vLLM's message, then dfllm's detail that follows it)
    (dict(n=0), "n must be at least 1, got 0.", "n must be [1, 16384], got 0"),
    (dict(temperature=-0.5), "temperature must be non-negative, got -0.5.", "temperature must be >= 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5.", "top_p"),
    (dict(top_k=-2), "top_k must be 0 (disable), or at least 1, got -2.", "top_k"),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5.", "min_p"),
    (dict(presence_penalty=3.0), "presence_penalty must be in [-2, 2], got 3.0.", "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0.", "repetition_penalty"),
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0.", "max_tokens must be >= 1, got 0"),
    (
        dict(min_tokens=20, max_tokens=10),
        "min_tokens must be less than or equal to max_tokens=10, got 20.",
        "min_tokens",
    ),
    (dict(logprobs=-2), "logprobs must be non-negative or -1, got -2.", "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs must be non-negative or -1, got -2.", "prompt_logprobs"),
    (dict(stop=["ok", ""]), "stop cannot contain an empty string.", "every stop string must be a non-empty str"),
    (dict(stop=["x"], detokenize=False), "stop strings are only supported when detokenize is True.", "stop"),
    (dict(n=2, temperature=0.0), "n must be 1 when using greedy sampling, got 2.", "greedy"),
    (dict(allowed_token_ids=[]), "allowed_token_ids is not None and empty!", "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words cannot contain an empty string.", "bad_words"),
    (
        dict(logit_bias={"x": 1.0}),
        "logit_bias contains key(s) that cannot be converted to integer token IDs",
        "logit_bias",
    ),
    (
        dict(logits_processors=[abs]),
        "vLLM V1 does not support per request user provided logits processors.",
        "logits_processors",
    ),
]


@pytest.mark.parametrize("kwargs,vllm,detail", VLLM_TEXTS, ids=[str(k) for k, _, _ in VLLM_TEXTS])
def test_sampling_params_errors_start_with_vllms_text(kwargs, vllm, detail):
    with pytest.raises(VLLMValidationError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(vllm) and detail in message, message
    assert info.value.parameter in message  # names the field


def test_request_errors_start_with_vllms_text(llm):
    vocab = llm.config.model.vocab_size

    def refused(call) -> str:
        with pytest.raises(VLLMValidationError) as info:
            call()
        assert nothing_queued(llm)
        return str(info.value)

    assert refused(lambda: llm.generate({"prompt_token_ids": [1, vocab]}, use_tqdm=False)).startswith(
        f"Token id {vocab} is out of vocabulary (prompt 0:"
    )
    assert refused(lambda: llm.generate({"prompt_token_ids": [5] * 129}, use_tqdm=False)).startswith(
        "This model's maximum context length is 128 tokens. However, your prompt contains at least 129 input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
        "prompt. (prompt 0"
    )
    assert refused(lambda: llm.generate("hi", SamplingParams(logprobs=21), use_tqdm=False)).startswith(
        "Requested sample logprobs of 21, which is greater than max allowed: 20 (prompt 0:"
    )
    assert refused(lambda: llm.generate("hi", SamplingParams(allowed_token_ids=[vocab]), use_tqdm=False)).startswith(
        "allowed_token_ids contains out-of-vocab token id!"
    )
    assert refused(lambda: llm.generate("hi", SamplingParams(stop_token_ids=[vocab]), use_tqdm=False)).startswith(
        f"token_id(s) [{vocab}] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: {vocab}"
    )
    assert refused(lambda: llm.generate(PROMPTS, [GREEDY] * 3, use_tqdm=False)).startswith(
        "The lengths of prompts (4) and params (3) must be the same. (got 3 sampling_params for 4 prompts)"
    )
    assert refused(lambda: llm.generate("hi", lora_request=object(), use_tqdm=False)).startswith("Got lora_request")


@pytest.mark.parametrize(
    "kwargs,vllm",
    [
        (dict(regex="(a"), "Failed to transform regex into a grammar:"),
        (dict(json={"type": "nonsense"}), "Failed to transform json schema into a grammar:"),
        (dict(json="{nope"), "Invalid JSON grammar specification."),
        (dict(choice=[]), "Choice '[]' cannot be an empty list"),
        (dict(grammar=" "), "structured_outputs.grammar cannot be an empty string"),
        (dict(), "You must use one kind of structured outputs constraint but none are specified"),
        (dict(regex="a", choice=["a"]), "You can only use one kind of structured outputs constraint but multiple"),
    ],
)
def test_structured_outputs_errors_start_with_vllms_text(kwargs, vllm):
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(**kwargs)
    assert str(info.value).startswith(vllm) and "structured_outputs" in str(info.value)


# ---- 6. Polars expressions have score -----------------------------------------------------------
def test_polars_expression_score_matches_the_frames():
    df = pl.DataFrame(
        {
            "a": ["Paris is in France.", None, "A cat sleeps."],
            "b": ["The capital of France", "anything", "A dog barks."],
        }
    )
    want = df.llm.score("a", "b")["score"]
    got = df.with_columns(pl.col("a").llm.score(pl.col("b")).alias("s"))
    assert got.schema["s"] == pl.Float64 and got["s"].to_list()[1] is None
    assert got["s"].to_list() == pytest.approx(want.to_list(), nan_ok=True)
    by_name = df.lazy().with_columns(pl.col("a").llm.score("b")).collect()
    assert by_name["a"].to_list() == pytest.approx(want.to_list(), nan_ok=True)  # named after the left input
    query = df.with_columns(pl.col("b").llm.score(pl.lit("France")).alias("s"))["s"]
    each = pl.DataFrame({"b": df["b"], "q": ["France"] * 3}).llm.score("b", "q")["score"]
    assert query.to_list() == pytest.approx(each.to_list())


# ---- StructuredOutputsParams: every output-deciding field is in the identity ------------------
def test_disable_any_whitespace_is_part_of_the_identity(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compact = StructuredOutputsParams(json=schema)
    spaced = StructuredOutputsParams(json=schema, disable_any_whitespace=False)
    assert compact.key != spaced.key and compact != spaced and repr(compact) != repr(spaced)
    assert compact == StructuredOutputsParams(json=schema, disable_any_whitespace=True)  # both compact JSON
    params = [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=so) for so in (compact, spaced)]
    assert repr(params[0]) != repr(params[1])  # what the engine's deduplication and resume keys read
    prompt = {"prompt_token_ids": [1, 5, 9, 13, 17]}

    def merged(ps) -> int:
        before = int(llm.engine.metrics.deduplicated._value.get())
        llm.generate([prompt] * len(ps), ps, use_tqdm=False)
        return int(llm.engine.metrics.deduplicated._value.get()) - before

    assert merged([params[0], params[0]]) == 1  # identical requests are computed once
    assert merged(params) == 0  # these two are not the same request
