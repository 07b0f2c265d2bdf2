"""benchmarks/bench_gemm.py runs on any CPU with tiny settings and reports every GEMM it has."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dfllm.kernels.backend import cpu_bf16_gemm_available

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gemm.py"


def test_bench_gemm_reports_each_gemm_cold_and_hot(tmp_path):
    out = tmp_path / "gemm.json"
    shape = ["--hidden", "64", "--intermediate", "96", "--layers", "2", "--heads", "4", "--kv-heads", "2"]
    args = [*shape, "--vocab", "100", "--lm-head", "--rows", "1", "7", "--passes", "1", "--json", str(out)]
    run = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "rows 7:" in run.stdout
    results = json.loads(out.read_text())["results"]
    assert [r["rows"] for r in results] == [1, 7]
    for r in results:
        assert r["F.linear cold"]["ms"] > 0 and r["F.linear hot"]["gflop_s"] > 0
        if cpu_bf16_gemm_available():
            assert r["dfllm bf16 cold"]["ms"] > 0 and r["dfllm bf16 hot"]["ms"] > 0
        if r["ulps_vs_onednn"] is not None:
            assert r["ulps_vs_onednn"] <= 2
