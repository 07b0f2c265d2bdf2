"""Paged KV-cache bookkeeping: fixed-size blocks, block tables and the prefix cache.

Every block holds ``block_size`` token slots of the preallocated KV tensor. A sequence owns
an ordered block table; token ``i`` of the sequence lives in slot
``block_table[i // block_size] * block_size + i % block_size``.

Prefix caching: once a block is full and computed it is keyed by a hash chain
``hash((parent_hash, tokens))`` (:mod:`dfllm.engine.prefix_hash`, the one definition), so
two sequences that share a prefix share its blocks
(reference counted). A block whose count drops to zero goes to the tail of the free list
but keeps its contents and hash, so it can be revived until it is evicted, oldest first.

A block is handed out as it is, not cleared (as vLLM does): the slots past a sequence's
length may hold anything (never-written memory, or a previous owner's keys, NaN where its
model output went non-finite), and no attention path reads them (the kernels mask their
loads; the PyTorch references zero what they gather past a length,
:func:`dfllm.kernels.paged_attention.gather_seen`).

Blocks never handed out yet wait apart. On a GPU the whole cache is resident anyway, so
they are used before any cached block is evicted; on a CPU their memory is not touched
until first use, so ``reuse_first=True`` reuses freed blocks that hold no cached prefix
before touching new ones: the process's memory grows with the running sequences and the
prefixes cached for later ones (up to the whole cache, which on a CPU is sized to be held
in RAM, see :func:`dfllm.engine.kv_memory.cpu_kv_budget`), not with blocks of no further use.
(Reusing every freed block first, cached or not, kept memory lower but evicted a
document's prefix as soon as the next rows needed blocks, so rows of one document that
arrived a few steps apart computed it again.)

Sliding window (a model whose every layer attends within ``sliding_window`` keys, Mistral):
once a sequence's next query is at position ``p``, no later query sees a key before
``p - sliding_window + 1``, so the blocks wholly before it are released (as vLLM does) and
their table entries become :data:`FREED`; the attention kernels never read them. A released
block keeps its hash like any freed block: its contents stay valid for a prefix hit until it
is handed out again, which drops the hash. The sequence's last hashed block is kept, as the
parent of the next block's hash.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from dfllm.engine import prefix_hash
from dfllm.engine.block_tables import BlockTableArray
from dfllm.engine.prefix_hash import block_hash, prefix_block_hashes
from dfllm.engine.sequence import Sequence
from dfllm.multimodal.inputs import block_tokens

__all__ = ["FREED", "Block", "BlockManager", "block_hash", "chain_root"]

FREED = -1  # block-table entry of a block released because it fell out of the sliding window


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


def chain_root(seq: Sequence) -> int:
    """The parent of a sequence's first block hash (:func:`dfllm.engine.prefix_hash.chain_root`
    of its LoRA adapter), so that two adapters (or an adapter and the base model) never
    share KV blocks."""
    lora = seq.request.lora_request
    return prefix_hash.chain_root(None if lora is None else lora.lora_int_id)


class BlockManager:
    """Allocates KV blocks to sequences and keeps the prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        reuse_first: bool = False,
        sliding_window: int | None = None,
    ):
        self.block_size = block_size
        # set only when every layer of the model attends within this window
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.reuse_first = reuse_first
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks that were used before, in eviction order (least recently freed first).
        self.free: OrderedDict[int, None] = OrderedDict()
        self.next_fresh = 0  # blocks [next_fresh, num_blocks) were never handed out
        self.hash_to_block: dict[int, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        # every block table also as a row of one array (dfllm.engine.block_tables): this class
        # is the one place that changes a block table, and writes each change there too
        self.tables = BlockTableArray()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_fresh_blocks(self) -> int:
        return len(self.blocks) - self.next_fresh

    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + self.num_fresh_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences."""
        return 1.0 - self.num_free_blocks / len(self.blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that its table covers ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # ---- prefix cache -------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of ``seq`` (leaving at least one token to compute)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        for i, h in enumerate(self.prompt_block_hashes(seq)):
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != block_tokens(
                seq.token_ids, seq.request.mm_inputs, i, bs
            ):
                break
            hits.append(block_id)
        return hits

    def prompt_block_hashes(self, seq: Sequence) -> list[int]:
        """The hash chain of the full blocks ``match_prefix`` would look up for ``seq``
        (computed once per length and kept on the sequence)."""
        chain, lora = seq.block_hashes, seq.request.lora_request
        chain.extend(
            prefix_block_hashes(
                seq.token_ids,
                self.block_size,
                lora_int_id=None if lora is None else lora.lora_int_id,
                mm_inputs=seq.request.mm_inputs,
                num_blocks=(seq.num_tokens - 1) // self.block_size,
                start=len(chain),
                parent=chain[-1] if chain else None,
            )
        )
        return chain

    def num_cached_prefix_blocks(self, seq: Sequence) -> int:
        """How many leading blocks of ``seq`` the prefix cache holds (as ``match_prefix``,
        from the kept hash chain)."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        for h in self.prompt_block_hashes(seq):
            if h not in self.hash_to_block:
                break
            n += 1
        return n

    def num_free_after_hits(self, hits: list[int]) -> int:
        """Free blocks left for new allocations once ``hits`` are taken."""
        return self.num_free_blocks - sum(1 for b in hits if self.blocks[b].ref_count == 0)

    def take_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Give ``seq`` the cached blocks ``hits``; their tokens count as computed."""
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            self.tables.append(seq, block_id)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that became full and computed in the prefix cache; with
        a sliding window, then release those that fell out of it."""
        self._hash_full_blocks(seq)
        if self.sliding_window is not None:
            self.free_out_of_window(seq)

    def _hash_full_blocks(self, seq: Sequence) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first = seq.num_hashed_blocks
        parent = self.blocks[seq.block_table[first - 1]].hash if first else chain_root(seq)
        if first and parent is None:  # the chain was reset under this sequence: never key it anew
            return
        for i in range(first, seq.num_computed_tokens // bs):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                tokens = block_tokens(seq.token_ids, seq.request.mm_inputs, i, bs)  # and its images' keys
                block.hash = block_hash(parent, tokens)  # type: ignore[arg-type]  # None returned above
                block.token_ids = tokens
                self.hash_to_block.setdefault(block.hash, block.block_id)
            parent = block.hash
        seq.num_hashed_blocks = max(first, seq.num_computed_tokens // bs)

    def free_out_of_window(self, seq: Sequence) -> None:
        """Release the blocks of ``seq`` that no query from its next token on can see."""
        assert self.sliding_window is not None
        bs = self.block_size
        dead = max(0, seq.num_computed_tokens - self.sliding_window + 1) // bs
        if self.enable_prefix_caching:
            dead = min(dead, seq.num_hashed_blocks - 1)  # the hash chain's parent stays
        table = seq.block_table
        i = min(dead, len(table)) - 1
        while i >= 0 and table[i] != FREED:  # newly dead blocks, back to the ones released before
            self._release(table[i])
            table[i] = FREED
            self.tables.set(seq, i, FREED)
            i -= 1

    def _release(self, block_id: int) -> None:
        """Drop one reference to a block; unreferenced, it joins the free list (a block that
        serves no cached prefix first in line for eviction, a cached one last)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if not self._serves(block_id):
                self.free.move_to_end(block_id, last=False)

    def _serves(self, block_id: int) -> bool:
        """Whether a block is the prefix cache's copy of its hash (a later match would use it;
        a block keyed like an earlier one is of no further use once free)."""
        h = self.blocks[block_id].hash
        return self.enable_prefix_caching and h is not None and self.hash_to_block.get(h) == block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (blocks in use keep their contents)."""
        self.hash_to_block.clear()
        for block in self.blocks:
            block.hash = None
            block.token_ids = ()

    # ---- allocation ------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` can grow to ``num_tokens`` tokens."""
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def _take_free_block(self) -> int:
        """A free block to hand out: with ``reuse_first``, a freed block holding no cached
        prefix before a never-touched one; a cached block only once none is left untouched
        (then the least recently freed)."""
        free = self.free
        if free and (self.next_fresh == len(self.blocks) or (self.reuse_first and not self._serves(next(iter(free))))):
            return free.popitem(last=False)[0]
        self.next_fresh += 1
        return self.next_fresh - 1

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow the block table of ``seq`` to cover ``num_tokens`` tokens."""
        table, blocks = seq.block_table, self.blocks
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block_id = self._take_free_block()
            block = blocks[block_id]
            if block.hash is not None:
                if self.hash_to_block.get(block.hash) == block_id:
                    del self.hash_to_block[block.hash]
                block.hash = None
                block.token_ids = ()
            block.ref_count = 1
            table.append(block_id)
            self.tables.append(seq, block_id)

    def free_seq(self, seq: Sequence) -> None:
        """Release the blocks of ``seq``; its last blocks become the first evicted."""
        for block_id in reversed(seq.block_table):
            if block_id != FREED:
                self._release(block_id)
        seq.block_table = []
        self.tables.release(seq)
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
