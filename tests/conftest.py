"""Shared fixtures: small random Llama/Qwen2 models saved as real Hugging Face directories
(built by :mod:`helpers`), the bundled SmolLM2 directory, and a command-line Dask cluster.

The tiny models use the bundled SmolLM2 tokenizer (converted once from its GGUF), so that
text prompts, chat templates and detokenization are the real thing.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton's interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest

from dfllm.models.bundled import resolve_model

from helpers import CLICluster, build_tiny_model


def pytest_sessionstart(session) -> None:
    """Build dfllm's CPU kernels once, here, before any test starts worker processes (which
    would otherwise wait on the first one's build, and could be killed in the middle of it)."""
    from dfllm.kernels import _cpu

    _cpu.load()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2_dir) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models"), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, smollm2_dir) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models"), smollm2_dir, arch="qwen2", heads=6, kv_heads=2)


@pytest.fixture(scope="session")
def tiny_judge(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny random Llama whose True/False answers differ from row to row (the semantic operators' tests)."""
    return build_tiny_model(tmp_path_factory.mktemp("models"), smollm2_dir, seed=5)


@pytest.fixture(scope="session")
def cli_cluster():
    """A scheduler and two single-thread workers started with ``dask scheduler``/``dask worker``."""
    cluster = CLICluster()
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny random LLaVA-1.5 (:func:`image_data.build_tiny_llava`)."""
    from image_data import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("llava"), smollm2_dir)


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, smollm2_dir) -> Path:
    """The bigram Qwen3 with a thinking tokenizer, saved as a Hugging Face directory
    (:func:`reasoning_data.build_thinker`)."""
    from reasoning_data import build_thinker

    return build_thinker(tmp_path_factory.mktemp("reasoning"), smollm2_dir)
