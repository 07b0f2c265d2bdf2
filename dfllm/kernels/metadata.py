"""Kernel metadata for one engine step: where each sequence's queries and keys live, and which
token rows run which LoRA adapter."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar, overload

import torch

T = TypeVar("T")


class Deferred(Sequence[T], Generic[T]):
    """A list made on first use: metadata that only some kernels read (the decode groups of the
    PyTorch reference and of MLA) costs nothing in a step whose kernels never look at it."""

    def __init__(self, make: Callable[[], list[T]]):
        self._make: Callable[[], list[T]] | None = make
        self._items: list[T] = []

    def _list(self) -> list[T]:
        if self._make is not None:
            self._items, self._make = self._make(), None
        return self._items

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i):
        return self._list()[i]

    def __len__(self) -> int:
        return len(self._list())

    def __iter__(self) -> Iterator[T]:
        return iter(self._list())

    def __reduce__(self):
        """Pickled (to another rank's process) as the plain list, made now."""
        return list, (self._list(),)


@dataclass
class LoRAMetadata:
    """The adapter slots of a step's token rows, grouped by slot.

    ``token_slots`` (int64 ``[T]``, -1 for base rows). Per segment (one per slot used):
    ``seg_slots[i]`` and either a consecutive range ``[seg_bounds[i][0], seg_bounds[i][1])``
    of rows (``seg_rows[i]`` None) or its rows ``seg_rows[i]`` (int64). For one-launch
    kernels: ``sorted_rows`` (int64, the adapted rows ordered by slot) and per segment its
    ``seg_start``/``seg_len`` in them and its ``seg_slot`` (int32 tensors), with
    ``max_seg_len`` on the host. For the batched path (many adapters of few rows each, as in
    decode steps): ``pad_rows`` (int64 ``[span * max_seg_len]``) lays the adapted rows out as
    ``[span, max_seg_len]`` by slot (``span`` = the highest slot + 1; padding points at row 0)
    and ``pad_valid`` (bool ``[span, max_seg_len, 1]``) marks the real rows; ``batched`` says
    whether :func:`~dfllm.kernels.lora.lora_apply` takes that path.
    """

    token_slots: torch.Tensor
    seg_slots: list[int]
    seg_bounds: list[tuple[int, int]]
    seg_rows: list[torch.Tensor | None]
    sorted_rows: torch.Tensor
    seg_start: torch.Tensor
    seg_len: torch.Tensor
    seg_slot: torch.Tensor
    max_seg_len: int
    pad_rows: torch.Tensor | None = None
    pad_valid: torch.Tensor | None = None
    batched: bool = False
    # when the adapted rows are the consecutive rows [lo, hi) in slot order (the engine sorts a
    # step's sequences by slot): the padded position of each, so that one gather adds them back
    unpad: torch.Tensor | None = None
    adapted: tuple[int, int] = (0, 0)

    def to(self, device: torch.device) -> LoRAMetadata:
        """This metadata with its tensors on ``device`` (copied without a stream synchronisation:
        from pageable memory each copy is staged before it returns)."""
        if self.token_slots.device == device:
            return self
        return LoRAMetadata(
            self.token_slots.to(device, non_blocking=True),
            self.seg_slots,
            self.seg_bounds,
            [None if r is None else r.to(device, non_blocking=True) for r in self.seg_rows],
            self.sorted_rows.to(device, non_blocking=True),
            self.seg_start.to(device, non_blocking=True),
            self.seg_len.to(device, non_blocking=True),
            self.seg_slot.to(device, non_blocking=True),
            self.max_seg_len,
            None if self.pad_rows is None else self.pad_rows.to(device, non_blocking=True),
            None if self.pad_valid is None else self.pad_valid.to(device, non_blocking=True),
            self.batched,
            None if self.unpad is None else self.unpad.to(device, non_blocking=True),
            self.adapted,
        )


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
class DecodeGroup:
    """Decodes of similar context length, attended together.

    ``rows`` are their query rows in the step's batch; ``block_tables`` their block tables
    padded to the group's longest; ``mask`` marks the real keys ``[len(rows), width * block_size]``.
    """

    rows: torch.Tensor
    block_tables: torch.Tensor
    mask: torch.Tensor


@dataclass
class DecodeBatch:
    """Every decode of the step at once, for kernels that read the paged cache directly.

    ``rows`` (int64) are their query rows in the step's batch, ``block_tables`` (int32
    ``[len(rows), width]``) their block tables, each padded with its own last block, and
    ``seq_lens`` (int32) their context lengths, the new token included.
    """

    rows: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


@dataclass
class AttentionMetadata:
    """Everything the attention kernels need, built once per step and shared by all layers.

    Tokens of the step are flattened into one batch. ``slot_mapping[t]`` is the KV-cache
    slot (``block * block_size + offset``) of token ``t``, or -1 for padding.
    Sequences are either decodes (one query each, in ``decode_groups`` of similar context
    length so that little padding is gathered) or prefill spans.
    ``query_start_loc``, ``seq_lens`` and ``block_tables`` describe every sequence of the
    step in one ragged layout for kernels that handle mixed batches in one launch;
    ``max_query_len``/``max_seq_len`` are their host-side maxima (0 when unknown: the Triton
    kernel then reads them from the tensors, at the cost of a device sync).
    ``sliding_window``, when set, limits every layer's attention to the window (Mistral): a
    query at position ``p`` sees the keys at positions ``p - sliding_window < j <= p``; a
    layer may also pass its own window to the kernel (Gemma's alternating layers).
    ``lora`` carries the adapter slot of every token row (see :mod:`dfllm.kernels.lora`).
    """

    slot_mapping: torch.Tensor
    prefills: list[PrefillSpan]
    decode_groups: Sequence[DecodeGroup]
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    max_query_len: int = 0
    max_seq_len: int = 0
    sliding_window: int | None = None
    decodes: DecodeBatch | None = None
    # LoRA: each token row's adapter slot, grouped by slot (None: no row runs an adapter)
    lora: LoRAMetadata | None = None
