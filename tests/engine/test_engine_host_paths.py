"""The engine's per-step host fast paths decide and record exactly what the general ones do:
batched token metrics, the plain stop check, the decode schedule without block work, the
skipped penalties, the 16-byte block zeroing and the whole-batch decode inputs."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dfllm.engine import step_inputs
from dfllm.engine.block_manager import FREED, block_hash, chain_root
from dfllm.engine.host_pack import HostPack
from dfllm.engine.logit_penalties import apply_penalties
from dfllm.engine.metrics import EngineMetrics, snapshot
from dfllm.engine.output_processor import OutputProcessor
from dfllm.engine.sampler import SampledToken, StepTokens
from dfllm.engine.scheduler import Scheduler, SchedulerOutput
from dfllm.engine.sequence import Request, Sequence
from dfllm.outputs import RequestMetrics
from dfllm.sampling_params import SamplingParams

from helpers import make_seq


def test_observe_tokens_records_what_one_observation_per_token_does():
    rng = random.Random(0)
    bounds = [0.001, 0.005, 0.1, 600.0]
    per_token, batched = EngineMetrics("m"), EngineMetrics("m")
    for _ in range(20):  # steps: many tokens sharing a value, bucket bounds, outliers, negatives
        shared = rng.random() * 0.05
        firsts = [(rng.randrange(1, 50), rng.choice([shared, rng.random(), rng.choice(bounds)])) for _ in range(3)]
        others = [rng.choice([shared, shared, rng.choice(bounds), -0.001, 1e4, rng.random() / 7]) for _ in range(40)]
        for plen, s in firsts:
            per_token.observe_token(True, plen, s)
        for s in others:
            per_token.observe_token(False, 0, s)
        batched.observe_tokens(sum(p for p, _ in firsts), [s for _, s in firsts], others)
    batched.observe_tokens(0, [], [])  # a step without tokens records nothing
    assert snapshot(per_token.registry) == snapshot(batched.registry)  # sums equal to the last bit: the same additions
    tpot = next(x for x in snapshot(batched.registry) if x.name == "dfllm_time_per_output_token_seconds")
    assert tpot.count == 20 * 40 and math.isfinite(tpot.sum)


def _plain_seq(params: SamplingParams, prompt: list[int], out: list[int]) -> Sequence:
    req = Request("r", None, prompt, params, RequestMetrics(0.0))
    seq = Sequence(req, 0, prompt + out, len(prompt))
    req.seqs.append(seq)
    return seq


@pytest.mark.parametrize(
    "kw",
    [
        dict(detokenize=False),
        dict(detokenize=False, ignore_eos=True),
        dict(detokenize=False, min_tokens=2),
        dict(detokenize=False, min_tokens=3, max_tokens=3),
        dict(detokenize=False, max_tokens=None),
        dict(detokenize=False, stop_token_ids=[5]),  # the general path, for comparison
        dict(detokenize=False, stop_token_ids=[[5, 2]], min_tokens=1),
    ],
)
def test_plain_stop_path_decides_as_check_stop(kw):
    params = SamplingParams(**kw)
    eos, max_len = {2}, 9
    for tokens in ([2], [1, 2], [5, 2], [1, 1, 1], [1, 5, 1, 2], [1, 1, 1, 1, 1, 1, 1]):
        fast = _plain_seq(params, [9, 9, 9], [])
        slow = _plain_seq(params, [9, 9, 9], [])
        proc = OutputProcessor(None, eos, max_len, EngineMetrics("m"))
        for i, t in enumerate(tokens):
            if fast.finish_reason is not None:
                break
            proc.process([fast], StepTokens.of([SampledToken(t)]), float(i + 1))
            slow.token_ids.append(t)
            expected = proc._check_stop(slow, t)
            assert (fast.finish_reason, fast.stop_reason) == expected, (kw, tokens, i)
            assert fast.stop_offset == slow.stop_offset and fast.text == slow.text
        assert fast.token_ids == slow.token_ids[: len(fast.token_ids)]


def test_process_records_each_token_once_and_errors_end_rows():
    metrics = EngineMetrics("m")
    proc = OutputProcessor(None, {2}, 100, metrics)
    params = SamplingParams(detokenize=False, max_tokens=3)
    a, b = _plain_seq(params, [1, 1], []), _plain_seq(params, [1, 1, 1], [])
    assert proc.process([a, b], StepTokens.of([SampledToken(4), "NaN"]), 1.0) == [b]
    assert b.finish_reason == "error" and "NaN" in (b.error or "")
    assert proc.process([a], StepTokens([4]), 1.5) == []
    assert proc.process([a], StepTokens([4]), 2.5) == [a] and a.finish_reason == "length"
    values = {x.name: x for x in snapshot(metrics.registry)}
    assert values["dfllm_generation_tokens"].value == 3
    assert values["dfllm_prompt_tokens"].value == 2
    assert values["dfllm_time_to_first_token_seconds"].count == 1
    assert values["dfllm_time_per_output_token_seconds"].count == 2
    assert values["dfllm_time_per_output_token_seconds"].sum == 0.5 + 1.0


def test_decodes_take_blocks_and_hash_them_exactly_when_a_block_fills():
    bs = 4
    s = Scheduler(64, bs, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [make_seq(list(range(10 * i, 10 * i + 5 + i))) for i in range(3)]
    for seq in seqs:
        s.add(seq)
    for _ in range(12):
        out = s.schedule()
        for seq, n in zip(out.seqs, out.num_new_tokens):
            assert len(seq.block_table) == -(-(seq.num_computed_tokens + n) // bs)  # just enough blocks
        s.update_from_step(out)
        for seq in out.seqs:
            full = seq.num_computed_tokens // bs
            assert seq.num_hashed_blocks == full
            parent = chain_root(seq)
            for i in range(full):  # every full block keyed by its chained hash
                block = s.bm.blocks[seq.block_table[i]]
                assert block.hash == block_hash(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
                assert s.bm.hash_to_block[block.hash] == block.block_id
                parent = block.hash
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
    assert s.stats().num_preemptions == 0


def test_penalties_skip_rows_without_edits_and_apply_with_one():
    plain = SamplingParams()
    seqs = [make_seq([1, 2, 3]) for _ in range(4)]
    logits = torch.randn(4, 10)
    before = logits.clone()
    apply_penalties(logits, seqs, {0})
    assert torch.equal(logits, before)
    for kw in (
        dict(logit_bias={3: 5.0}),
        dict(repetition_penalty=1.5),
        dict(presence_penalty=0.5),
        dict(min_tokens=2),
        dict(allowed_token_ids=[1]),
    ):
        edited = [make_seq([1, 2, 3]) for _ in range(4)]
        edited[2].request.params = SamplingParams(**kw)
        for s in edited:
            s.request.params = plain if s is not edited[2] else s.request.params
            s.token_ids.append(4)
        x = before.clone()
        apply_penalties(x, edited, {0})
        assert torch.equal(x[[0, 1, 3]], before[[0, 1, 3]]) and not torch.equal(x[2], before[2]), kw
    bad = [make_seq([1, 2, 3]) for _ in range(2)]
    bad[1].request.bad_words_ids = ((6,),)
    x = before[:2].clone()
    apply_penalties(x, bad, {0})
    assert x[1, 6] == float("-inf") and torch.equal(x[0], before[0])


def _inputs_tensors(inputs) -> dict[str, torch.Tensor]:
    m = inputs.meta
    out = {f: getattr(inputs, f) for f in ("input_ids", "positions", "logit_rows")}
    out |= {f: getattr(m, f) for f in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")}
    if m.decodes is not None:
        out |= {f"decodes.{f}": getattr(m.decodes, f) for f in ("rows", "block_tables", "seq_lens")}
    for i, g in enumerate(m.decode_groups):
        out |= {f"group{i}.{f}": getattr(g, f) for f in ("rows", "block_tables", "mask")}
    return out


@st.composite
def _one_token_steps(draw):
    """Sequences each computing one token: decodes, one-token prompt chunks (which do not
    sample), sliding-window tables with released leading blocks, finished prompt log-probabilities
    (the shape drawn by hypothesis, the token and block ids from a drawn seed)."""
    bs = draw(st.sampled_from([1, 4, 16]))
    rng = random.Random(draw(st.integers(0, 2**32)))
    seqs = []
    for _ in range(draw(st.integers(1, 40))):
        prompt = draw(st.integers(1, 70))
        total = prompt + draw(st.integers(0, 40))
        seq = make_seq(list(range(prompt)))
        seq.token_ids = [rng.randrange(512) for _ in range(total)]
        seq.num_computed_tokens = max(0, total - draw(st.sampled_from([1, 1, 1, 2, 5])))
        seq.block_table = rng.sample(range(4096), -(-(seq.num_computed_tokens + 1) // bs))
        released = draw(st.integers(0, len(seq.block_table) - 1))
        seq.block_table[:released] = [FREED] * released
        if draw(st.booleans()):  # prompt log-probabilities, all computed
            seq.prompt_logprobs = [None] * prompt
        seqs.append(seq)
    return SchedulerOutput(seqs, [1] * len(seqs)), bs


@settings(max_examples=60, deadline=None)
@given(_one_token_steps())
def test_whole_batch_decode_inputs_equal_the_loops(step):
    """prepare_inputs builds a step of one-token sequences with whole-batch array operations
    from WHOLE_BATCH_DECODES sequences on: the same tensors (values, dtypes, shapes) as its
    per-sequence loop, and the same sampling rows."""
    sched, bs = step
    cpu = torch.device("cpu")
    fast = step_inputs._prepare_decodes(sched.seqs, bs, cpu)
    loop_at = step_inputs.WHOLE_BATCH_DECODES
    try:
        step_inputs.WHOLE_BATCH_DECODES = len(sched.seqs) + 1
        loop = step_inputs.prepare_inputs(sched, bs, cpu)
    finally:
        step_inputs.WHOLE_BATCH_DECODES = loop_at
    a, b = _inputs_tensors(fast), _inputs_tensors(loop)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert fast.sample_seqs == loop.sample_seqs and fast.prompt_spans == loop.prompt_spans == []
    # the runner skips the logit rows' gather exactly when they are every row, in order
    assert fast.every_row == (fast.logit_rows.tolist() == list(range(len(sched.seqs))))
    assert (fast.meta.max_query_len, fast.meta.max_seq_len) == (loop.meta.max_query_len, loop.meta.max_seq_len)
    assert fast.meta.prefills == loop.meta.prefills == []
    width = max(len(s.block_table) for s in sched.seqs)  # each table padded with its own last block
    own = [s.block_table + s.block_table[-1:] * (width - len(s.block_table)) for s in sched.seqs]
    assert fast.meta.decodes is not None and fast.meta.decodes.block_tables.tolist() == own


def test_prepare_inputs_takes_the_whole_batch_path_only_for_plain_one_token_steps():
    """From WHOLE_BATCH_DECODES one-token sequences on; a sequence still scoring prompt tokens
    (its position gives a prompt logit row) or running a LoRA adapter takes the loop."""
    cpu, n = torch.device("cpu"), step_inputs.WHOLE_BATCH_DECODES
    seqs = [make_seq([1, 2, 3, 4]) for _ in range(n)]
    for s in seqs:
        s.num_computed_tokens, s.block_table = 3, [7]
    assert step_inputs.whole_batch(seqs)
    inputs = step_inputs.prepare_inputs(SchedulerOutput(seqs, [1] * n), 16, cpu)
    assert inputs.logit_rows.tolist() == list(range(n))
    # a one-token prompt chunk whose prompt log-probabilities are asked for: its position scores the next token
    seqs[3].num_computed_tokens, seqs[3].prompt_logprobs = 2, [None, {}]
    assert not step_inputs.whole_batch(seqs)
    inputs = step_inputs.prepare_inputs(SchedulerOutput(seqs, [1] * n), 16, cpu)
    assert inputs.logit_rows.tolist() == [i for i in range(n) if i != 3] + [3]
    assert [(s.seq, s.start, s.count) for s in inputs.prompt_spans] == [(seqs[3], 2, 1)]
    seqs[3].prompt_logprobs = None
    assert step_inputs.whole_batch(seqs)
    seqs[5].request.lora_request = object()  # only its presence matters to the choice of path
    assert not step_inputs.whole_batch(seqs)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_host_pack_sends_every_array_in_order(device):
    """Lists, tensors and NumPy arrays of either dtype, empty ones too: each comes back as added."""
    rng = random.Random(1)
    pack = HostPack()
    arrays = []
    for i in range(9):
        dtype = rng.choice([torch.long, torch.int32])
        values = [rng.randrange(-(2**31), 2**31) for _ in range(rng.randrange(0, 12))]
        kind = rng.randrange(3)
        given_ = values if kind == 0 else torch.tensor(values, dtype=torch.long) if kind == 1 else np.array(values)
        shape = (len(values),) if len(values) % 2 or not values else (2, len(values) // 2)
        assert pack.add(given_, dtype, shape) == i
        arrays.append(torch.tensor(values, dtype=dtype).view(shape))
    sent = pack.send(torch.device(device))
    for got, want in zip(sent, arrays, strict=True):
        assert got.device.type == device and got.dtype == want.dtype and torch.equal(got.cpu(), want)


_row = st.one_of(
    st.builds(SampledToken, st.integers(0, 500)),  # a token without log-probabilities
    st.builds(SampledToken, st.integers(0, 500), st.floats(-30, 0), st.just([(1, -0.5, 1)])),
    st.sampled_from(["NaN", "+inf", "no finite value"]),  # a row whose logits could not be sampled
)


@settings(max_examples=80, deadline=None)
@given(st.lists(_row, max_size=12), st.data())
def test_step_tokens_keep_every_row_through_select(rows, data):
    """A step's tokens held as ids with objects only where needed give every row back as it
    was, and a selection of rows (the async step's rows not aborted meanwhile) those rows."""
    step = StepTokens.of(rows)
    assert len(step) == len(rows) and step.rows() == rows
    special = {i for i, r in enumerate(rows) if isinstance(r, str) or r.logprob is not None}
    assert set(step.logprobs) | set(step.errors) == special
    keep = sorted(data.draw(st.sets(st.integers(0, max(0, len(rows) - 1)))) & set(range(len(rows))))
    assert step.select(keep).rows() == [rows[i] for i in keep]
