"""The GPU check (benchmarks/gpu/check.sh) runs on a GPU machine that is lent only now and then:
its ``--cpu`` dry run, every step on this CPU (Triton's interpreter, a tiny model), runs here so
that the check cannot rot while no GPU is at hand."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_checks_cpu_dry_run_passes_every_step_and_writes_one_table_and_one_archive(tmp_path):
    env = {**os.environ, "OUT_DIR": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu/check.sh"), "--cpu"], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    table = (tmp_path / "table.txt").read_text()
    assert "all steps ok" in table.splitlines()[0], table
    for step in ("setup", "kernels", "attention", "host", "host_async", "host_text", "generate", "nano", "tests"):
        assert any(line.startswith(step + " ") for line in table.splitlines()), (step, table)
    assert "engine imported without dask" in table  # the engine needs no dataframe stack
    with tarfile.open(tmp_path / "gpu-check.tar.gz") as archive:
        names = set(archive.getnames())
    assert "async vs sync scheduling, batch 4" in table  # the figures that decide async_scheduling's default
    logs = ("steps.tsv", "setup.json", "host.json", "host_async.json", "host_text.json", "generate.json", "nano.json")
    for name in (*logs, "tests.log"):
        assert f"logs/{name}" in names, names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-check.tar.gz", "table.txt"]  # logs archived
