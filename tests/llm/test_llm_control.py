"""The rest of the LLM API: queue, profiling, sleep mode, caches, metrics, weight updates, RPC."""

from __future__ import annotations

import dataclasses
import gc
import json
import time

import psutil
import pytest
import torch
from fidelity import check_logprobs_close, dfllm_greedy_logprobs, hf_greedy_logprobs
from safetensors.torch import load_file

from dfllm import LLM, SamplingParams
from dfllm.engine.metrics import VLLM_NAMES, Counter, Gauge, Histogram

from helpers import build_tiny_model, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture()
def llm(tiny_llama, tmp_path):
    return LLM(tiny_llama, max_model_len=128, kv_cache_memory_bytes=2**22, profiler_dir=tmp_path / "traces")


def token_prompts(n, seed=0):
    return [{"prompt_token_ids": p} for p in random_prompts(n, 5, 40, seed=seed)]


def texts(outs):
    return [o.outputs[0].token_ids for o in outs]


# ---- queue -------------------------------------------------------------------------------------
def test_enqueue_batches_calls_together_and_returns_in_order(llm):
    prompts = token_prompts(5)
    expected = texts(llm.generate(prompts, GREEDY, use_tqdm=False))
    conv = [{"role": "user", "content": "Hello"}]
    expected_chat = texts(llm.chat(conv, GREEDY, use_tqdm=False))
    first = llm.enqueue(prompts[:3], GREEDY)
    chat_ids = llm.enqueue_chat(conv, GREEDY)
    second = llm.enqueue(prompts[3:], GREEDY)
    assert llm.engine.stats().num_waiting == 6  # nothing ran yet; all wait together
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == first + chat_ids + second
    assert texts(outs) == expected[:3] + expected_chat + expected[3:]
    assert llm.wait_for_completion(use_tqdm=False) == []


def test_generate_between_enqueue_and_wait_keeps_queued_results(llm):
    prompts = token_prompts(3, seed=1)
    queued = llm.enqueue(prompts, GREEDY)
    direct = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == queued
    assert texts(outs)[0] == texts(direct)[0]


# ---- profiling ---------------------------------------------------------------------------------
def test_profile_writes_a_chrome_trace_with_the_models_operators(llm, tmp_path):
    llm.start_profile("unit")
    llm.generate(token_prompts(2), GREEDY, use_tqdm=False)
    path = llm.stop_profile()
    assert path.parent == tmp_path / "traces" and path.name.startswith("unit-") and path.suffix == ".json"
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert "dfllm.step" in names
    assert names & {"aten::linear", "aten::addmm", "aten::mm", "mkldnn::_linear_pointwise"}  # packed on CPU
    assert "aten::scaled_dot_product_attention" in names
    with pytest.raises(RuntimeError, match="start_profile was not called"):
        llm.stop_profile()


# ---- sleep mode --------------------------------------------------------------------------------
def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


