"""The block manager's array of block tables (dfllm.engine.block_tables) mirrors every
sequence's block table exactly, through allocation, prefix-cache hits, decodes, preemption,
sliding-window releases, finishing and aborting; a decode step's tables gathered from it are
the ones built from the lists; and a decode step's inputs do read it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dfllm import LLM, SamplingParams
from dfllm.engine.block_tables import BlockTableArray
from dfllm.engine.scheduler import Scheduler
from dfllm.engine.sequence import Sequence
from dfllm.engine.step_inputs import decode_arrays, prepare_inputs

from helpers import build_tiny_model, make_seq, random_prompts


def assert_mirrors(tables: BlockTableArray, seqs: list[Sequence]) -> None:
    """Every sequence's row holds its table and nothing else; every other row is empty."""
    owned = set()
    for seq in seqs:
        assert (seq.table_row >= 0) == bool(seq.block_table), seq.block_table
        assert tables.table(seq) == seq.block_table
        if seq.table_row >= 0:
            assert seq.table_row not in owned  # one sequence a row
            owned.add(seq.table_row)
            assert (tables.array[seq.table_row, len(seq.block_table) :] == -1).all()
            last = seq.block_table[-1]  # the twin padded with the last block instead
            own = seq.block_table + [last] * (tables.own.shape[1] - len(seq.block_table))
            assert tables.own[seq.table_row].tolist() == own
    for row in range(tables.array.shape[0]):
        if row not in owned:
            assert tables.lengths[row] == 0 and (tables.array[row] == -1).all(), row


def _advance(s: Scheduler, out, longest: int = 10**9) -> None:
    """Pretend the model ran: the step's tokens computed, a token sampled where due; a sequence
    that reaches ``longest`` tokens ends."""
    s.update_from_step(out)
    for seq in out.seqs:
        if seq.num_computed_tokens == seq.num_tokens and not seq.is_finished:
            seq.token_ids.append(7 + seq.num_tokens % 5)
            if seq.num_tokens >= longest:
                s.finish(seq)


@settings(max_examples=60, deadline=None)
@given(
    st.data(),
    st.sampled_from([None, 6, 11]),  # sliding window (blocks released as they fall out of it)
    st.booleans(),  # prefix caching
    st.integers(2, 4),  # block size
    st.integers(16, 40),  # blocks: few enough to preempt, enough for the longest sequence
)
def test_the_array_mirrors_every_table_through_a_schedule(data, window, caching, bs, num_blocks):
    s = Scheduler(
        num_blocks,
        bs,
        max_num_seqs=6,
        max_num_batched_tokens=16,
        enable_prefix_caching=caching,
        sliding_window=window,
    )
    shared = [1, 2, 3, 4, 5, 6, 7, 8]  # prompts that share prefixes hit the prefix cache
    seqs: list[Sequence] = []
    for _ in range(data.draw(st.integers(20, 60), label="steps")):
        if data.draw(st.integers(0, 3)) == 0 and len(seqs) < 12:
            cut = data.draw(st.integers(0, len(shared)))
            tail = data.draw(st.lists(st.integers(10, 50), min_size=1, max_size=9))
            seq = make_seq(shared[:cut] + tail)
            seq.request.params.max_tokens = 1000
            seqs.append(seq)
            s.add(seq)
        if not s.has_unfinished():
            continue
        out = s.schedule()
        assert out.tables is s.bm.tables
        ones = [seq for seq, n in zip(out.seqs, out.num_new_tokens) if n == 1]
        # read now as a whole, gathered for a decode step, or not read: the appends then stay
        # unwritten through the releases and window moves below
        read = data.draw(st.sampled_from(["mirror", "gather", "none"]), label="read after scheduling")
        if read == "mirror":
            assert_mirrors(s.bm.tables, seqs)
        if read == "gather" and ones:  # a decode step's tables, gathered or from the lists
            gathered, from_lists = decode_arrays(ones, bs, out.tables), decode_arrays(ones, bs)
            assert np.array_equal(gathered.tables, from_lists.tables)
            assert np.array_equal(gathered.table_lens, from_lists.table_lens)
            assert gathered.own is not None and from_lists.own is None
            assert np.array_equal(gathered.own_tables(), from_lists.own_tables())
        _advance(s, out, longest=24)
        if read != "none":
            assert_mirrors(s.bm.tables, seqs)
        running = list(s.running)
        if running and data.draw(st.integers(0, 4)) == 0:
            s.finish(data.draw(st.sampled_from(running)))
        if seqs and data.draw(st.integers(0, 9)) == 0:
            s.abort([data.draw(st.sampled_from(seqs))])
        assert_mirrors(s.bm.tables, seqs)
    s.abort_all()
    assert_mirrors(s.bm.tables, seqs)
    assert all(seq.table_row == -1 for seq in seqs)


