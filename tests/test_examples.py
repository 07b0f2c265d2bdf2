"""The examples run as they stand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_quickstart_runs(smollm2_dir):
    result = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Paris" in result.stdout
    assert result.stdout.count("generated") == 3
