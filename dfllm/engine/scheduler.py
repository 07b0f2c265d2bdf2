"""Continuous batching with chunked prefill and recompute preemption.

There is no prefill phase and no decode phase: each sequence has ``num_computed_tokens``
and ``num_tokens``, and a step gives every scheduled sequence a number of new tokens to
compute. A step fills a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``): first the running decodes, then running sequences whose prompt is still
being prefilled, then waiting sequences, whose prompts may be split into chunks. When the
KV cache runs out of blocks the newest running sequence is preempted: its blocks are freed
and it goes back to the front of the queue, to be recomputed (mostly from the prefix
cache) when there is room again.

Two policies, as vLLM's ``scheduling_policy``: ``"fcfs"`` admits in arrival order;
``"priority"`` keeps the queue ordered by (request priority, arrival time), lower first,
and preempts the running sequence with the largest such key (the least urgent, newest)
instead of the newest. A sequence that still needs prompt log-probabilities takes no
prefix-cache hit (its prompt positions must all be computed, as in vLLM).

Prefix-aware admission (``prefix_aware``, with prefix caching on and "fcfs"): where vLLM admits strictly in queue
order, so that rows sharing a document only share its blocks if they happen to run while
they are cached, dfllm admits the waiting sequences with the longest cached prefix first,
and holds back a sequence whose next uncached block another running sequence is computing
right now (two sequences admitted together would otherwise both compute it); it hits the
cache a step later. Neither can starve a sequence: one that ``4 * max_num_seqs`` later
sequences overtook is admitted first and never held back. Outputs do not depend on the order.

Admission keeps blocks free for the running sequences to grow into (``reserve_growth``):
for each, the blocks of its remaining ``max_tokens`` times a ratio learned as SGLang's
``new_token_ratio`` is (up after a preemption, down slowly while none happens), instead of
vLLM's fixed 1% watermark, so that fewer decodes are preempted and recomputed.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dfllm.engine.block_manager import BlockManager
from dfllm.engine.block_tables import BlockTableArray
from dfllm.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    import torch

PREFIX_WINDOW = 1024  # waiting sequences that prefix-aware admission reorders
OVERTAKES_PER_SEQ_SLOT = 4  # a sequence overtaken by this many times max_num_seqs later ones goes first
GROWTH_CAP = 1024  # tokens of a sequence's future growth counted at most
GROWTH_RATIO_INIT, GROWTH_RATIO_MIN = 0.7, 0.05  # SGLang starts its new_token_ratio at 0.7
GROWTH_RATIO_UP, GROWTH_RATIO_DECAY = 0.2, 0.002


@dataclass
class SchedulerOutput:
    """The sequences of one step and how many new tokens each computes."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0
    # asynchronous scheduling: the step in flight's sampled token ids (on the device), where the
    # runner reads the input of each sequence with a ``pending_row``; None: every input is known
    prev_token_ids: torch.Tensor | None = None
    # the block manager's rows of its sequences' block tables (dfllm.engine.block_tables), for
    # a decode step's inputs; None: read the tables from the sequences' lists
    tables: BlockTableArray | None = None

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass(frozen=True)
class SchedulerStats:
    """Counters and sizes of the scheduler and its KV-cache blocks, for tests and diagnostics."""

    num_blocks: int
    num_free_blocks: int
    num_waiting: int
    num_running: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # prompt tokens found there
    kv_cache_usage: float


