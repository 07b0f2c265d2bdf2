"""What prefix-aware placement knows of a partition's rows: each row's prefix keys and work.

:func:`prefix_keys` renders and tokenizes a generative task's rows with this process's
engine for the task (:func:`dfllm.tasks.runners.prompt_requests`: the runner's own
rendering, templates, chat template, images and LoRA adapters included), and hashes each
prompt's full blocks with the engine's prefix-cache hash chain
(:func:`dfllm.engine.prefix_hash.prefix_block_hashes`). It keeps the chain's hashes at the
depths 1, 2, 4, 8... blocks and at the last full block, so that a directory of the job's
prefixes stays small (a few keys per row) while its longest match is within half of the
true shared prefix. A row's work is its prompt tokens plus the tokens it may generate
(``max_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from dfllm.engine.prefix_hash import prefix_block_hashes
from dfllm.tasks.runners import prompt_requests
from dfllm.tasks.task import LLMTask


@dataclass(frozen=True)
class RowKeys:
    """One row's prefix keys, ``(hash, tokens)`` pairs (the chain's hash after ``tokens``
    prompt tokens, shortest first), its prompt tokens and its work (prompt plus expected
    generated tokens)."""

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


def row_keys(token_ids, block_size: int, max_tokens: int | None, lora_int_id=None, mm_inputs=None) -> RowKeys:
    """The :class:`RowKeys` of one prompt (its token ids as the engine gets them)."""
    chain = prefix_block_hashes(token_ids, block_size, lora_int_id=lora_int_id, mm_inputs=mm_inputs)
    keys = tuple((chain[d - 1], d * block_size) for d in sampled_depths(len(chain)))
    return RowKeys(keys, len(token_ids), len(token_ids) + int(max_tokens or 0))


def prefix_keys(df: pd.DataFrame, task: LLMTask) -> list[RowKeys | None]:
    """Per row of ``df`` (a generative task's partition), its :class:`RowKeys`, or None for a
    row the runner refuses (its error is computed where it runs)."""
    requests, block_size = prompt_requests(df, task)
    keys: list[RowKeys | None] = [None] * len(df)
    for i, req in requests.items():
        lora = req.lora_request
        keys[i] = row_keys(
            req.prompt_token_ids,
            block_size,
            req.params.max_tokens,
            None if lora is None else lora.lora_int_id,
            req.mm_inputs,
        )
    return keys
