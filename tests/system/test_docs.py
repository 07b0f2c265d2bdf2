"""The README and the docs' quickstart run as written: every ```python block of a page runs,
in order, as one script in a fresh process (later blocks use earlier blocks' names), so the
documentation cannot drift from the code. The docs site itself is built strict in CI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/index.md"]  # the quickstart pages: every python block runs
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


@pytest.mark.slow
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


# ---- what the pages name exists ----------------------------------------------------------------------------------
API_PAGES = ["README.md", "docs/from_vllm.md"]  # the pages that name LLM's methods and engine arguments
SPAN = re.compile(r"`([^`\n]+)`")


def named_api(page: Path) -> tuple[set[str], set[str]]:
    """(methods, engine arguments) a page names: ``LLM.x``/``llm.x`` and ``x()`` in code spans,
    the bare names listed after `LLM.generate`, and the ``x=`` of ``LLM(...)`` spans and the
    names of its engine-argument table."""
    text = page.read_text()
    methods: set[str] = set()
    args = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    for span in SPAN.findall(text):
        methods |= set(re.findall(r"(?<![.\w])(?:LLM|llm)\.(\w+)", span))
        methods |= set(re.findall(r"^(\w+)\(\)$", span))
        if span.startswith("LLM("):
            args |= set(re.findall(r"(\w+)=", span))
    for listed in re.findall(r"`LLM\.generate`((?:, `\w+`)+)", text):
        methods |= set(re.findall(r"`(\w+)`", listed))
    return methods, args


@pytest.mark.parametrize("page", API_PAGES)
def test_named_methods_and_engine_arguments_exist(page):
    from dfllm import LLM
    from dfllm.engine_args import ENGINE_ARG_NAMES

    methods, args = named_api(ROOT / page)
    assert methods, f"{page} names no LLM method"
    assert sorted(m for m in methods if not hasattr(LLM, m)) == [], f"{page} names LLM methods that do not exist"
    assert sorted(set(args) - set(ENGINE_ARG_NAMES)) == [], f"{page} names engine arguments that do not exist"


def test_the_api_check_sees_what_the_pages_name():
    """The extraction finds what it is for (a regex that matched nothing would pass anything)."""
    methods, args = named_api(ROOT / "README.md")
    assert {"generate", "chat", "embed", "score", "beam_search"} <= methods
    methods, args = named_api(ROOT / "docs/from_vllm.md")
    assert {"wake_up", "llm_engine", "get_tokenizer", "beam_search", "embed"} <= methods
    assert {"enforce_eager", "logprobs_mode", "structured_outputs_config", "skip_tokenizer_init"} <= args


def named_files(text: str) -> set[str]:
    """The files and folders of the repository a page names: ``dfllm/...`` paths, bare ``x.py``
    (or ``x.cpp``) names and ``folder/`` names, without placeholders (``<family>``, ``*``)."""
    names = set(re.findall(r"(?<![\w./<>*-])((?:[\w-]+/)*[\w-]+\.(?:py|cpp)|(?:[\w-]+/)+)(?![\w<>*])", text))
    return {n for n in names if not n.startswith(("http", "www"))}


def missing_files(text: str) -> list[str]:
    """The names of :func:`named_files` that exist nowhere in the repository (a bare name may
    stand in any folder of ``dfllm/``, ``tests/`` or ``benchmarks/``)."""
    roots = [ROOT / "dfllm", ROOT / "tests", ROOT / "benchmarks"]
    missing = []
    for name in sorted(named_files(text)):
        if (ROOT / name).exists() or any((r / name).exists() for r in roots):
            continue
        if not any(next(r.rglob(name.rstrip("/")), None) for r in roots):
            missing.append(name)
    return missing


def test_architecture_names_only_files_that_exist():
    """docs/architecture.md's tables and diagram name the files of one row's route: each exists."""
    assert missing_files((ROOT / "docs" / "architecture.md").read_text()) == []
    # the check itself: a planted name is found, a placeholder is not
    assert missing_files("`dfllm/engine/no_such_step.py`, `gone.py` and `models/<family>.py`") == [
        "dfllm/engine/no_such_step.py",
        "gone.py",
    ]