def test_rows_and_columns_grow_and_rows_are_reused():
    tables = BlockTableArray(rows=2, width=2)
    seqs = [make_seq([1, 2, 3]) for _ in range(5)]
    for i, seq in enumerate(seqs):
        for b in range(i + 3):  # longer than the first width
            seq.block_table.append(10 * i + b)
            tables.append(seq, 10 * i + b)
    assert_mirrors(tables, seqs)
    tables.release(seqs[1])
    seqs[1].block_table = []
    fresh = make_seq([4])
    fresh.block_table.append(99)
    tables.append(fresh, 99)
    assert fresh.table_row == 1  # the freed row, cleared
    assert_mirrors(tables, seqs + [fresh])
    padded, own, lens = tables.gather([seqs[4], fresh, seqs[0]])
    assert lens.tolist() == [7, 1, 3]
    assert padded.tolist() == [
        [40, 41, 42, 43, 44, 45, 46],
        [99, -1, -1, -1, -1, -1, -1],
        [0, 1, 2, -1, -1, -1, -1],
    ]
    assert own.tolist() == [
        [40, 41, 42, 43, 44, 45, 46],
        [99, 99, 99, 99, 99, 99, 99],
        [0, 1, 2, 2, 2, 2, 2],
    ]


def test_a_decode_step_reads_its_tables_from_the_array():
    """The whole-batch decode inputs take the array's rows, not the lists: a row changed behind
    the lists' back shows up in the step's block tables and cache slots."""
    bs = 4
    s = Scheduler(256, bs, max_num_seqs=32, max_num_batched_tokens=256)
    seqs = [make_seq(list(range(10 * i, 10 * i + 5 + i % 3))) for i in range(20)]
    for seq in seqs:
        s.add(seq)
    _advance(s, s.schedule())  # the prompts
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens - 1
    out = s.schedule()
    assert out.num_new_tokens == [1] * len(seqs)
    cpu = torch.device("cpu")
    before = prepare_inputs(out, bs, cpu)
    victim = seqs[3]
    s.bm.tables.array[victim.table_row, 0] = 250  # not what its list says
    after = prepare_inputs(out, bs, cpu)
    assert after.meta.block_tables[3, 0] == 250 != before.meta.block_tables[3, 0]
    assert torch.equal(after.meta.block_tables[:3], before.meta.block_tables[:3])


@pytest.mark.parametrize(("window", "async_scheduling"), [(None, False), (None, True), (8, False)])
def test_engine_steps_keep_the_mirror(tmp_path, smollm2_dir, window, async_scheduling):
    """A real engine under preemption (more sequences than the cache holds), prefix hits,
    asynchronous steps and (Mistral) a sliding window: after every step every sequence's row
    equals its list."""
    arch = dict(arch="mistral", sliding_window=window) if window else {}
    path = build_tiny_model(tmp_path, smollm2_dir, **arch)
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        block_size=16,
        kv_cache_memory_bytes=24 * 16 * 512,  # 24 blocks (512 bytes a token)
        async_scheduling=async_scheduling,
    )
    engine = llm.llm_engine
    shared = random_prompts(1, 40, 40, seed=1)[0]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i, tail in enumerate(random_prompts(12, 3, 9, seed=2)):
        engine.add_request(str(i), engine.input_processor.process({"prompt_token_ids": shared + tail}, params))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        sched = engine.scheduler
        assert_mirrors(sched.bm.tables, list(sched.running) + list(sched.waiting))
    assert len(outputs) == 12 and engine.stats().prefix_cache_hits > 0
    if window is None:
        assert engine.stats().num_preemptions > 0
