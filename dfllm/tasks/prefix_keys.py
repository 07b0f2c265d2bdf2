"""What prefix-aware placement knows of a partition's rows: each row's prefix keys and work.

:func:`prefix_keys` renders and tokenizes a generative task's rows with this process's
engine for the task (:func:`dfllm.tasks.runners.prompt_requests`: the runner's own
rendering, templates, chat template, images and LoRA adapters included), and hashes each
prompt's full blocks with the engine's prefix-cache hash chain
(:func:`dfllm.engine.prefix_hash.prefix_block_hashes`). It keeps the chain's hashes at the
depths 1, 2, 4, 8... blocks and at the last full block, so that a directory of the job's
prefixes stays small (a few keys per row) while its longest match is within half of the
true shared prefix; and a key of the whole prompt, so that rows with the same prompt meet
in one engine, and a deterministic row's dedupe digest, so that identical requests meet where
the engine computes them once (:mod:`dfllm.engine.dedupe`). A row's work is its prompt
tokens plus the tokens it may generate (``max_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from dfllm.engine.dedupe import dedupe_digest
from dfllm.engine.prefix_hash import chain_root, prefix_block_hashes
from dfllm.multimodal.inputs import block_tokens
from dfllm.tasks.runners import prompt_requests
from dfllm.tasks.task import LLMTask


@dataclass(frozen=True)
class RowKeys:
    """One row's keys, ``(key, tokens)`` pairs, shortest first: ``tokens`` is what an engine
    already holding ``key`` is spared of the row's work (for a block hash, the prompt tokens
    it covers; for the whole prompt, all of them; for the row's :func:`dedupe digest
    <dfllm.engine.dedupe.dedupe_digest>`, all of its work but one token); its prompt tokens,
    and its work (prompt plus expected generated tokens)."""

    keys: tuple[tuple[int, int], ...]
    prompt_tokens: int
    work: int


def sampled_depths(num_blocks: int) -> list[int]:
    """The chain depths (in blocks, >= 1) whose hashes a row keeps: powers of two, and the last."""
    depths, d = [], 1
    while d < num_blocks:
        depths.append(d)
        d *= 2
    if num_blocks:
        depths.append(num_blocks)
    return depths


def row_keys(
    token_ids, block_size: int, max_tokens: int | None, lora_int_id=None, mm_inputs=None, dedupe: int | None = None
) -> RowKeys:
    """The :class:`RowKeys` of one prompt (its token ids as the engine gets them): the chain's
    hashes at the sampled depths of the blocks the prefix cache can serve, then the whole
    prompt's key (the chain over every full block, extended by the tokens after them and the
    prompt's length: a three-tuple, never a block's hash), then ``dedupe``, the request's
    dedupe digest where the engine computes identical requests once."""
    tokens = list(token_ids)
    full = len(tokens) // block_size
    chain = prefix_block_hashes(tokens, block_size, lora_int_id=lora_int_id, mm_inputs=mm_inputs, num_blocks=full)
    served = max(0, (len(tokens) - 1) // block_size)  # at least one token is always computed
    keys = [(chain[d - 1], d * block_size) for d in sampled_depths(served)]
    parent = chain[-1] if chain else chain_root(lora_int_id)
    whole = hash((parent, block_tokens(tokens, mm_inputs, full, block_size), len(tokens)))
    keys.append((whole, len(tokens)))
    work = len(tokens) + int(max_tokens or 0)
    if dedupe is not None:
        keys.append((dedupe, work - 1))
    return RowKeys(tuple(keys), len(tokens), work)


def request_keys(req, block_size: int) -> RowKeys:
    """The :class:`RowKeys` of one engine request (its prompt's token ids, LoRA adapter,
    images, ``max_tokens`` and dedupe digest), for an engine of KV blocks of ``block_size``."""
    lora = req.lora_request
    return row_keys(
        req.prompt_token_ids,
        block_size,
        req.params.max_tokens,
        None if lora is None else lora.lora_int_id,
        req.mm_inputs,
        dedupe_digest(req),
    )


def prefix_keys(df: pd.DataFrame, task: LLMTask) -> list[RowKeys | None]:
    """Per row of ``df`` (a generative task's partition), its :class:`RowKeys`, or None for a
    row the runner refuses (its error is computed where it runs)."""
    requests, block_size = prompt_requests(df, task)
    keys: list[RowKeys | None] = [None] * len(df)
    for i, req in requests.items():
        keys[i] = request_keys(req, block_size)
    return keys
