"""Block manager: allocation, reference counts, prefix-cache hits and LRU eviction."""

from __future__ import annotations

from dfllm.engine.block_manager import BlockManager
from dfllm.engine.sequence import Sequence

from helpers import make_seq


def admit(bm: BlockManager, seq: Sequence) -> int:
    hits = bm.match_prefix(seq)
    bm.take_prefix(seq, hits)
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return len(hits)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, 4)
    seq = make_seq(list(range(10)))
    bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.blocks_needed(seq, 12) == 0 and bm.blocks_needed(seq, 13) == 1
    bm.free_seq(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_shared_prefix_is_reference_counted():
    bm = BlockManager(16, 4)
    a = make_seq(list(range(13)))
    assert admit(bm, a) == 0
    b = make_seq(list(range(12)) + [99, 98])
    assert admit(bm, b) == 3
    assert b.block_table[:3] == a.block_table[:3]
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:3])
    bm.free_seq(a)
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table[:3])
    assert bm.prefix_hits == 12


def test_hit_leaves_last_token_to_compute():
    bm = BlockManager(16, 4)
    admit(bm, make_seq(list(range(8))))
    again = make_seq(list(range(8)))
    assert len(bm.match_prefix(again)) == 1  # 8 tokens: only the first block may hit


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(4, 4)
    a = make_seq(list(range(8)))
    admit(bm, a)
    bm.free_seq(a)
    assert bm.num_free_blocks == 4
    # still revivable
    assert len(bm.match_prefix(make_seq(list(range(8)) + [7]))) == 2
    # a fresh sequence takes the two never-used blocks first, then evicts a's last block
    c = make_seq([50] * 12)
    bm.allocate(c, 12)
    assert len(bm.match_prefix(make_seq(list(range(8)) + [7]))) == 1


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    admit(bm, make_seq(list(range(9))))
    assert bm.match_prefix(make_seq(list(range(9)))) == []


def test_reset_prefix_cache_forgets_hashes():
    bm = BlockManager(8, 4)
    a = make_seq(list(range(9)))
    admit(bm, a)
    bm.free_seq(a)
    bm.reset_prefix_cache()
    assert bm.match_prefix(make_seq(list(range(9)))) == []


def test_reset_under_a_running_sequence_never_rekeys_its_later_blocks():
    bm = BlockManager(16, 4)
    a = make_seq(list(range(8)))
    admit(bm, a)
    bm.reset_prefix_cache()
    a.token_ids += [8, 9, 10, 11]
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    # block 2 of a must not be registered as if it started a sequence
    assert bm.match_prefix(make_seq([8, 9, 10, 11, 0])) == []


def test_reuse_first_keeps_the_touched_set_small():
    """On CPU, freed blocks are reused before never-touched ones (memory stays at the working set)."""
    bm = BlockManager(16, 4, reuse_first=True)
    for _ in range(5):
        seq = make_seq(list(range(100, 108)))  # 2 blocks, hashed then freed
        admit(bm, seq)
        bm.free_seq(seq)
        other = make_seq([7] * 8)
        bm.allocate(other, 8)
        bm.free_seq(other)
    assert bm.next_fresh <= 4 and bm.num_free_blocks == 16
    fresh_first = BlockManager(16, 4)
    for _ in range(5):
        other = make_seq([7] * 8)
        admit(fresh_first, other)
        fresh_first.free_seq(other)
        fresh_first.allocate(make_seq([9] * 8), 8)
    assert fresh_first.next_fresh > 4


def test_reuse_first_keeps_cached_prefixes_while_untouched_blocks_remain():
    """On CPU a cached prefix is evicted only once no block is left untouched: rows of one
    document that arrive later, after unrelated rows, still hit it (then least recently
    freed first)."""
    bm = BlockManager(16, 4, reuse_first=True)
    doc = list(range(100, 112))  # 3 full blocks
    first = make_seq(doc + [1])
    admit(bm, first)
    bm.free_seq(first)
    for k in range(3):  # unrelated rows, 3 blocks each, cached in turn
        other = make_seq([50 + k] * 12 + [2])
        admit(bm, other)
        bm.free_seq(other)
    assert bm.next_fresh == 13  # 4 x 3 cached blocks, and one last block reused by each row
    late = make_seq([90] * 12 + [4])
    admit(bm, late)
    bm.free_seq(late)
    assert bm.next_fresh == 16  # every block touched now, none cached evicted yet
    assert len(bm.match_prefix(make_seq(doc + [3]))) == 3
    later = make_seq([91] * 12 + [4])  # one more: the least recently freed (the document's) go
    admit(bm, later)
    assert len(bm.match_prefix(make_seq(doc + [3]))) < 3