class Scheduler:
    """Decides, step by step, which sequences run and how many tokens each computes; owns the
    block manager that maps their tokens to KV-cache blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        enable_prefix_caching: bool = True,
        reuse_first: bool = False,
        watermark: float = 0.01,
        policy: str = "fcfs",
        prefix_aware: bool = True,
        reserve_growth: bool = True,
        sliding_window: int | None = None,
        max_loras: int | None = None,
    ):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
        self.policy = policy
        # sliding_window: every layer attends within it (Mistral), so blocks that fall out of it are freed
        self._block_args = (num_blocks, block_size, enable_prefix_caching, reuse_first, sliding_window)
        self.bm = BlockManager(*self._block_args)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = int(watermark * num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_aware = prefix_aware and enable_prefix_caching and policy == "fcfs"
        self.num_admitted = 0  # admissions so far: the clock of fairness (``_due``)
        # the share of their remaining tokens that running sequences are expected to need
        # blocks for: up after a preemption, down a little every step without one (SGLang's
        # new_token_ratio), so admission leaves room for decodes instead of preempting them
        self.growth_ratio = GROWTH_RATIO_INIT
        self.reserve_growth = reserve_growth  # False: the watermark only (vLLM's behaviour)
        # LoRA: the most distinct adapters among the running sequences (so in any step); None: no limit
        self.max_loras = max_loras

    def add(self, seq: Sequence) -> None:
        seq.waiting_since = self.num_admitted + len(self.waiting)  # when first come, first served would admit it
        if self.policy == "priority":
            bisect.insort(self.waiting, seq, key=_priority_key)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, allow_empty: bool = False) -> SchedulerOutput:
        """The next step's sequences. A pass that only preempted admits nothing; then a second
        pass (now with room) does. Raises ``RuntimeError`` if nothing at all can run, unless
        ``allow_empty`` (a step is in flight, whose tokens may end or free sequences: the
        engine finishes it and asks again).

        A sequence with a token still on the device (``pending_row``, asynchronous scheduling)
        decodes that token at its position, the runner reading it from the device; one whose
        pending token reaches ``max_tokens`` is not scheduled, and a preempted one is not
        admitted again before its token is known."""
        out = self._schedule_once()
        if not out:
            preempted = out.num_preempted
            out = self._schedule_once()
            out.num_preempted += preempted
        if out.num_preempted:
            self.growth_ratio = min(1.0, self.growth_ratio + GROWTH_RATIO_UP)
        else:
            self.growth_ratio = max(GROWTH_RATIO_MIN, self.growth_ratio - GROWTH_RATIO_DECAY)
        if not out and not allow_empty:
            raise RuntimeError("the scheduler could not schedule any waiting sequence")
        return out

    def update_from_step(self, out: SchedulerOutput) -> None:
        """After the model ran ``out``: its tokens are in the KV cache, and the blocks they
        filled join the prefix cache."""
        bm = self.bm
        bs, hashing, window = bm.block_size, bm.enable_prefix_caching, bm.sliding_window is not None
        for seq, n in zip(out.seqs, out.num_new_tokens):
            if seq.is_finished:  # ended by the tokens of the step before (asynchronous scheduling)
                continue
            seq.num_computed_tokens += n
            # cache_full_blocks does nothing unless a block became full (or a window slides)
            if window or (hashing and seq.num_computed_tokens // bs > seq.num_hashed_blocks):
                bm.cache_full_blocks(seq)

    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()

    def reset_cache(self) -> None:
        """A fresh block manager (after the KV cache was freed and allocated again); nothing may run."""
        assert not self.has_unfinished()
        self.bm = BlockManager(*self._block_args)

    def stats(self) -> SchedulerStats:
        bm = self.bm
        return SchedulerStats(
            bm.num_blocks,
            bm.num_free_blocks,
            len(self.waiting),
            len(self.running),
            self.num_preemptions,
            bm.prefix_queries,
            bm.prefix_hits,
            bm.usage,
        )

    def _schedule_once(self) -> SchedulerOutput:
        out = SchedulerOutput(tables=self.bm.tables)
        budget = self.max_num_batched_tokens
        bs, status_running = self.bm.block_size, SequenceStatus.RUNNING
        seqs, counts = out.seqs, out.num_new_tokens
        # the running decodes first, in order (each as it comes), then the running prefills
        prefills: list[Sequence] = []
        for seq in list(self.running):  # a copy: preemption removes from the list
            if seq.status is not status_running:  # preempted earlier in this step
                continue
            # seq.num_tokens_with_pending, inlined (a property call per sequence: ~18 µs at 256)
            left = len(seq.token_ids) + (seq.pending_row >= 0) - seq.num_computed_tokens
            if left != 1:
                if left > 1:
                    prefills.append(seq)
                continue
            if seq.pending_row >= 0 and _ends_by_length(seq):
                continue  # its pending token is its last: nothing more to compute
            if budget == 0:
                return out
            # a sequence whose block table already holds its new token needs no room and no block
            if seq.num_computed_tokens >= len(seq.block_table) * bs:
                if not self._make_room(seq, 1, out):
                    continue
                self.bm.allocate(seq, seq.num_computed_tokens + 1)
            seqs.append(seq)
            counts.append(1)
            budget -= 1
        for seq in prefills:
            if budget == 0:
                return out
            if seq.status is not status_running:  # preempted earlier in this step
                continue
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if seq.num_computed_tokens + n > len(seq.block_table) * bs:
                if not self._make_room(seq, n, out):
                    continue
                self.bm.allocate(seq, seq.num_computed_tokens + n)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        if out.num_preempted == 0:
            budget = self._admit_waiting(out, budget)
        return out

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until ``seq`` can take ``n`` more tokens.

        Returns False when ``seq`` itself had to be preempted.
        """
        while not self.bm.can_allocate(seq, seq.num_computed_tokens + n):
            victim = max(self.running, key=_priority_key) if self.policy == "priority" else self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        if seq in out.seqs:
            i = out.seqs.index(seq)
            out.seqs.pop(i)
            out.num_new_tokens.pop(i)
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.request.metrics.num_preemptions += 1
        seq.waiting_since = self.num_admitted  # back at the front
        if self.policy == "priority":
            bisect.insort(self.waiting, seq, key=_priority_key)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.num_preempted += 1

    def _admission_order(self) -> tuple[list[Sequence], set[int]]:
        """The waiting sequences in the order to try them, and the hashes of prompt blocks
        that running sequences are computing now (not yet cached).

        First come, first served, unless prefix-aware admission applies (prefix caching on,
        the "fcfs" policy): then the first ``PREFIX_WINDOW`` waiting sequences go longest
        cached prefix first (ties in queue order), as SGLang's longest-prefix-match
        scheduling, so that the sequences sharing a prefix run while it is cached; those
        overtaken too often (:meth:`_due`) go first, in queue order, whatever their prefix."""
        window = list(itertools.islice(self.waiting, PREFIX_WINDOW if self.prefix_aware else self.max_num_seqs + 1))
        if not self.prefix_aware:
            return window, set()
        due: list[Sequence] = []
        rest: list[Sequence] = []
        for s in window:
            (due if self._due(s) else rest).append(s)
        hits = {s.seq_id: self.bm.num_cached_prefix_blocks(s) for s in rest}
        rest.sort(key=lambda s: -hits[s.seq_id])
        computing: set[int] = set()
        for seq in self.running:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                computing.update(self.bm.prompt_block_hashes(seq)[seq.num_hashed_blocks :])
        return due + rest, computing

    def _growth(self, seq: Sequence) -> int:
        """The blocks ``seq`` is expected to add while it decodes: its tokens still to come
        (up to ``max_tokens``, capped at ``GROWTH_CAP``) times the learned share that
        sequences actually generate (``growth_ratio``), counted as the blocks its table
        must add to hold them from its current length (a sequence whose last block is
        nearly full needs a block for its next few tokens)."""
        p = seq.params
        left = (p.max_tokens - seq.num_output_tokens) if p.max_tokens is not None else GROWTH_CAP
        tokens = int(min(max(left, 0), GROWTH_CAP) * self.growth_ratio)
        bs = self.bm.block_size
        return -(-(seq.num_tokens + tokens) // bs) - -(-seq.num_tokens // bs)

    def _growth_reserve(self) -> int:
        """Blocks kept free for the running sequences' growth (the watermark at least)."""
        if not self.reserve_growth:
            return self.watermark_blocks
        return max(self.watermark_blocks, sum(self._growth(s) for s in self.running))

    def _due(self, seq: Sequence) -> bool:
        """Whether ``seq`` was overtaken often enough to go first: admissions since first
        come, first served would have admitted it (its ``waiting_since``)."""
        return self.num_admitted - seq.waiting_since >= OVERTAKES_PER_SEQ_SLOT * self.max_num_seqs

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        if not self.waiting or budget <= 0 or len(self.running) >= self.max_num_seqs:
            return budget  # no room: skip ordering the queue
        order, computing = self._admission_order()
        reserved = self._growth_reserve()  # and each admitted sequence's growth, as it is admitted
        loras = _lora_ids(self.running) if self.max_loras is not None else set()
        for seq in order:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.pending_row >= 0:
                continue  # preempted with a token still on the device: once it is known
            lora = _lora_id(seq)
            if lora is not None and lora not in loras and self.max_loras is not None and len(loras) >= self.max_loras:
                if self._due(seq):  # overtaken long enough: admit no other adapter's rows until its turn
                    break
                continue  # its adapter would be one more than max_loras in the step: later
            wants_cache = not seq.block_table and not seq.needs_prompt_logprobs
            hits = self.bm.match_prefix(seq) if wants_cache else []
            own = self.bm.prompt_block_hashes(seq)[len(hits) :] if wants_cache and self.prefix_aware else []
            if own and own[0] in computing and not self._due(seq):
                continue  # its next block is being computed for another sequence: hit it next step
            num_computed = len(hits) * self.bm.block_size
            n = min(seq.num_tokens - num_computed, budget)
            needed = -(-(num_computed + n) // self.bm.block_size) - len(hits)
            free = self.bm.num_free_after_hits(hits)
            # Keep blocks in reserve for the running decodes' growth, unless nothing runs.
            growth = self._growth(seq) if self.reserve_growth else 0
            reserve = reserved + growth if self.running else 0
            if needed + reserve > free:
                break
            reserved += growth
            computing.update(own)
            self.waiting.remove(seq)
            self.num_admitted += 1
            self.bm.take_prefix(seq, hits)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = time.time()
            self.running.append(seq)
            if lora is not None:
                loras.add(lora)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return budget

    def abort(self, seqs: list[Sequence]) -> None:
        """Drop these sequences (queued or running) and free their blocks."""
        for seq in seqs:
            if seq.is_finished:
                continue
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
            self.bm.free_seq(seq)
        dropped = set(map(id, seqs))
        self.running = [s for s in self.running if id(s) not in dropped]
        self.waiting = deque(s for s in self.waiting if id(s) not in dropped)

    def abort_all(self) -> None:
        """Drop every queued and running sequence and free its blocks."""
        self.abort(list(self.running) + list(self.waiting))

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence the output processor ended and release its blocks (it is waiting
        when it was preempted while its last token was in flight: asynchronous scheduling)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.bm.free_seq(seq)


def _ends_by_length(seq: Sequence) -> bool:
    """Whether the token in flight of ``seq`` is its last by ``max_tokens``."""
    limit = seq.params.max_tokens
    return limit is not None and seq.num_output_tokens + 1 >= limit


def _lora_id(seq: Sequence) -> int | None:
    """The id of the LoRA adapter ``seq`` runs with (None: the base model)."""
    lora = seq.request.lora_request
    return None if lora is None else lora.lora_int_id


def _lora_ids(seqs: list[Sequence]) -> set[int]:
    return {i for i in map(_lora_id, seqs) if i is not None}


def _priority_key(seq: Sequence) -> tuple[int, float, int]:
    """The order of the ``"priority"`` policy: request priority, then arrival, then creation."""
    return (seq.request.priority, seq.request.metrics.arrival_time, seq.seq_id)
