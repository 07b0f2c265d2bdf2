"""Scheduler: token budget, sequence cap, decodes first, chunked prefill, preemption, policies."""

from __future__ import annotations

import pytest

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
    s = Scheduler(
        4, 4, enable_prefix_caching=False, max_num_seqs=4, max_num_batched_tokens=100, watermark=0, reserve_growth=False
    )
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


def prioritized(tokens: list[int], priority: int, arrival: float):
    seq = make_seq(tokens)
    seq.request.priority, seq.request.metrics.arrival_time = priority, arrival
    return seq


def test_priority_policy_admits_by_priority_then_arrival():
    """vLLM's "priority" policy: lower priority values first, ties in arrival order; "fcfs"
    ignores priorities."""
    for policy, expected in (("priority", ["c", "a", "d", "b"]), ("fcfs", ["a", "b", "c", "d"])):
        s = Scheduler(64, 4, max_num_seqs=1, max_num_batched_tokens=100, policy=policy)
        seqs = dict(
            a=prioritized([1, 2], 1, 0.0),
            b=prioritized([3, 4], 2, 1.0),
            c=prioritized([5, 6], 0, 2.0),
            d=prioritized([7, 8], 1, 3.0),
        )
        for seq in seqs.values():
            s.add(seq)
        order = []
        for _ in seqs:
            out = s.schedule()
            (seq,) = out.seqs
            order.append(next(k for k, v in seqs.items() if v is seq))
            advance(s, out)
            s.finish(seq)
        assert order == expected, policy


def test_priority_policy_preempts_the_least_urgent_and_requeues_it_by_priority():
    s = Scheduler(
        4,
        4,
        enable_prefix_caching=False,
        max_num_seqs=4,
        max_num_batched_tokens=100,
        watermark=0,
        policy="priority",
        reserve_growth=False,
    )
    urgent_late, lax_early = prioritized(list(range(8)), 0, 1.0), prioritized(list(range(10, 18)), 5, 0.0)
    s.add(lax_early)
    s.add(urgent_late)
    out = s.schedule()
    assert out.seqs == [urgent_late, lax_early]  # priority order, not arrival
    advance(s, out)  # both now need a third block; none free
    out = s.schedule()
    assert out.seqs == [urgent_late] and out.num_preempted == 1
    assert lax_early.status is SequenceStatus.WAITING and list(s.waiting) == [lax_early]
    waiting_urgent = prioritized([1, 2, 3], 0, 2.0)
    s.add(waiting_urgent)
    assert list(s.waiting) == [waiting_urgent, lax_early]  # the preempted one keeps its place by priority


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling policy"):
        Scheduler(4, 4, max_num_seqs=1, max_num_batched_tokens=8, policy="lifo")


# ---- prefix-aware admission --------------------------------------------------------------------
DOC_A, DOC_B = list(range(12)), list(range(100, 112))  # three blocks of 4 tokens each


def step(s):
    """One step as the engine runs it: computed tokens counted and cached, a token sampled where due."""
    out = s.schedule()
    s.update_from_step(out)
    for seq in out.seqs:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    return out


def run_to_end(s, seq):
    """Step until ``seq`` computed its prompt, then finish it (its blocks stay cached)."""
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        step(s)
    s.finish(seq)


def test_prefix_aware_admission_runs_the_cached_prefix_first():
    for caching, first in ((True, "a2"), (False, "b1")):
        s = Scheduler(64, 4, max_num_seqs=1, max_num_batched_tokens=100, enable_prefix_caching=caching)
        a1 = make_seq(DOC_A + [50, 51])
        s.add(a1)
        run_to_end(s, a1)
        b1, a2 = make_seq(DOC_B + [60]), make_seq(DOC_A + [52, 53])
        s.add(b1)
        s.add(a2)
        (got,) = s.schedule().seqs
        assert got is dict(a2=a2, b1=b1)[first]
        if caching:
            assert a2.num_computed_tokens == 12  # served from the cache


def test_sequences_sharing_an_uncached_prefix_are_not_admitted_together():
    s = Scheduler(64, 4, max_num_seqs=4, max_num_batched_tokens=100)
    a1, a2, b1 = make_seq(DOC_A + [50]), make_seq(DOC_A + [51]), make_seq(DOC_B + [60])
    for seq in (a1, a2, b1):
        s.add(seq)
    out = step(s)
    assert out.seqs == [a1, b1]  # a2 waits: its first block is being computed for a1
    out = s.schedule()
    assert a2 in out.seqs and a2.num_computed_tokens == 12 and out.num_new_tokens[out.seqs.index(a2)] == 1


def test_prefix_aware_admission_starves_no_sequence():
    """A sequence without a cached prefix, overtaken by one sharer after another, goes first
    once 4 * max_num_seqs later ones overtook it."""
    s = Scheduler(256, 4, max_num_seqs=1, max_num_batched_tokens=100)
    first = make_seq(DOC_A + [1])
    s.add(first)
    run_to_end(s, first)
    lone = make_seq(DOC_B + [2])
    s.add(lone)
    admitted = []
    for i in range(10):
        s.add(make_seq(DOC_A + [3 + i]))  # each time, a newer sequence whose prefix is cached
        (seq,) = s.schedule().seqs
        admitted.append(seq)
        run_to_end(s, seq) if seq.num_computed_tokens < seq.num_prompt_tokens else s.finish(seq)
        if seq is lone:
            break
    assert admitted[-1] is lone and len(admitted) == 4 + 1


def test_growth_reserve_keeps_room_for_running_decodes():
    """A running sequence with 63 tokens to go keeps blocks free for them (at the starting
    ratio, about half of their 16 blocks): a newcomer that would eat them waits, unless the
    reserve is off (vLLM's fixed watermark). A preemption raises the ratio."""
    for reserve, admitted in ((True, False), (False, True)):
        s = Scheduler(16, 4, max_num_seqs=4, max_num_batched_tokens=100, watermark=0, reserve_growth=reserve)
        first = make_seq(list(range(8)))
        first.request.params.max_tokens = 64
        s.add(first)
        step(s)
        s.add(make_seq(list(range(100, 124))))  # 6 blocks: fits in the 13 free, not beside a reserve of 7 + 1
        out = s.schedule()
        assert (len(out.seqs) == 2) is admitted
    ratio = s.growth_ratio
    s.running[-1].token_ids += [7] * 40  # grow past what is free: the newest is preempted
    s.running[-1].num_computed_tokens = s.running[-1].num_tokens - 1
    s.schedule()
    assert s.num_preemptions == 1 and s.growth_ratio > ratio
