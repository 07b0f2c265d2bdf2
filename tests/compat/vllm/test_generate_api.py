"""vLLM's ``LLM.generate``/``LLM.chat`` API scenarios, on dfllm.

Follows vLLM's ``tests/entrypoints/llm/test_generate.py`` (per-prompt SamplingParams lists,
priority, max_model_len, metrics) and ``tests/entrypoints/llm/test_chat.py`` (one and several
conversations, no double BOS). The model is the tiny random Llama with SmolLM2's tokenizer
and chat template.
"""

from __future__ import annotations

import pytest

from dfllm import LLM, SamplingParams

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
TOKEN_IDS = [[0], [0, 1], [0, 2, 1], [0, 3, 1, 2]]
SHORT = dict(max_tokens=8)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, max_num_seqs=8, max_model_len=128, disable_log_stats=False)


def gen(llm, prompts, params=None, **kw):
    return llm.generate(prompts, params, use_tqdm=False, **kw)


# ---- tests/entrypoints/llm/test_generate.py ------------------------------------------------


@pytest.mark.slow
def test_multiple_sampling_params(llm):
    params = [SamplingParams(temperature=t, top_p=0.95, **SHORT) for t in (0.01, 0.3, 0.7, 0.99)]
    assert len(gen(llm, PROMPTS, params)) == len(PROMPTS)
    with pytest.raises(ValueError):  # vLLM's VLLMValidationError is a ValueError
        gen(llm, PROMPTS, params[:3])
    assert len(gen(llm, PROMPTS, SamplingParams(temperature=0.3, top_p=0.95, **SHORT))) == len(PROMPTS)
    assert len(gen(llm, PROMPTS, None)) == len(PROMPTS)


def test_token_id_prompts(llm):
    outs = gen(llm, [{"prompt_token_ids": ids} for ids in TOKEN_IDS], SamplingParams(temperature=0.0, **SHORT))
    assert [o.prompt_token_ids for o in outs] == TOKEN_IDS
    assert all(len(o.outputs[0].token_ids) > 0 for o in outs)


def test_priority_none_or_zeros(llm):
    assert len(gen(llm, PROMPTS, None, priority=None)) == len(PROMPTS)
    assert len(gen(llm, PROMPTS, None, priority=[0] * len(PROMPTS))) == len(PROMPTS)
    assert len(gen(llm, PROMPTS[0], None, priority=[0])) == 1


def test_nonzero_priority(tiny_llama):
    # under scheduling_policy="priority", nonzero priorities are accepted (outputs in input order)
    prio = LLM(tiny_llama, max_num_seqs=8, max_model_len=128, scheduling_policy="priority")
    greedy = SamplingParams(temperature=0.0, **SHORT)
    outs = gen(prio, PROMPTS, greedy, priority=[3, 0, 2, 1])
    assert [o.prompt for o in outs] == PROMPTS
    assert len(gen(prio, PROMPTS[0], greedy, priority=5)) == 1


def test_nonzero_priority_on_the_default_policy(llm):
    # under the default scheduling_policy="fcfs" any priority is accepted, as in vLLM
    assert len(gen(llm, PROMPTS, None, priority=[1] * len(PROMPTS))) == len(PROMPTS)
    assert len(gen(llm, PROMPTS[0], None, priority=1)) == 1


def test_priority_as_int_and_wrong_lengths(llm):
    # vLLM takes an int for all prompts, and refuses a list of the wrong length
    assert len(gen(llm, PROMPTS, None, priority=0)) == len(PROMPTS)
    for bad in ([0] * 3, []):
        with pytest.raises(ValueError, match="priorities for 4 prompts"):
            gen(llm, PROMPTS, None, priority=bad)


def test_chat_template_kwargs_reach_the_template(llm):
    # vLLM's test_chat_extra_kwargs: extra variables for the chat template
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!!!{% endif %}"
    conv = [{"role": "user", "content": "hi"}]
    plain = llm.chat(conv, SamplingParams(max_tokens=1), chat_template=template, use_tqdm=False)[0]
    loud = llm.chat(
        conv, SamplingParams(max_tokens=1), chat_template=template, use_tqdm=False, chat_template_kwargs={"shout": True}
    )[0]
    assert loud.prompt == plain.prompt + "!!!"


def test_lora_request_is_refused(llm):
    # dfllm has no LoRA; only lora_request=None is accepted
    assert len(gen(llm, PROMPTS[0], None, lora_request=None)) == 1
    with pytest.raises(ValueError, match="lora_request"):
        gen(llm, PROMPTS[0], None, lora_request=object())


def test_max_model_len_bounds_prompt_plus_output(tiny_llama):
    max_model_len = 20
    small = LLM(tiny_llama, max_num_seqs=4, max_model_len=max_model_len)
    for out in small.generate(PROMPTS, SamplingParams(max_tokens=max_model_len + 10), use_tqdm=False):
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) <= max_model_len


def test_log_stats_gives_metrics(llm):
    assert all(out.metrics is not None for out in gen(llm, PROMPTS, SamplingParams(**SHORT)))


# ---- tests/entrypoints/llm/test_chat.py ----------------------------------------------------

SYSTEM = {"role": "system", "content": "You are a helpful assistant"}


def test_chat(llm):
    messages = [SYSTEM, {"role": "user", "content": "Explain the concept of entropy."}]
    assert len(llm.chat(messages, SamplingParams(**SHORT), use_tqdm=False)) == 1


def test_multi_chat(llm):
    conversations = [
        [SYSTEM, {"role": "user", "content": "Explain the concept of entropy."}],
        [SYSTEM, {"role": "user", "content": "Explain what among us is."}],
    ]
    assert len(llm.chat(conversations, SamplingParams(**SHORT), use_tqdm=False)) == 2


def test_chat_tokenization_no_double_bos(llm):
    outs = llm.chat([SYSTEM, {"role": "user", "content": "Hello!"}], SamplingParams(**SHORT), use_tqdm=False)
    assert len(outs) == 1
    ids = outs[0].prompt_token_ids
    bos = llm.get_tokenizer().bos_token_id
    assert ids[0] == bos
    assert ids[1] != bos, "Double BOS"


@pytest.mark.skip(
    reason="multimodal: dfllm serves text-only models (vLLM's test_chat_multi_image/pil_image use Phi-3.5-vision)"
)
def test_chat_multi_image():
    pass
