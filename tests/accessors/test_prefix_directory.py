"""Prefix-aware placement's pure parts: the engine's prefix hash chain (one definition, the
same in every process) and the placement of rows on engines (hypothesis properties)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dfllm.accessors.prefix_directory import PlacementSettings, PrefixDirectory
from dfllm.engine.block_manager import BlockManager
from dfllm.engine.prefix_hash import chain_root, prefix_block_hashes
from dfllm.tasks.prefix_keys import RowKeys, row_keys, sampled_depths

from helpers import make_seq

ENGINES = ["tcp://a:1", "tcp://b:2", "tcp://c:3", "tcp://d:4"]


# ---- the hash chain -----------------------------------------------------------------------------
def test_block_manager_keys_its_cache_with_the_public_chain():
    bm = BlockManager(32, 4)
    tokens = list(range(3, 30))
    seq = make_seq(tokens)
    assert bm.prompt_block_hashes(seq) == prefix_block_hashes(tokens, 4)
    # extending a known chain gives the rest of the same chain
    full = prefix_block_hashes(tokens, 4)
    assert prefix_block_hashes(tokens, 4, start=2, parent=full[1]) == full[2:]
    # another adapter (or the base model) never shares a block
    assert prefix_block_hashes(tokens, 4, lora_int_id=7)[0] != full[0]
    # no two adapters share a chain (Python hashes -1 and -2 alike: roots must not collide so)
    firsts = {prefix_block_hashes(tokens, 4, lora_int_id=i)[0] for i in [None, *range(1, 200)]}
    assert len(firsts) == 200
    assert len({chain_root(i) for i in [None, *range(1, 200)]}) == 200


@pytest.mark.slow
def test_the_chain_is_the_same_in_every_process():
    """Workers key rows in their own processes: the chain must not depend on hash salts."""
    code = (
        "from dfllm.engine.prefix_hash import prefix_block_hashes as h;"
        "print(h(list(range(40)), 16), h(list(range(40)), 16, lora_int_id=3))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "random")
    }
    assert len(outs) == 1


def test_row_keys_sample_the_chain():
    assert sampled_depths(0) == [] and sampled_depths(1) == [1] and sampled_depths(9) == [1, 2, 4, 8, 9]
    r = row_keys(list(range(100)), 16, 8)
    assert [t for _, t in r.keys] == [16, 32, 64, 96, 100] and r.prompt_tokens == 100 and r.work == 108
    assert r.keys[-2][0] == prefix_block_hashes(list(range(100)), 16)[5]
    # the whole prompt's key: equal prompts only, whatever their length against the block size
    for n in (1, 15, 16, 17, 32, 33):
        keys = {row_keys(list(range(n)), 16, 8).keys[-1][0], row_keys(list(range(n)), 16, 1).keys[-1][0]}
        assert len(keys) == 1
        assert row_keys([*range(n - 1), 7], 16, 8).keys[-1][0] not in keys or n == 8
        assert row_keys(list(range(n)), 16, 8, lora_int_id=2).keys[-1][0] not in keys
    assert row_keys(list(range(16)), 16, 8).keys[-1][0] not in prefix_block_hashes(list(range(17)), 16)


# ---- placement ----------------------------------------------------------------------------------
def _row(group: int, tokens: int = 100, work: int = 120) -> RowKeys:
    return RowKeys(((hash(("group", group)), tokens),), tokens, work)


def _place(partitions, engines, balance=0.2):
    d = PrefixDirectory(len(partitions), PlacementSettings(balance=balance, min_share=0.5))
    d.sync(engines)
    return d, [d.place(p) for p in partitions]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.one_of(st.none(), st.integers(0, 12)), min_size=0, max_size=25), min_size=1, max_size=8),
    st.integers(1, 4),
)
def test_every_row_is_placed_once_on_an_engine(partitions, n):
    rows = [[None if g is None else _row(g) for g in p] for p in partitions]
    d, placements = _place(rows, ENGINES[:n])
    for p, placement in zip(rows, placements):
        assert len(placement.engines) == len(p)
        assert set(placement.engines) <= set(ENGINES[:n])
    # each row costs its engine at most its work, and a group's prefix is computed once per engine
    full = sum(1 if r is None else r.work for p in rows for r in p)
    groups = {g for p in partitions for g in p if g is not None}
    assert sum(d.loads.values()) <= full
    assert sum(d.loads.values()) >= full - 100 * (sum(g is not None for p in partitions for g in p) - len(groups))
    # the directory is plain data: it travels as JSON and places on from there the same
    again = PrefixDirectory.from_json(d.to_json(), d.npartitions, d.settings)
    assert again.to_json() == d.to_json()
    probe = [_row(g) for g in range(14)]
    assert again.place(probe) == d.place(probe)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(1, 8), st.integers(2, 4), st.randoms(use_true_random=False))
def test_rows_without_shared_prefixes_are_spread_evenly(nrows, nparts, n, rnd):
    rows = [RowKeys(((i, 64),), 64 + rnd.randrange(200), 80 + rnd.randrange(300)) for i in range(nrows)]
    parts = [rows[i::nparts] for i in range(nparts)]
    d, _ = _place(parts, ENGINES[:n])
    largest = max(r.work for r in rows)
    assert max(d.loads.values()) - min(d.loads.values()) <= largest


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 15), min_size=1, max_size=30),
    st.integers(1, 6),
    st.integers(2, 4),
    st.sampled_from([0.0, 0.2, 0.5]),
    st.randoms(use_true_random=False),
)
def test_groups_stay_whole_unless_split_and_work_stays_within_the_bound(groups, nparts, n, balance, rnd):
    """Partitions of equal work (so the job's mean is estimated exactly): every engine's work
    is within (1 + balance) of the mean plus one row, and a group's rows are on one engine
    but for the rows the placement reports as split."""
    parts = [[_row(g) for g in rnd.sample(groups, len(groups))] for _ in range(nparts)]
    d, placements = _place(parts, ENGINES[:n], balance)
    mean = sum(d.loads.values()) / n
    assert max(d.loads.values()) <= (1 + balance) * mean + 120 + 1e-6
    assert d.bound(120) >= max(d.loads.values())
    where: dict[int, set] = {}
    for p, placement in zip(parts, placements):
        for r, e in zip(p, placement.engines):
            where.setdefault(r.keys[0][0], set()).add(e)
    extra = sum(len(es) - 1 for es in where.values())
    assert extra <= d.split == sum(p.split for p in placements)


def test_a_dominant_group_is_split_and_said_so():
    parts = [[_row(0)] * 20 for _ in range(4)]
    d, placements = _place(parts, ENGINES[:2])
    assert d.split > 0 and sum(p.split for p in placements) == d.split
    loads = list(d.loads.values())
    assert max(loads) <= 1.2 * sum(loads) / 2 + 120


def test_documents_asked_in_question_order_stay_on_one_engine():
    """24 documents x 4 questions, in question order, 8 partitions, 2 engines: each
    document's rows on one engine, its prefix computed once, the engines' work equal."""
    rows = [_row(doc) for q in range(4) for doc in range(24)]
    parts = [rows[i * 12 : (i + 1) * 12] for i in range(8)]
    d, placements = _place(parts, ENGINES[:2])
    where: dict[int, set] = {}
    for p, placement in zip(parts, placements):
        for r, e in zip(p, placement.engines):
            where.setdefault(r.keys[0][0], set()).add(e)
    assert all(len(es) == 1 for es in where.values()) and d.split == 0
    assert len(set(d.loads.values())) == 1
    assert sum(d.loads.values()) == 24 * 120 + 3 * 24 * 20  # each prefix once, then 20 tokens a row


def test_rows_with_one_prompt_meet_on_one_engine():
    """Identical prompts (shorter than a block: no shared block at all) go to one engine,
    which computes them once; a row of another prompt goes where the work is least."""
    same = row_keys([5, 6, 7], 16, 4, dedupe=1234)
    other = row_keys([8, 9], 16, 4, dedupe=5678)
    d, (placement,) = _place([[same, other, same, same]], ENGINES[:2])
    engines = placement.engines
    assert engines[0] == engines[2] == engines[3] != engines[1] and placement.split == 0
    assert d.loads[engines[0]] == 7 + 1 + 1  # computed once: the others cost a token each
    # without a dedupe digest (sampled rows), an equal prompt is spared its prompt only
    sampled = row_keys([5, 6, 7], 16, 4)
    d, (placement,) = _place([[sampled, sampled]], ENGINES[:2], balance=1.0)
    assert len(set(placement.engines)) == 1 and sum(d.loads.values()) == 7 + 4


def test_a_group_too_large_for_one_engine_is_cached_on_two():
    """One document asked 40 questions, 2 engines: the group is split once, to the second
    engine, which from then on holds the prefix too (its rows cost their questions only)."""
    rows = [RowKeys(((hash("doc"), 96), (hash(("q", i)), 100)), 100, 110) for i in range(40)]
    d, (placement,) = _place([rows], ENGINES[:2], balance=0.2)
    assert placement.split == 1 and set(placement.engines) == set(ENGINES[:2])
    assert sum(d.loads.values()) == 2 * 110 + 38 * 14
    assert max(d.loads.values()) <= d.bound(110)


def test_engines_that_join_or_leave():
    d = PrefixDirectory(2, PlacementSettings(balance=1.0))  # loose: only the engines decide here
    d.sync(ENGINES[:2])
    first = d.place([_row(g) for g in range(4)])
    d.sync(ENGINES[1:3])  # the first engine left, a third joined
    second = d.place([_row(g) for g in range(4)])
    assert set(second.engines) <= set(ENGINES[1:3])
    kept = [g for g in range(4) if first.engines[g] == ENGINES[1]]
    assert all(second.engines[g] == ENGINES[1] for g in kept)


# ---- the switch ---------------------------------------------------------------------------------
def test_the_switch_is_dask_config_and_a_cli_flag():
    import dask

    from dfllm.accessors.prefix_placement import placement_settings
    from dfllm.jobs.cli import build_parser

    assert placement_settings().enabled and placement_settings().balance == 0.2
    with dask.config.set({"dfllm.prefix-placement": False, "dfllm.prefix-placement-balance": 0.1}):
        assert not placement_settings().enabled and placement_settings().balance == 0.1
    with dask.config.set({"dfllm.prefix-placement": "false"}):  # as DASK_DFLLM__PREFIX_PLACEMENT=false reads
        assert not placement_settings().enabled
    args = build_parser().parse_args(["run", "in.parquet", "out/", "--no-prefix-placement"])
    assert args.no_prefix_placement
    assert not build_parser().parse_args(["run", "in.parquet", "out/"]).no_prefix_placement


def test_a_worker_routes_no_more_than_a_batch_of_rows_at_once():
    """Routed partitions leave their threads while they wait: a worker routes them while
    their rows are fewer than the engine's batch (one partition at least), and runs the
    others where they are, so it holds no more partitions than without placement."""
    from dfllm.accessors.prefix_placement import _routing_slot

    with _routing_slot(300, 256) as first:  # one partition always, even above the batch
        assert first
        with _routing_slot(1, 256) as second:
            assert not second
    with _routing_slot(100, 256) as a, _routing_slot(100, 256) as b, _routing_slot(100, 256) as c:
        assert a and b and not c
    with _routing_slot(256, 256) as again:  # every slot given back
        assert again
