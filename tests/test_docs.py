"""The README and the docs' quickstart run as written: every ```python block of a page runs,
in order, as one script in a fresh process (later blocks use earlier blocks' names), so the
documentation cannot drift from the code. The docs site itself is built strict in CI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/index.md"]  # the quickstart pages: every python block runs
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


@pytest.mark.parametrize("page", PAGES)
def test_page_code_runs(page, tmp_path):
    blocks = python_blocks(ROOT / page)
    assert blocks, f"{page} has no python block"
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(blocks))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{page}'s code failed:\n{done.stderr[-4000:]}"


def test_block_extraction_sees_every_fence():
    """The extractor finds every python fence of a page (a miscounted fence would skip code)."""
    for page in PAGES:
        text = (ROOT / page).read_text()
        assert len(python_blocks(ROOT / page)) == text.count("```python\n")
