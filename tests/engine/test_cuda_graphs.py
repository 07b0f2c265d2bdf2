"""CUDA graphs of decode steps (dfllm.engine.cuda_graphs).

On a CPU: the buckets, ``enforce_eager``/``compilation_config`` and their errors, which models are
captured, and the padded static-buffer forward a graph replays (run eagerly, Triton kernels in the
interpreter) against the ordinary eager step: same greedy tokens, log-probabilities equal to float
rounding. On a GPU: real graphs against ``enforce_eager=True``, also after sleep and wake-up.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dfllm import LLM, SamplingParams
from dfllm.config import EngineConfig
from dfllm.engine.cuda_graphs import bucket_for, unsupported_reason
from dfllm.engine.scheduler import SchedulerOutput
from dfllm.engine_args import EngineArgs, check_engine_args, default_capture_sizes, parse_capture_sizes

from helpers import build_tiny_model, make_seq, random_prompts

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    return build_tiny_model(tmp_path_factory.mktemp("graphs"), smollm2_dir, heads=4, kv_heads=2, hidden=32)


def test_default_buckets_are_vllms_and_hold_every_batch():
    assert default_capture_sizes(1) == (1,)
    assert default_capture_sizes(3) == (1, 2, 4)
    assert default_capture_sizes(8) == (1, 2, 4, 8)
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 24)
    big = default_capture_sizes(256)
    assert big[:5] == (1, 2, 4, 8, 16) and big[-1] == 256 and all(b - a == 8 for a, b in zip(big[3:], big[4:]))
    assert default_capture_sizes(10_000)[-1] == 512
    sizes = (1, 2, 4, 8, 16, 24)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 24, 25)] == [1, 2, 4, 8, 8, 16, 24, 24, None]


@pytest.mark.slow
def test_capture_sizes_from_compilation_config(tiny):
    assert parse_capture_sizes(None) is None and parse_capture_sizes(3) is None
    assert parse_capture_sizes({"level": 3}) is None
    assert parse_capture_sizes({"cudagraph_capture_sizes": [8, 1, 2, 2]}) == (1, 2, 8)
    assert parse_capture_sizes(SimpleNamespace(cudagraph_capture_sizes=(4,), level=3)) == (4,)
    assert parse_capture_sizes({"cudagraph_capture_sizes": []}) == ()

    cfg = EngineConfig.create(EngineArgs(tiny, max_num_seqs=20))
    assert cfg.cudagraph_capture_sizes == (1, 2, 4, 8, 16, 24) and cfg.enforce_eager is False
    cfg = EngineConfig.create(
        EngineArgs(tiny, enforce_eager=True, compilation_config={"cudagraph_capture_sizes": [4, 1]})
    )
    assert cfg.cudagraph_capture_sizes == (1, 4) and cfg.enforce_eager is True
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        EngineConfig.create(EngineArgs(tiny, enforce_eager="yes"))


@pytest.mark.parametrize(
    "value",
    [
        "fast",
        {"cudagraph_capture_sizes": [0, 2]},
        {"cudagraph_capture_sizes": [True]},
        {"cudagraph_capture_sizes": "1,2"},
        SimpleNamespace(cudagraph_capture_sizes=2.5),
    ],
)
def test_bad_compilation_config_is_refused_by_name(value):
    with pytest.raises(ValueError, match="compilation_config") as info:
        check_engine_args(compilation_config=value)
    assert repr(value) in str(info.value)


@pytest.mark.slow
def test_only_plain_paged_attention_models_are_captured(tmp_path, smollm2_dir, tiny):
    llm = LLM(tiny, device="cpu", attention_backend="torch", max_model_len=64, kv_cache_memory_bytes=1 << 20)
    model = llm.engine.runner.model
    assert unsupported_reason(model, ops_name="triton") is None
    assert "not CUDA" in unsupported_reason(model, device=torch.device("cpu"))
    assert "'torch' kernels" in unsupported_reason(model, ops_name="torch")
    assert "int8" in unsupported_reason(model, quantization="int8")
    windowed = build_tiny_model(tmp_path, smollm2_dir, arch="mistral", hidden=32, sliding_window=16)
    llm = LLM(windowed, device="cpu", attention_backend="torch", max_model_len=64, kv_cache_memory_bytes=1 << 20)
    assert unsupported_reason(llm.engine.runner.model, ops_name="triton") == "sliding-window attention"


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int]):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [])] for o in outs]
    return tokens, logprobs


def _assert_same(got, want, tol: float):
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        assert a == pytest.approx(b, abs=tol)


def _static_buffer_engine(device: str, sizes: list[int]) -> dict:
    """A small float32 Triton engine whose graphs are off (``enforce_eager``): the tests set up
    the static buffers with ``capture=False`` and run the padded path eagerly."""
    return dict(
        device=device,
        dtype=torch.float32,
        attention_backend="triton",
        max_model_len=64,
        max_num_seqs=4,
        kv_cache_memory_bytes=1 << 20,
        compilation_config={"cudagraph_capture_sizes": sizes},
        enforce_eager=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cuda"] if CUDA else ["cpu"])  # on a CPU: Triton's interpreter
def test_padded_static_buffer_decode_matches_eager_step(tiny, device):
    """The path a graph replays, run eagerly: batches of 3 and 1 padded to buckets of 4 and 2
    (padding rows: no cache write, one harmless key), a batch of 2 filling its bucket."""
    kwargs = _static_buffer_engine(device, [2, 4])  # no graphs: capture=False below runs the padded path eagerly
    prompts = random_prompts(3, 5, 9, seed=7)
    max_tokens = [3, 6, 12]  # 3 decoding, then 2, then 1; the longest crosses a 16-token block
    padded = LLM(tiny, **kwargs)
    runner = padded.engine.runner
    graphs = runner.setup_decode_graphs(capture=False)
    assert graphs is not None and not graphs.captured and graphs.sizes == (2, 4)
    got = _generate(padded, prompts, max_tokens)
    assert graphs.replays == max(max_tokens) - 1  # every decode step went through the buffers
    eager = LLM(tiny, **kwargs)
    want = _generate(eager, prompts, max_tokens)
    assert eager.engine.runner.decode_graphs is None
    _assert_same(got, want, 1e-5 if device == "cpu" else 1e-4)
    padded.sleep(1)  # the buffers go with the KV cache
    assert runner.decode_graphs is None


@pytest.mark.parametrize("device", ["cuda"] if CUDA else ["cpu"])
def test_static_buffer_step_with_a_one_token_prompt_chunk_matches_eager(tiny, device):
    """A step of one-token rows where one row is a prompt chunk (it computes a prompt token
    and samples nothing): the static-buffer path gives the other rows' logits, as the eager step."""
    kwargs = _static_buffer_engine(device, [4])
    outs = []
    for padded in (True, False):
        llm = LLM(tiny, **kwargs)
        runner, bm = llm.engine.runner, llm.engine.scheduler.bm
        seqs = [make_seq(p) for p in random_prompts(3, 5, 20, seed=3)]
        for seq, computed in zip(seqs, [len(seqs[0].token_ids) - 1, 2, len(seqs[2].token_ids) - 1]):
            bm.allocate(seq, computed + 1)
            seq.num_computed_tokens = computed
        runner.kv.zero_()  # the earlier slots, never computed, read as zeros: the same in both runs
        if padded:
            graphs = runner.setup_decode_graphs(capture=False)
            assert graphs is not None
        else:
            runner.setup_decode_graphs(capture=True)  # enforce_eager: none
            assert runner.decode_graphs is None
        out = runner.run(SchedulerOutput(seqs, [1, 1, 1]))
        assert out.sample_seqs == [seqs[0], seqs[2]] and out.logits.shape[0] == 2
        assert not padded or graphs.replays == 1
        outs.append(out.logits.cpu())
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5 if device == "cpu" else 1e-4)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_graph_replay_matches_eager_on_cuda(tiny):
    kwargs = dict(device="cuda", dtype=torch.float32, max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=1 << 26)
    prompts = random_prompts(5, 5, 40, seed=11)
    max_tokens = [3, 9, 17, 30, 45]  # batches 5 (bucket 8), 4 (bucket 4), 3, 2, 1; contexts cross blocks
    graphs_llm = LLM(tiny, **kwargs)
    eager = LLM(tiny, enforce_eager=True, **kwargs)
    want = _generate(eager, prompts, max_tokens)
    assert eager.engine.runner.decode_graphs is None  # enforce_eager captures nothing
    runner = graphs_llm.engine.runner
    _assert_same(_generate(graphs_llm, prompts, max_tokens), want, 1e-4)
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.captured and graphs.sizes == (1, 2, 4, 8)
    assert graphs.replays >= max(max_tokens) - 1
    for level in (1, 2):  # weights to host / dropped, KV cache freed: captured again on waking
        graphs_llm.sleep(level)
        assert runner.decode_graphs is None
        graphs_llm.wake_up()
        _assert_same(_generate(graphs_llm, prompts, max_tokens), want, 1e-4)
        assert runner.decode_graphs is not None and runner.decode_graphs is not graphs
        assert runner.decode_graphs.captured and runner.decode_graphs.replays >= max(max_tokens) - 1
        graphs = runner.decode_graphs


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_graphs_in_bfloat16_give_eagers_greedy_tokens_on_cuda(tiny):
    """The default dtype on a GPU; graphs split the keys into as many segments as ``max_model_len``
    allows (eager steps: as the batch's longest context), so compare tokens and log-probs loosely."""
    kwargs = dict(
        device="cuda", dtype=torch.bfloat16, max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=1 << 26
    )
    prompts = random_prompts(11, 5, 60, seed=5)
    max_tokens = [24] * 11
    got = _generate(LLM(tiny, **kwargs), prompts, max_tokens)
    want = _generate(LLM(tiny, enforce_eager=True, **kwargs), prompts, max_tokens)
    same = sum(a == b for a, b in zip(got[0], want[0]))
    assert same >= 9, f"only {same} of 11 greedy sequences equal"
