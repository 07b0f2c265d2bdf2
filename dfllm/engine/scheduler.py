"""Continuous batching with chunked prefill and recompute preemption.

There is no prefill phase and no decode phase: each sequence has ``num_computed_tokens``
and ``num_tokens``, and a step gives every scheduled sequence a number of new tokens to
compute. A step fills a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``): first the running decodes, then running sequences whose prompt is still
being prefilled, then waiting sequences, whose prompts may be split into chunks. When the
KV cache runs out of blocks the newest running sequence is preempted: its blocks are freed
and it goes back to the front of the queue, to be recomputed (mostly from the prefix
cache) when there is room again.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from dfllm.engine.block_manager import BlockManager
from dfllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """The sequences of one step and how many new tokens each computes."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    """Decides, step by step, which sequences run and how many tokens each computes."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        watermark: float = 0.01,
    ):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, n, out):
                continue
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        if out.num_preempted == 0:
            budget = self._admit_waiting(out, budget)
        return out

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until ``seq`` can take ``n`` more tokens.

        Returns False when ``seq`` itself had to be preempted.
        """
        while not self.bm.can_allocate(seq, seq.num_computed_tokens + n):
            victim = self.running[-1]
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
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.num_preempted += 1

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.bm.match_prefix(seq) if not seq.block_table else []
            num_computed = len(hits) * self.bm.block_size
            n = min(seq.num_tokens - num_computed, budget)
            needed = -(-(num_computed + n) // self.bm.block_size) - len(hits)
            free = self.bm.num_free_after_hits(hits)
            # Keep a few blocks in reserve for the running decodes, unless nothing runs.
            reserve = self.watermark_blocks if self.running else 0
            if needed + reserve > free:
                break
            self.waiting.popleft()
            self.bm.take_prefix(seq, hits)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = time.time()
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return budget

    def abort_all(self) -> int:
        """Drop every queued and running sequence and free its blocks (after a failed step, so
        the engine stays usable); the number dropped."""
        seqs = list(self.running) + list(self.waiting)
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
            self.bm.free_seq(seq)
        self.running.clear()
        self.waiting.clear()
        return len(seqs)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished sequence and release its blocks."""
        seq.status = SequenceStatus.FINISHED
        self.running.remove(seq)
        self.bm.free_seq(seq)
