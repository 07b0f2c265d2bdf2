"""Tensor and pipeline parallelism with two (or three) CPU ranks over gloo.

Greedy outputs must equal one rank's token for token; a killed rank must fail the call
quickly with a clear error and leave no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch

from dfllm import LLM, SamplingParams
from dfllm.engine.executor import _micro_batches
from dfllm.engine.model_runner import ModelRunner
from dfllm.engine.scheduler import SchedulerOutput
from dfllm.models.parallel_layers import shard_range

from helpers import build_tiny_model, random_prompts

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0, ignore_eos=True)
MAX_TOKENS = [7, 12, 1, 16, 9]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: list[int] = MAX_TOKENS) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def worker_pids(llm: LLM) -> list[int]:
    return [w.process.pid for w in llm.engine.runner.workers]


def assert_gone(pids: list[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"worker processes {pids} still running"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("parallel")
    return {
        # tied embeddings and a vocabulary (49155) that two ranks split unevenly
        "llama": build_tiny_model(root, smollm2_dir, heads=4, kv_heads=2, layers=3, vocab_size=49155),
        # q/k/v biases and an untied LM head
        "qwen2": build_tiny_model(root, smollm2_dir, arch="qwen2", heads=6, kv_heads=2, hidden=48, layers=2),
    }


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, 3, 60, seed=11)


@pytest.fixture(scope="module")
def tp_llm(models):
    llm = LLM(models["llama"], tensor_parallel_size=2, max_model_len=256, max_num_batched_tokens=64)
    yield llm
    llm.shutdown()


# ---- tensor parallelism ---------------------------------------------------------------------------
def test_tensor_parallel_matches_one_rank(models, prompts, tp_llm):
    """Chunked prefill (64-token budget) beside decodes, prefix caching, uneven vocabulary split."""
    children = psutil.Process().children(recursive=True)
    one = LLM(models["llama"], max_model_len=256, max_num_batched_tokens=64)
    assert type(one.engine.runner) is ModelRunner and psutil.Process().children(recursive=True) == children
    ref = greedy(one, prompts)
    assert greedy(tp_llm, prompts) == ref
    again = tp_llm.generate(
        [{"prompt_token_ids": prompts[3]}], SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False
    )[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == ref[3]


def test_tensor_and_pipeline_parallel_together_qwen2(models, prompts):
    """Two stages of two tensor-parallel ranks: q/k/v biases, an untied LM head whose gathered
    logits travel from the last stage back to rank 0."""
    ref = greedy(LLM(models["qwen2"]), prompts)
    llm = LLM(models["qwen2"], tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        assert llm.collective_rpc(lambda w: (w.parallel.pp_rank, w.parallel.tp_rank)) == [
            (0, 0),
            (0, 1),
            (1, 0),
            (1, 1),
        ]
        assert greedy(llm, prompts) == ref
    finally:
        llm.shutdown()


def test_each_rank_holds_its_share(tp_llm):
    ranks = tp_llm.collective_rpc(lambda w: (w.rank, os.getpid()))
    assert [r for r, _ in ranks] == [0, 1]
    assert ranks[0][1] == os.getpid() and ranks[1][1] == worker_pids(tp_llm)[0]
    shapes = tp_llm.apply_model(
        lambda m: (
            tuple(m.model.layers[0].self_attn.qkv_proj.weight.shape),
            tuple(m.model.layers[0].mlp.down_proj.weight.shape),
            tuple(m.model.embed_tokens.weight.shape),
        )
    )
    # 4 heads and 2 kv heads of 16 -> (2 + 1 + 1) * 16 rows; 128 MLP columns -> 64; 49155 -> 24578 rows
    assert shapes == [((64, 64), (64, 64), (24578, 64))] * 2
    first, second = tp_llm.apply_model(lambda m: m.model.embed_tokens.weight[-3:].clone())
    assert first.abs().sum() > 0 and second[-1].abs().sum() == 0  # rank 1's last row is padding
    assert tp_llm.collective_rpc("onload_weights") == [None, None]
    with pytest.raises(TimeoutError):
        tp_llm.collective_rpc(lambda w: time.sleep(1.0), timeout=0.05)
    assert tp_llm.collective_rpc(lambda w, x: x + w.parallel.rank, args=(10,)) == [10, 11]  # late replies skipped
    with pytest.raises(RuntimeError, match="(?s)rank 1:.*ZeroDivisionError"):
        tp_llm.collective_rpc(lambda w: 1 / (1 - w.parallel.rank))


def test_sleep_wake_and_weight_update_reach_every_rank(models, prompts, tp_llm):
    from safetensors.torch import load_file

    before = greedy(tp_llm, prompts[:2], [6, 6])
    tp_llm.sleep(level=2)
    assert tp_llm.collective_rpc(lambda w: (w.model is None, w.kv is None)) == [(True, True)] * 2
    tp_llm.wake_up()
    assert greedy(tp_llm, prompts[:2], [6, 6]) == before
    tensors = load_file(models["llama"] / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"  # row-parallel: each rank takes half the columns
    tp_llm.init_weight_transfer_engine()
    tp_llm.start_weight_update()
    tp_llm.update_weights([(name, tensors[name] * 0 + torch.arange(128.0))])
    tp_llm.finish_weight_update()
    cols = tp_llm.apply_model(lambda m: m.model.layers[1].mlp.down_proj.weight[0].tolist())
    assert cols == [list(map(float, range(64))), list(map(float, range(64, 128)))]
    tp_llm.start_weight_update()
    tp_llm.update_weights([(name, tensors[name])])
    tp_llm.finish_weight_update()
    assert greedy(tp_llm, prompts[:2], [6, 6]) == before


# ---- pipeline parallelism -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pp_llm(models):
    llm = LLM(models["llama"], pipeline_parallel_size=3, max_num_batched_tokens=64)
    yield llm
    llm.shutdown()


def test_pipeline_parallel_matches_one_rank(models, prompts, pp_llm):
    """One layer per stage over three ranks, a micro-batch per stage in flight; the last stage
    fills its tied LM head from the embedding tensor. (Two ranks: the SmolLM2 test.)"""
    ref = greedy(LLM(models["llama"], max_num_batched_tokens=64), prompts)
    assert pp_llm.collective_rpc(lambda w: (w.model.model.start, w.model.model.end)) == [(0, 1), (1, 2), (2, 3)]
    assert pp_llm.apply_model(lambda m: (m.model.embed_tokens is None, m.lm_head is None)) == [
        (False, True),
        (True, True),
        (True, False),
    ]
    assert greedy(pp_llm, prompts) == ref


@pytest.mark.parametrize("which", ["tp", "pp"])
def test_prompt_logprobs_on_parallel_ranks_match_one_rank(models, prompts, which, request):
    """The last stage sends the logits of prompt positions beside the sampled rows, micro-batch
    by micro-batch, and the driver splits them back per sequence."""
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    parallel = request.getfixturevalue(f"{which}_llm")
    ref = LLM(models["llama"], max_model_len=256, max_num_batched_tokens=64).generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False
    )
    got = parallel.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for a, b in zip(ref, got):
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs) and b.prompt_logprobs[0] is None
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert list(x)[0] == list(y)[0]
            assert x[list(x)[0]].logprob == pytest.approx(y[list(y)[0]].logprob, abs=1e-4)


def test_micro_batches_split_steps_by_tokens():
    seqs = [object()] * 5

    def split(tokens, stages):
        return [p.num_new_tokens for p in _micro_batches(SchedulerOutput(seqs[: len(tokens)], tokens), stages)]

    assert split([40, 1, 1, 30, 1], 2) == [[40], [1, 1, 30, 1]]
    assert split([1, 1, 30, 40, 1], 2) == [[1, 1, 30], [40, 1]]
    assert split([5], 2) == [[5]]
    assert split([1, 1, 1], 3) == [[1], [1], [1]]
    assert split([9, 9, 9, 9, 9], 1) == [[9, 9, 9, 9, 9]]
    assert shard_range(49155, 1, 2) == (24578, 49155) and shard_range(10, 2, 3) == (8, 10)


# ---- the bundled SmolLM2: 9 heads and 3 key/value heads --------------------------------------------
def test_smollm2_tensor_and_pipeline_parallel_match_one_rank(smollm2_dir):
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    params = SamplingParams(max_tokens=16, **GREEDY)

    def run(**kw):
        llm = LLM(smollm2_dir, max_model_len=128, max_num_seqs=4, **kw)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()

    ref = run()
    assert run(tensor_parallel_size=3) == ref
    assert run(pipeline_parallel_size=2) == ref


# ---- failures ---------------------------------------------------------------------------------------
def test_bad_parallel_sizes_are_refused_before_spawning(models, tmp_path, smollm2_dir):
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        LLM(models["llama"], tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 exceeds the model's 3 layers"):
        LLM(models["llama"], pipeline_parallel_size=4)
    with pytest.raises(NotImplementedError, match="pooling models .* run on one rank"):
        LLM(models["llama"], runner="pooling", tensor_parallel_size=2)
    assert psutil.Process().children(recursive=True) == before


def test_killed_rank_fails_the_call_and_leaves_no_process(pp_llm):
    """The middle of three pipeline stages is killed mid-generation: the call fails naming it,
    and the last stage is stopped too."""
    pids = worker_pids(pp_llm)
    killer = threading.Timer(1.0, os.kill, (pids[0], signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    prompts = [{"prompt_token_ids": p} for p in random_prompts(8, 3, 20, seed=5)]
    with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {pids[0]}\) exited with code -9.* during a step"):
        pp_llm.generate(prompts, SamplingParams(max_tokens=1000, **GREEDY), use_tqdm=False)
    assert time.monotonic() - start < 30
    killer.join()
    assert_gone(pids)
    with pytest.raises(RuntimeError, match="the parallel engine is stopped"):
        pp_llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)


def test_workers_exit_when_the_driver_process_dies(models, tmp_path):
    script = textwrap.dedent(f"""
        import os, signal
        from dfllm import LLM
        if __name__ == "__main__":
            llm = LLM({str(models["llama"])!r}, pipeline_parallel_size=2)
            print(llm.engine.runner.workers[0].process.pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    (tmp_path / "driver.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "driver.py")], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert_gone([int(proc.stdout.split()[0])])
