"""benchmarks/bench_host.py runs on a CPU with tiny settings and reports every phase of a decode step."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_host.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_host", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_host_reports_every_phase(tmp_path):
    import dfllm.engine.cuda_graphs as cuda_graphs
    import dfllm.engine.model_runner as model_runner

    bench = load_bench()
    threads = torch.get_num_threads()
    prepare, load = model_runner.prepare_inputs, cuda_graphs.CudaGraphRunner.load
    path = tmp_path / "host.json"
    args = ["--batches", "1", "4", "--max-tokens", "4", "--repeats", "1", "--profile", "2", "--py-profile", "2"]
    returned = bench.main([*args, "--json", str(path)])
    out = json.loads(path.read_text())
    assert out["batches"] == json.loads(json.dumps(returned["batches"]))
    assert out["phases"] == bench.PHASES
    assert set(out["batches"]) == {"1", "4"}
    for batch, r in out["batches"].items():
        assert 1 <= r["decode_steps"] <= 3, r["decode_steps"]  # 4 tokens: a prefill step, then 3 decodes
        assert r["generated_tokens"] == 4 * int(batch)
        assert r["tok_s"] > 0
        for key in ("phases_ms", "phases_ms_mean"):
            assert set(r[key]) == set(bench.PHASES)
            assert all(math.isfinite(v) and v >= 0 for v in r[key].values()), r[key]
        for key in ("step_ms", "step_ms_mean", "host_ms", "host_ms_mean", "step_untimed_ms"):
            assert math.isfinite(r[key]) and r[key] >= 0, (key, r[key])
        assert r["phases_ms_mean"]["forward"] > 0 and r["phases_ms_mean"]["sample"] > 0
        # the phases' means add up to the step's mean ("other" is the remainder)
        total = sum(r["phases_ms_mean"].values())
        assert total <= r["step_ms_mean"] + 1e-6
        assert total >= r["step_ms_mean"] - 1e-3
        assert r["host_ms_mean"] <= r["step_ms_mean"] + 1e-6
        profiles = out["profiles"][batch]
        assert profiles["torch"]["steps"] >= 1 and profiles["torch"]["top_self_cpu"]
        assert profiles["python"]["steps"] >= 1 and profiles["python"]["top_own"]
    # the wrappers are gone, and nothing global changed
    assert model_runner.prepare_inputs is prepare and cuda_graphs.CudaGraphRunner.load is load
    assert torch.get_num_threads() == threads
