"""Attention metadata for one engine step: where each sequence's queries and keys live."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSpan:
    """Queries ``[q_start, q_start + q_len)`` of one sequence attending over ``ctx_len`` keys.

    ``kv_slots`` lists the cache slots of all ``ctx_len`` keys; it is None when the sequence
    has no cached prefix (``ctx_len == q_len``), in which case the fresh keys are used.
    """

    q_start: int
    q_len: int
    ctx_len: int
    kv_slots: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Everything the attention kernels need, built once per step and shared by all layers.

    Tokens of the step are flattened into one batch. ``slot_mapping[t]`` is the KV-cache
    slot (``block * block_size + offset``) of token ``t``, or -1 for padding.
    Sequences are either decodes (one query each, listed in ``decode_rows`` with their
    padded ``decode_block_tables`` and key mask) or prefill spans.
    ``query_start_loc``, ``seq_lens`` and ``block_tables`` describe every sequence of the
    step in one ragged layout for kernels that handle mixed batches in one launch.
    """

    slot_mapping: torch.Tensor
    prefills: list[PrefillSpan]
    decode_rows: torch.Tensor | None
    decode_block_tables: torch.Tensor | None
    decode_mask: torch.Tensor | None
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
