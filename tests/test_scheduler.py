"""Scheduler: token budget, sequence cap, decodes first, chunked prefill, preemption."""

from __future__ import annotations

from dfllm.engine.scheduler import Scheduler
from dfllm.engine.sequence import SequenceStatus

from helpers import make_seq


def advance(sched, out):
    """Pretend the model ran: count computed tokens and sample one token where due."""
    for seq, n in zip(out.seqs, out.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)


def test_budget_and_chunking():
    s = Scheduler(64, 4, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = make_seq(list(range(25))), make_seq(list(range(100, 106)))
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert out.seqs == [a] and out.num_new_tokens == [10]
    advance(s, out)
    out = s.schedule()
    assert out.seqs == [a] and out.num_new_tokens == [10]
    advance(s, out)
    out = s.schedule()  # a's last 5 prompt tokens, then b's prompt fills the rest
    assert out.seqs == [a, b] and out.num_new_tokens == [5, 5]
    advance(s, out)
    out = s.schedule()  # a decodes first, then b's remaining prompt token
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 1]
    assert out.total_tokens <= 10


def test_max_num_seqs_caps_running():
    s = Scheduler(64, 4, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_seq([i] * 3) for i in range(3)]
    for q in seqs:
        s.add(q)
    out = s.schedule()
    assert out.seqs == seqs[:2] and len(s.waiting) == 1


def test_preempts_newest_and_requeues_it_first():
    s = Scheduler(4, 4, enable_prefix_caching=False, max_num_seqs=4,
                  max_num_batched_tokens=100, watermark=0)
    a, b = make_seq(list(range(8))), make_seq(list(range(10, 18)))
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert out.seqs == [a, b]
    advance(s, out)  # both now need a third block; only 0 free
    out = s.schedule()
    assert out.seqs == [a] and out.num_preempted == 1
    assert b.status is SequenceStatus.WAITING and s.waiting[0] is b and b.block_table == []
    assert s.num_preemptions == 1 and b.request.metrics.num_preemptions == 1