@pytest.mark.slow
def test_sleep_releases_memory_and_wake_restores_outputs(smollm2_dir):
    llm = LLM(smollm2_dir, max_model_len=256, kv_cache_memory_bytes=64 * 2**20)
    conv = [{"role": "user", "content": "Name three colours."}]
    before = texts(llm.chat(conv, GREEDY, use_tqdm=False))

    llm.sleep(level=1)
    assert llm.engine.runner.kv is None
    with pytest.raises(RuntimeError, match="asleep"):
        llm.chat(conv, GREEDY, use_tqdm=False)
    llm.wake_up()
    again = llm.chat(conv, GREEDY, use_tqdm=False)
    assert texts(again) == before and again[0].num_cached_tokens == 0  # prefix cache was reset

    awake = rss()
    llm.sleep(level=2)
    assert llm.engine.runner.model is None and llm.engine.runner.kv is None
    assert awake - rss() > 400 * 2**20  # the 538 MB of float32 weights are gone
    llm.wake_up(tags=["weights"])
    with pytest.raises(RuntimeError, match="kv_cache"):
        llm.chat(conv, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    assert texts(llm.chat(conv, GREEDY, use_tqdm=False)) == before
    with pytest.raises(ValueError, match="sleep level"):
        llm.sleep(level=3)


@pytest.mark.slow
def test_sleep_refuses_while_requests_are_queued(llm):
    llm.enqueue(token_prompts(1), GREEDY)
    with pytest.raises(RuntimeError, match="still queued"):
        llm.sleep()
    llm.wait_for_completion(use_tqdm=False)
    llm.sleep()
    llm.wake_up()


# ---- caches --------------------------------------------------------------------------------------
def test_reset_prefix_cache(llm):
    prompt = token_prompts(1)[0]["prompt_token_ids"] * 2
    llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    assert llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    llm.enqueue([{"prompt_token_ids": prompt}], GREEDY)
    assert llm.reset_prefix_cache() is False
    llm.wait_for_completion(use_tqdm=False)
    assert llm.reset_prefix_cache() is True
    assert llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.reset_mm_cache() is None


# ---- metrics -------------------------------------------------------------------------------------
def metric(metrics, name):
    return next(m for m in metrics if m.name == name)


def test_metrics_count_the_tokens_processed(tiny_llama):
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4
    # first come, first served with the watermark only: the six sharers start together
    # (prefix-aware admission would hold five back a step to share the prefix, and the growth
    # reserve would keep room for their decodes) and run out of blocks
    llm = LLM(
        tiny_llama,
        block_size=4,
        kv_cache_memory_bytes=40 * block_bytes,
        max_model_len=64,
        prefix_aware_scheduling=False,
    )
    llm.engine.scheduler.reserve_growth = False
    shared = random_prompts(1, 16, 16, seed=3)[0][:16]
    prompts = [{"prompt_token_ids": shared + p} for p in random_prompts(6, 9, 25, seed=2)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 3, 17, 24, 9, 20)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    m = llm.get_metrics()
    assert all(isinstance(x, (Counter, Gauge, Histogram)) and x.labels == {"model_name": tiny_llama.name} for x in m)
    assert metric(m, "dfllm_generation_tokens").value == sum(len(o.outputs[0].token_ids) for o in outs)
    assert metric(m, "dfllm_prompt_tokens").value == sum(len(o.prompt_token_ids) for o in outs)
    assert metric(m, "dfllm_num_preemptions").value == llm.engine.stats().num_preemptions > 0
    assert metric(m, "dfllm_prefix_cache_hits").value == llm.engine.stats().prefix_cache_hits > 0
    assert metric(m, "dfllm_prefix_cache_queries").value == llm.engine.stats().prefix_cache_queries
    for name in ("dfllm_time_to_first_token_seconds", "dfllm_e2e_request_latency_seconds"):
        h = metric(m, name)
        assert h.count == 6 and h.buckets["+Inf"] == 6 and h.sum > 0
    tpot = metric(m, "dfllm_time_per_output_token_seconds")
    assert tpot.count == sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    assert metric(m, "dfllm_num_requests_running").value == 0
    assert metric(m, "dfllm_num_requests_waiting").value == 0
    assert metric(m, "dfllm_kv_cache_usage_perc").value == 0.0
    # per-request token histograms, and vLLM's names for code written against vLLM's get_metrics()
    assert metric(m, "dfllm_request_prompt_tokens").sum == sum(len(o.prompt_token_ids) for o in outs)
    assert metric(m, "dfllm_request_generation_tokens").count == 6
    for dfllm_name, vllm_name in VLLM_NAMES.items():
        assert metric(m, vllm_name) == dataclasses.replace(metric(m, dfllm_name), name=vllm_name)
    assert metric(m, "vllm:generation_tokens").value == sum(len(o.outputs[0].token_ids) for o in outs)


# ---- weight updates ------------------------------------------------------------------------------
@pytest.mark.slow
def test_update_weights_serves_the_new_model(tmp_path, smollm2_dir):
    a = build_tiny_model(tmp_path, smollm2_dir, seed=1)
    b = build_tiny_model(tmp_path, smollm2_dir, seed=2)
    prompts = random_prompts(3, 5, 30, seed=4)
    llm = LLM(a, max_model_len=128, kv_cache_memory_bytes=2**22)

    def run():
        return texts(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))

    first = dfllm_greedy_logprobs(llm, prompts, 8)
    check_logprobs_close(first, hf_greedy_logprobs(a, prompts, 8), "dfllm", "transformers")
    before = [o.token_ids for o in first]
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine"):
        llm.start_weight_update()
    llm.init_weight_transfer_engine({"backend": "inprocess"})
    llm.start_weight_update()
    with pytest.raises(RuntimeError, match="weight update is in progress"):
        run()
    new = load_file(b / "model.safetensors")
    bad_shape = [("model.norm.weight", torch.ones(3))]
    with pytest.raises(ValueError, match="shape"):
        llm.update_weights(list(new.items())[:4] + bad_shape)
    with pytest.raises(ValueError, match="unknown tensor name 'model.nope.weight'"):
        llm.update_weights(list(new.items())[:4] + [("model.nope.weight", torch.ones(3))])
    llm.finish_weight_update()
    assert run() == before  # the rejected batches changed nothing
    llm.start_weight_update()
    llm.update_weights(new.items())
    llm.finish_weight_update(weight_version=7)
    assert llm.get_weight_version() == 7
    fresh = LLM(b, max_model_len=128, kv_cache_memory_bytes=2**22)  # exactly as if loaded from b
    assert run() == texts(fresh.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)) != before
    llm.update_weight_version("v8")
    assert llm.get_weight_version() == "v8"
    with pytest.raises(NotImplementedError, match="nccl"):
        llm.init_weight_transfer_engine({"backend": "nccl"})


def test_prefix_cache_is_invalidated_by_a_weight_update(llm, tiny_llama):
    prompt = [{"prompt_token_ids": list(range(30, 70))}]
    llm.generate(prompt, GREEDY, use_tqdm=False)
    llm.init_weight_transfer_engine()
    llm.start_weight_update()
    llm.update_weights(load_file(tiny_llama / "model.safetensors").items())
    llm.finish_weight_update()
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


# ---- RPC -------------------------------------------------------------------------------------------
def test_collective_rpc_and_apply_model(llm, tiny_llama):
    from transformers import AutoModelForCausalLM

    assert llm.collective_rpc(lambda worker: type(worker.model).__name__) == ["LlamaForCausalLM"]
    assert llm.collective_rpc("onload_weights") == [None]
    assert llm.collective_rpc(lambda w, x, y=0: x + y, args=(2,), kwargs={"y": 3}) == [5]
    # vLLM's worker attributes, for callables written against vLLM
    assert llm.collective_rpc(lambda w: (w.rank, w.local_rank, str(w.device), w.model_runner.model is w.model)) == [
        (0, 0, "cpu", True)
    ]
    seen = llm.apply_model(lambda model: model)
    assert seen == [llm.engine.runner.model]
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert llm.apply_model(lambda m: sum(p.numel() for p in m.parameters())) == [
        sum(p.numel() for p in ref.parameters())
    ]
    with pytest.raises(TimeoutError):
        llm.collective_rpc(lambda w: time.sleep(1.0), timeout=0.05)
