"""The LLM class: inputs, outputs, ordering, stopping, chat and clear errors."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from dfllm import LLM, RequestOutput, SamplingParams

from helpers import random_prompts

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, max_num_seqs=16, max_model_len=96)


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return LLM(smollm2_dir, max_num_seqs=16, max_model_len=512)


@pytest.mark.slow
def test_outputs_in_input_order_with_fields(llm):
    prompts = ["Hello there", "A much longer prompt about the weather in spring", "x", "Numbers: 1 2 3"]
    max_tokens = [9, 2, 14, 5]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in max_tokens], use_tqdm=False)
    tok = llm.get_tokenizer()
    assert [o.prompt for o in outs] == prompts
    assert len({o.request_id for o in outs}) == 4
    for o, p, n in zip(outs, prompts, max_tokens):
        assert isinstance(o, RequestOutput) and o.finished
        assert o.prompt_token_ids == tok.encode(p)
        c = o.outputs[0]
        assert len(c.token_ids) == n and c.finish_reason == "length" and c.stop_reason is None
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    single = llm.generate("Hello there", SamplingParams(max_tokens=9, **GREEDY), use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_text_is_incremental_decode_of_tokens(llm):
    outs = llm.generate(
        ["The quick brown fox", "Once upon a time"], SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False
    )
    tok = llm.get_tokenizer()
    for o in outs:
        full = tok.decode(o.prompt_token_ids + o.outputs[0].token_ids, skip_special_tokens=True)
        prompt = tok.decode(o.prompt_token_ids, skip_special_tokens=True)
        assert prompt + o.outputs[0].text == full


def test_stop_string_across_token_boundary(llm):
    prompt = "Tell me a story"
    full = llm.generate(prompt, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0].outputs[0].text
    head = llm.generate(prompt, SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)[0].outputs[0].text
    cut = len(head)
    assert full.startswith(head) and cut >= 2 and len(full) >= cut + 2
    stop = full[cut - 2 : cut + 2]  # spans the end of token 4 and the start of token 5
    expected = full[: full.find(stop)]
    out = llm.generate(prompt, SamplingParams(max_tokens=12, stop=[stop, "never-appears"], **GREEDY), use_tqdm=False)[
        0
    ].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (expected, "stop", stop)
    kept = llm.generate(
        prompt, SamplingParams(max_tokens=12, stop=stop, include_stop_str_in_output=True, **GREEDY), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == expected + stop


def test_stop_token_ids(llm):
    ref = llm.generate("Count", SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    stop_id = ref[4]
    first = ref.index(stop_id)
    out = llm.generate("Count", SamplingParams(max_tokens=10, stop_token_ids=[stop_id], **GREEDY), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    # vLLM's text: the stop token's text is left out, unless include_stop_str_in_output
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(ref[:first], skip_special_tokens=True)
    keep = SamplingParams(max_tokens=10, stop_token_ids=[stop_id], include_stop_str_in_output=True, **GREEDY)
    kept = llm.generate("Count", keep, use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == out.token_ids and kept.text == tok.decode(ref[: first + 1], skip_special_tokens=True)


def test_temperature_above_two_is_accepted(llm):
    """vLLM bounds temperature only below (>= 0); a hot sample is still a valid completion."""
    out = llm.generate("Count", SamplingParams(temperature=5.0, seed=1, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="temperature must be >= 0.0"):
        SamplingParams(temperature=-0.1)


def test_max_model_len_ends_generation(llm):
    prompt = random_prompts(1, 93, 93, seed=20)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 96 - 93 and out[0].outputs[0].finish_reason == "length"


def test_prompt_longer_than_max_model_len_raises_before_work(llm):
    prompts = [{"prompt_token_ids": [5] * 10}, {"prompt_token_ids": [5] * 97}]
    with pytest.raises(ValueError, match="prompt 1 has 97 tokens.*max_model_len=96"):
        llm.generate(prompts, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.get_num_unfinished_requests() == 0


@pytest.mark.parametrize(
    "prompts,sampling,match",
    [
        ([""], None, "prompt 0 is empty"),
        (["ok", {"prompt_token_ids": [1, 10**7]}], None, "prompt 1: token id 10000000"),
        ([[1, 2, 3]], None, "prompt_token_ids"),
        (["ok", 5], None, "prompt 1: expected a str"),
        ([{"prompt_token_ids": ["a"]}], None, "list of ints"),
        (["a", "b"], [SamplingParams()], "got 1 sampling_params for 2 prompts"),
    ],
)
def test_bad_prompts_raise(llm, prompts, sampling, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, sampling, use_tqdm=False)


@pytest.mark.slow
def test_eos_and_min_tokens(smol):
    conv = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    out = smol.chat(conv, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    eos = smol.get_tokenizer().eos_token_id
    assert out.finish_reason == "stop" and out.stop_reason is None and out.token_ids[-1] == eos
    assert "Paris" in out.text and "<|im_end|>" not in out.text
    longer = smol.chat(
        conv, SamplingParams(temperature=0, max_tokens=64, min_tokens=len(out.token_ids) + 5), use_tqdm=False
    )[0].outputs[0]
    assert len(longer.token_ids) >= len(out.token_ids) + 5
    assert eos not in longer.token_ids[: len(out.token_ids) + 4]


@pytest.mark.slow
def test_chat_renders_the_template(smol):
    convs = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a colour."}],
    ]
    tok = smol.get_tokenizer()
    outs = smol.chat(convs, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for conv, o in zip(convs, outs):
        assert o.prompt == tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        assert o.prompt.endswith("<|im_start|>assistant\n")
    assert "You answer briefly." in outs[1].prompt
    one = smol.chat(convs[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    cont = smol.chat(
        [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hello, my"}],
        SamplingParams(temperature=0, max_tokens=4),
        add_generation_prompt=False,
        continue_final_message=True,
        use_tqdm=False,
    )
    assert cont[0].prompt.endswith("Hello, my")
    custom = smol.chat(
        convs[0],
        SamplingParams(temperature=0, max_tokens=2),
        use_tqdm=False,
        chat_template="{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",
    )
    assert custom[0].prompt == "[user] Hi\n"


@pytest.mark.parametrize(
    "messages,match",
    [
        ([{"content": "no role"}], "message 0: role"),
        ([{"role": "wizard", "content": "hi"}], "role must be one of"),
        ([{"role": "user", "content": 5}], "content must be a str"),
        ([[{"role": "user", "content": "ok"}], []], "conversation 1 must be a non-empty list"),
        ("just a string", "messages must be a conversation"),
    ],
)
def test_malformed_conversations_raise(smol, messages, match):
    with pytest.raises(ValueError, match=match):
        smol.chat(messages, use_tqdm=False)


def test_chat_flag_conflict(smol):
    with pytest.raises(ValueError, match="continue_final_message"):
        smol.chat([{"role": "user", "content": "x"}], continue_final_message=True, use_tqdm=False)


def test_chat_template_is_sandboxed(smol):
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        smol.chat([{"role": "user", "content": "x"}], chat_template=evil, use_tqdm=False)


def test_progress_bar_and_kv_report(tiny_llama, capfd):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("dfllm").addHandler(handler)
    try:
        llm = LLM(tiny_llama, kv_cache_memory_bytes=2**20)
    finally:
        logging.getLogger("dfllm").removeHandler(handler)
    assert any(f"KV cache: {llm.engine.num_blocks} blocks of 16 tokens" in r.getMessage() for r in records)
    assert llm.engine.num_blocks == 2**20 // llm.engine.runner.block_bytes
    capfd.readouterr()
    llm.generate(["a", "b"], SamplingParams(max_tokens=3), use_tqdm=True)
    err = capfd.readouterr().err
    assert "Processed prompts" in err and "tok/s" in err


@pytest.mark.slow
def test_default_model_is_smollm2(smollm2_dir):
    llm = LLM(max_model_len=64, kv_cache_memory_bytes=2**24)
    assert llm.config.model_path == smollm2_dir
    assert LLM("SmolLM2-135M-Instruct", max_model_len=64, kv_cache_memory_bytes=2**24).config.model_path == smollm2_dir


# ---- clear errors for unusable models and arguments -------------------------------------------
def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture(tiny_llama, tmp_path):
    path = copy_model(tiny_llama, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*FalconForCausalLM"):
        LLM(path)


def test_pickle_only_weights_are_refused(tiny_llama, tmp_path):
    path = copy_model(tiny_llama, tmp_path / "m")
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="pickle.*never unpickles"):
        LLM(path)


def test_missing_and_corrupt_weights(tiny_llama, tmp_path):
    missing = copy_model(tiny_llama, tmp_path / "missing")
    (missing / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        LLM(missing)
    corrupt = copy_model(tiny_llama, tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    with pytest.raises(ValueError, match="cannot read weights file model.safetensors"):
        LLM(corrupt)
    no_config = copy_model(tiny_llama, tmp_path / "noconfig")
    (no_config / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(no_config)


def test_incomplete_weights_name_the_missing_tensor(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_model(tiny_llama, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        LLM(path)


def test_integer_weights_are_unsupported(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_model(tiny_llama, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="unsupported dtype torch.int8"):
        LLM(path)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(model="no-such-model"), ValueError, "no-such-model"),
        (dict(dtype="int8"), ValueError, "unsupported dtype"),
        (dict(device="tpu"), ValueError, "unsupported device"),
        (dict(block_size=12), ValueError, "block_size"),
        (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
        (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
        (dict(tensor_parallel_size=3), ValueError, "tensor_parallel_size=3 does not divide"),
        (dict(pipeline_parallel_size=0), ValueError, "pipeline_parallel_size must be an int >= 1"),
        (dict(attention_backend="flash"), ValueError, "attention_backend"),
        (dict(max_model_len=4096), ValueError, "exceeds the model's max_position_embeddings"),
        (dict(kv_cache_memory_bytes=1024), ValueError, "KV cache holds"),
    ],
)
def test_bad_engine_arguments(tiny_llama, kwargs, exc, match):
    kwargs = {"model": tiny_llama, **kwargs}
    with pytest.raises(exc, match=match):
        LLM(**kwargs)


@pytest.mark.slow
def test_qwen2_sliding_window_is_rejected(tiny_qwen2, tmp_path):
    path = copy_model(tiny_qwen2, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    # windows on the second layer only: the Llama/Qwen2 class windows all layers or none
    cfg.update(use_sliding_window=True, sliding_window=32, max_window_layers=1)
    cfg.pop("layer_types", None)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="sliding-window"):
        LLM(path)
    assert LLM(path, max_model_len=32).config.max_model_len == 32


def test_tokenizer_argument(tiny_llama, smollm2_dir):
    llm = LLM(tiny_llama, tokenizer=smollm2_dir, max_model_len=64, kv_cache_memory_bytes=2**20)
    assert llm.get_tokenizer().vocab_size == AutoTokenizer.from_pretrained(smollm2_dir).vocab_size


def test_vllm_call_arguments(llm):
    """vLLM's generate/chat keywords: lora_request=None and any priority (under the default
    "fcfs" policy, as in vLLM) run as usual, a LoRA adapter is refused by name;
    llm.llm_engine is the engine."""
    sp = SamplingParams(max_tokens=3, **GREEDY)
    want = llm.generate("Count", sp, use_tqdm=False)[0].outputs[0].token_ids
    got = llm.generate(["Count"], sp, use_tqdm=False, lora_request=None, priority=[0])[0].outputs[0].token_ids
    assert got == want and llm.llm_engine is llm.engine
    with pytest.raises(ValueError, match="lora_request: LoRA adapters are not supported"):
        llm.generate("Count", sp, lora_request=object())
    assert llm.generate("Count", sp, priority=[1], use_tqdm=False)[0].outputs[0].token_ids == want
    assert llm.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False, lora_request=None)[0].finished
