"""The GPU roofline arithmetic of benchmarks/roofline.py (used by bench_generate.py --device
cuda) on hand-computed numbers, and bench_generate's nano-vllm workload; no GPU needed."""

from __future__ import annotations

import doctest
import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def rl():
    """benchmarks/roofline.py, imported with benchmarks/ on sys.path as the benchmarks run it."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("roofline")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture
def small(rl):
    # 1 layer, hidden 2, 1 head of 2 (1 KV head), MLP 2, vocab 4
    return rl.ModelShape(layers=1, hidden=2, heads=1, kv_heads=1, head_dim=2, intermediate=2, vocab=4)


def test_shape_arithmetic(rl, small):
    # q 2x2 + k, v 2x2 each + o 2x2 + gate, up, down 2x2 each = 4 + 8 + 4 + 12
    assert small.linear_params == 28
    assert small.lm_head_flops == 2 * 2 * 4
    assert small.attention_flops(5) == 4 * 1 * 1 * 2 * 5
    assert small.kv_bytes_per_token(2) == 1 * 2 * 1 * 2 * 2
    assert small.weight_bytes(2) == (28 + 8) * 2
    # a prompt of 3: 3 tokens x 2 x 28, attention over 1 + 2 + 3 positions, one LM head
    assert rl.prefill_flops(small, 3) == 3 * 56 + 8 * 6 + 16


def test_shape_from_config(rl):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
    )
    shape = rl.ModelShape.from_config(cfg)
    assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (16, 32, 8, 64)
    # Llama-3.2-1B: 1,235,814,400 parameters with its tied embedding, the norms' 2 x 16 x 2048 + 2048 included
    norms = (2 * shape.layers + 1) * shape.hidden
    assert shape.linear_params + shape.hidden * shape.vocab + norms == 1_235_814_400
    assert shape.kv_bytes_per_token(2) == 32768


def test_decode_steps_continuous_batching(rl):
    # row 0: 3 tokens, 2 decode steps (contexts 11, 12); row 1: 1 token, no decode; row 2: 1 step (31)
    prompts, gens = [10, 20, 30], [3, 1, 2]
    assert list(rl.decode_steps(prompts, gens, max_num_seqs=2)) == [[11, 31], [12]]
    assert list(rl.decode_steps(prompts, gens, max_num_seqs=1)) == [[11], [12], [31]]
    # a slot freed by a finished row is taken by the next waiting one at the next step
    assert list(rl.decode_steps([5, 5, 5], [2, 3, 2], max_num_seqs=2)) == [[6, 6], [7, 6]]
    with pytest.raises(ValueError):
        list(rl.decode_steps([1], [2], max_num_seqs=0))


def test_roofline_memory_bound(rl, small):
    # one row, prompt 3, 3 generated: prefill 232 FLOPs; decode steps at contexts 4 and 5:
    # bytes 100 + 8 x ctx (132, 140), FLOPs (56 + 16) + 8 x ctx (104, 112)
    r = rl.roofline(
        small, [3], [3], max_num_seqs=4, weight_bytes=100, kv_token_bytes=8, matmul_flop_s=1000, copy_bytes_s=100
    )
    assert r["prefill_flops"] == 232
    assert r["prefill_seconds"] == pytest.approx(0.232)
    assert r["decode_steps"] == 2 and r["memory_bound_steps"] == 2
    assert r["decode_bytes"] == 272 and r["decode_flops"] == 216
    assert r["decode_seconds"] == pytest.approx(1.32 + 1.40)
    assert r["seconds"] == pytest.approx(0.232 + 2.72)
    assert r["tok_s"] == r["ceiling_tok_s"] == pytest.approx(3 / 2.952)
    assert rl.share(0.5 * r["tok_s"], r) == pytest.approx(50.0)


def test_roofline_compute_bound(rl, small):
    # the same at 100 FLOP/s and 1000 B/s: every decode step is compute-bound
    r = rl.roofline(
        small, [3], [3], max_num_seqs=4, weight_bytes=100, kv_token_bytes=8, matmul_flop_s=100, copy_bytes_s=1000
    )
    assert r["memory_bound_steps"] == 0
    assert r["decode_seconds"] == pytest.approx(1.04 + 1.12)
    assert r["seconds"] == pytest.approx(2.32 + 2.16)


def test_roofline_batches(rl, small):
    # two rows decoding together share one read of the weights a step
    one = rl.roofline(small, [3], [2], 4, 100, 8, 1e9, 100)
    two = rl.roofline(small, [3, 3], [2, 2], 4, 100, 8, 1e9, 100)
    assert one["decode_steps"] == two["decode_steps"] == 1
    assert one["decode_seconds"] == pytest.approx((100 + 8 * 4) / 100)
    assert two["decode_seconds"] == pytest.approx((100 + 2 * 8 * 4) / 100)
    apart = rl.roofline(small, [3, 3], [2, 2], 1, 100, 8, 1e9, 100)
    assert apart["decode_steps"] == 2
    assert apart["decode_seconds"] == pytest.approx(2 * one["decode_seconds"])


def test_doctests(rl):
    assert doctest.testmod(rl).failed == 0


def test_measurements_on_cpu(rl):
    import torch

    mm = rl.matmul_rate("cpu", torch.float32, n=64, reps=2, warmup=1)
    assert mm["shape"] == [64, 64, 64] and mm["dtype"] == "float32"
    assert mm["flop_s"] == pytest.approx(2 * 64**3 / mm["best_seconds"]) and mm["flop_s"] >= mm["median_flop_s"]
    cp = rl.copy_bandwidth("cpu", nbytes=1 << 20, reps=2, warmup=1)
    assert cp["bytes_s"] == pytest.approx(2 * (1 << 20) / cp["best_seconds"])
    limits = rl.device_limits("cpu", torch.float32, matmul_n=32, copy_bytes=1 << 16)
    assert set(limits) == {"matmul", "copy"}


def test_nano_vllm_workload():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        bench = importlib.import_module("bench_generate")
    finally:
        sys.path.remove(str(BENCHMARKS))
    prompts, max_tokens = bench.build_nano_workload()
    # nano-vllm's README: 133,966 output tokens; its Qwen3.5 table: 142,827 prompt tokens
    assert len(prompts) == 256 and sum(max_tokens) == 133_966 and sum(map(len, prompts)) == 142_827
    assert min(map(len, prompts)) >= 100 and max(map(len, prompts)) <= 1024
    assert all(0 <= t <= 10_000 for p in prompts for t in p)
    small, limits = bench.build_nano_workload(4, length_scale=0.02, vocab_size=100)
    assert len(small) == 4 and all(2 <= len(p) <= 20 for p in small) and all(2 <= n <= 20 for n in limits)
    assert all(t < 100 for p in small for t in p)


class _FakeEvent:
    """A CUDA event timed by the host clock (no GPU here)."""

    clock = 0.0

    def __init__(self, enable_timing: bool = False):
        self.t = None

    def record(self, stream=None):
        self.t = _FakeEvent.clock

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


def test_forward_events_spans(monkeypatch):
    """bench_generate's device-busy split: a span per step from the model's (or the decode
    graph's) launch to the end of the runner's run, the runner's own work before it left out;
    the patches undone afterwards."""
    import torch

    sys.path.insert(0, str(BENCHMARKS))
    try:
        bench = importlib.import_module("bench_generate")
    finally:
        sys.path.remove(str(BENCHMARKS))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    class Sched:
        def __init__(self, new):
            self.num_new_tokens = new

    class Graphs:
        def forward(self, seqs):
            _FakeEvent.clock += 2.0  # the replay
            return seqs

    class Runner:
        def __init__(self):
            self.model = torch.nn.Identity()
            self.decode_graphs = Graphs()

        def run(self, sched):
            _FakeEvent.clock += 10.0  # input preparation: host-only
            if all(n == 1 for n in sched.num_new_tokens):
                self.decode_graphs.forward(sched)
            else:
                self.model(sched)
                _FakeEvent.clock += 3.0  # the eager forward
            _FakeEvent.clock += 1.0  # the logits
            return sched

    runner = Runner()
    with bench.ForwardEvents(runner) as events:
        runner.run(Sched([5, 1]))  # a step with prompt tokens: 3 + 1 s
        runner.run(Sched([1, 1]))  # a decode step: 2 + 1 s
    assert "run" not in vars(runner) and "forward" not in vars(runner.decode_graphs)
    assert "forward" not in vars(runner.model)
    s = events.summary(wall=40.0)
    assert (s["steps"], s["decode_steps"], s["prompt_steps"], s["unseen_forwards"]) == (2, 1, 1, 0)
    assert s["prompt_busy_seconds"] == pytest.approx(4.0) and s["decode_busy_seconds"] == pytest.approx(3.0)
    assert s["device_busy_seconds"] == pytest.approx(7.0) and s["host_only_seconds"] == pytest.approx(33.0)
    assert s["idle_fraction"] == pytest.approx(33 / 40)
