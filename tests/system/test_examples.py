"""The examples run as they stand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_quickstart_runs(smollm2_dir):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py")], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Paris" in result.stdout
    assert result.stdout.count("generated") == 3


def run_example(name: str, *args: str) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_haiku_processor_writes_parquet(smollm2_dir, tmp_path):
    import pandas as pd

    stdout = run_example("haiku_processor.py", "--max-tokens", "12", "--output", str(tmp_path / "haikus"))
    out = pd.read_parquet(tmp_path / "haikus")
    assert len(out) == 6 and out["llm_error"].isna().all() and (out["tokens"] > 0).all()
    assert list(out.columns[:4]) == ["id", "item", "answer", "tokens"]
    assert "6 haikus written" in stdout


def test_polars_pipeline(smollm2_dir):
    stdout = run_example("polars_pipeline.py", "--max-tokens", "4")
    assert "Enum(categories=['positive', 'negative'])" in stdout  # the schema, known before running
    assert "embedding width: [384]" in stdout


def test_semantic_search_finds_the_obvious_document():
    stdout = run_example("semantic_search.py", "tallest peak in the world")
    first_hit = stdout.strip().splitlines()[1]
    assert "Mount Everest" in first_hit


def test_object_storage_etl_against_a_local_s3_server(smollm2_dir):
    stdout = run_example("object_storage_etl.py", "--max-tokens", "8")
    assert "WriteSummary(" in stdout and "rows=6, errors=0" in stdout
    assert stdout.count("\n- ") == 3
