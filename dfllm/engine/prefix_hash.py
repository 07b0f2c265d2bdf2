"""The prefix cache's block hash chain: the one definition of which prompts share KV blocks.

A full block of ``block_size`` prompt tokens is keyed by ``hash((parent, key))``: ``key`` is
its token ids followed by the keys of the images whose placeholders it holds (see
:func:`dfllm.multimodal.inputs.block_tokens`), and ``parent`` is the previous block's hash,
or for the first block the chain's root: :data:`BASE_ROOT` for the base model, a LoRA
adapter's own root otherwise (:func:`chain_root`), so that two adapters, or an adapter and
the base model, never share blocks.

The engine's block manager (:mod:`dfllm.engine.block_manager`) keys its prefix cache with
these functions, and prefix-aware placement (:mod:`dfllm.accessors.prefix_placement`) groups
a job's rows by them before they go to the engines, so the two cannot disagree.

Every part of a key is an ``int`` (token ids, negative image keys, the root), so a chain is
the same in every process of a cluster: Python hashes ints and tuples of ints without the
per-process salt it gives strings (``PYTHONHASHSEED``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from dfllm.multimodal.inputs import block_tokens

if TYPE_CHECKING:
    from dfllm.multimodal.inputs import MultiModalInputs

BASE_ROOT = 0  # the parent of the base model's first block hash


def chain_root(lora_int_id: int | None) -> int:
    """The parent of a prompt's first block hash: :data:`BASE_ROOT` for the base model, and
    the adapter's ``lora_int_id`` (ids are >= 1) for a LoRA adapter.

    Roots are non-negative because Python hashes ``-1`` as ``-2``: negative roots ``-1`` and
    ``-2`` would give adapters 1 and 2 the same chain, and so each other's KV blocks."""
    return BASE_ROOT if lora_int_id is None else int(lora_int_id)


def block_hash(parent: int, key: tuple[int, ...]) -> int:
    """The hash of a full block whose prefix-cache key is ``key``, chained to ``parent``."""
    return hash((parent, key))


def prefix_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_int_id: int | None = None,
    mm_inputs: MultiModalInputs | None = None,
    num_blocks: int | None = None,
    start: int = 0,
    parent: int | None = None,
) -> list[int]:
    """The hash chain of a prompt's full blocks, as the prefix cache keys them.

    ``num_blocks`` is how many leading blocks to hash (default: those the prefix cache can
    serve, ``(len(token_ids) - 1) // block_size``: at least one token is always computed).
    ``start`` and ``parent`` extend a chain already known up to block ``start`` (``parent``
    being the hash of block ``start - 1``); the result is then blocks ``start`` onwards."""
    if num_blocks is None:
        num_blocks = max(0, (len(token_ids) - 1) // block_size)
    if parent is None:
        if start:
            raise ValueError("prefix_block_hashes: start > 0 needs the parent hash of block start - 1")
        parent = chain_root(lora_int_id)
    chain: list[int] = []
    for i in range(start, num_blocks):
        parent = block_hash(
            parent,
            block_tokens(list(token_ids) if not isinstance(token_ids, list) else token_ids, mm_inputs, i, block_size),
        )
        chain.append(parent)
    return chain
