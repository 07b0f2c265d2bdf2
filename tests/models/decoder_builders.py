"""Tiny random decoders of any transformers config class, saved as real Hugging Face
directories with the SmolLM2 tokenizer (the families beyond ``helpers.build_tiny_model``)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from dfllm import LLM, SamplingParams

from helpers import TOKENIZER_FILES

GREEDY = dict(temperature=0.0, ignore_eos=True)


def build_decoder(
    root: Path,
    tokenizer_dir: Path,
    config_cls: type[PretrainedConfig],
    name: str,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    seed: int = 0,
    init: Callable[[nn.Module], None] | None = None,
    **overrides,
) -> Path:
    """Save a random ``config_cls`` causal LM (float32) under ``root / name`` and return its path;
    ``init`` may change the model before it is saved."""
    vocab = AutoTokenizer.from_pretrained(tokenizer_dir).vocab_size
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_cls(**kwargs), dtype=torch.float32)
    if init is not None:
        init(model)
    path = root / name
    model.save_pretrained(path)
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).exists():
            shutil.copy(tokenizer_dir / file, path / file)
    return path


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """dfllm's greedy continuations of token-id prompts."""
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]
