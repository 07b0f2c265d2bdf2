"""The inputs of one step: the scheduled tokens flattened into one batch, and where their keys live."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from dfllm.engine.block_tables import BlockTableArray
from dfllm.engine.host_pack import HostPack
from dfllm.engine.scheduler import SchedulerOutput
from dfllm.engine.sequence import Sequence
from dfllm.kernels.lora import lora_metadata
from dfllm.kernels.metadata import AttentionMetadata, DecodeBatch, DecodeGroup, Deferred, PrefillSpan
from dfllm.multimodal.encoder import move_mm


@dataclass(frozen=True)
class PromptLogitSpan:
    """Consecutive prompt positions of one sequence whose logits give prompt log-probabilities:
    the logits at position ``start + i`` score prompt token ``start + i + 1``."""

    seq: Sequence
    start: int
    count: int


@dataclass
class StepInputs:
    """A step's (or micro-batch's) token ids, positions and attention metadata, and the rows
    of the batch whose logits are computed: first one per sampled sequence
    (``sample_seqs``), then the prompt positions of ``prompt_spans``, in order
    (``every_row``: they are all the batch's rows, in order, and need no gather)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor
    sample_seqs: list[Sequence]
    prompt_spans: list[PromptLogitSpan] = field(default_factory=list)
    # a vision-language model's extra forward arguments (dfllm.multimodal.encoder.step_mm_kwargs)
    mm: dict = field(default_factory=dict)
    every_row: bool = False


@dataclass
class StepOutput:
    """What a runner computed for one step: the logits (float32, on the model's device: the
    sampler works there) of the rows that sample, their sequences, and the logits of each
    prompt-log-probability span."""

    logits: torch.Tensor
    sample_seqs: list[Sequence]
    prompt_logits: list[tuple[PromptLogitSpan, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def split(cls, logits: torch.Tensor, inputs: list[StepInputs]) -> StepOutput:
        """Split the logits of the ``logit_rows`` of ``inputs`` (concatenated in order)."""
        if len(inputs) == 1 and not inputs[0].prompt_spans:  # one batch, no prompt log-probabilities:
            seqs = inputs[0].sample_seqs  # the logits are the sampled rows' (no per-step copy of the list)
            return cls(logits if len(logits) == len(seqs) else logits[: len(seqs)], seqs)
        sample: list[torch.Tensor] = []
        prompt: list[tuple[PromptLogitSpan, torch.Tensor]] = []
        at = 0
        for mb in inputs:
            sample.append(logits[at : at + len(mb.sample_seqs)])
            at += len(mb.sample_seqs)
            for span in mb.prompt_spans:
                prompt.append((span, logits[at : at + span.count]))
                at += span.count
        # one micro-batch (every step but a pipeline's): its rows are a view, not a copy
        sample_logits = torch.cat(sample) if len(sample) > 1 else sample[0] if sample else logits[:0]
        return cls(sample_logits, [s for mb in inputs for s in mb.sample_seqs], prompt)


def prepare_inputs(sched: SchedulerOutput, block_size: int, device: torch.device) -> StepInputs:
    """Flatten the step's tokens and describe where their keys live (tensors on ``device``,
    sent in one copy per dtype: :class:`~dfllm.engine.host_pack.HostPack`)."""
    seqs = sched.seqs
    if len(seqs) >= WHOLE_BATCH_DECODES and max(sched.num_new_tokens) == 1 and whole_batch(seqs):
        return _prepare_decodes(seqs, block_size, device, sched.prev_token_ids, sched.tables)
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    prefills: list[tuple[int, int, int, torch.Tensor | None]] = []  # q_start, q_len, ctx_len, host kv slots
    dec_rows: list[int] = []
    dec_seqs: list[Sequence] = []
    logit_rows: list[int] = []
    sample_seqs: list[Sequence] = []
    prompt_rows: list[int] = []
    prompt_spans: list[PromptLogitSpan] = []
    qsl = [0]
    scheduled = list(zip(sched.seqs, sched.num_new_tokens))
    lora = any(s.request.lora_request is not None for s in sched.seqs)
    if lora:  # LoRA: each adapter's rows together (one slice per adapter in every adapted layer)
        scheduled.sort(key=lambda sn: sn[0].request.lora_slot)
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    fill_rows: list[int] = []  # rows whose token is in sched.prev_token_ids, at fill_from
    fill_from: list[int] = []
    for seq, n in scheduled:
        start = seq.num_computed_tokens
        end, row = start + n, len(ids)
        table = seq.block_table
        token_ids = seq.token_ids
        if n == 1:
            if start < len(token_ids):
                ids.append(token_ids[start])
            else:  # its token is the step in flight's, still on the device (asynchronous scheduling)
                fill_rows.append(row)
                fill_from.append(seq.pending_row)
                ids.append(0)
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
            dec_rows.append(row)
            dec_seqs.append(seq)
        else:
            ids.extend(token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            prefills.append((row, n, end, None if start == 0 else _slots(table, end, bs)))
        if end == seq.num_tokens_with_pending:
            logit_rows.append(row + n - 1)
            sample_seqs.append(seq)
        if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
            # (needs_prompt_logprobs) positions p scoring prompt token p + 1, from the first not yet scored
            first = max(start, len(seq.prompt_logprobs) - 1)
            last = min(end, seq.num_prompt_tokens - 1)
            if last > first:
                prompt_rows.extend(range(row + first - start, row + last - start))
                prompt_spans.append(PromptLogitSpan(seq, first, last - first))
        qsl.append(len(ids))
        seq_lens.append(end)
        tables.append(table)
    pack = HostPack()
    tokens = pack.add(ids, torch.long), pack.add(positions, torch.long), pack.add(logit_rows + prompt_rows, torch.long)
    fill = (pack.add(fill_rows, torch.long), pack.add(fill_from, torch.long)) if fill_rows else None
    # the C++ decode kernel's batch, on a CPU device only (no other kernel reads it)
    decodes = _decode_batch(pack, dec_rows, dec_seqs) if device.type == "cpu" and dec_seqs else None
    build_meta = _pack_metadata(pack, slots, prefills, qsl, seq_lens, tables, bs)
    sent = pack.send(device)
    meta = build_meta(sent)
    meta.decode_groups = Deferred(lambda: _decode_groups(dec_rows, dec_seqs, bs, device))
    if decodes is not None:
        meta.decodes = DecodeBatch(*(sent[i] for i in decodes))
    if lora:  # each token row's adapter slot
        meta.lora = lora_metadata([s.request.lora_slot for s, n in scheduled for _ in range(n)], device)
    if fill is not None:
        fill_pending(sent[tokens[0]], sent[fill[0]], sent[fill[1]], sched.prev_token_ids)
    return StepInputs(sent[tokens[0]], sent[tokens[1]], meta, sent[tokens[2]], sample_seqs, prompt_spans)


def fill_pending(input_ids: torch.Tensor, rows: torch.Tensor, source: torch.Tensor, prev: torch.Tensor | None) -> None:
    """Write the tokens still on the device into a step's input ids: row ``rows[i]`` takes
    ``prev[source[i]]``, the token the step in flight sampled for its sequence (asynchronous
    scheduling; the device orders this after that step's sampling, the host waits for nothing).
    A row whose logits could not be sampled (:data:`~dfllm.kernels.argmax.NON_FINITE_ID` there,
    negative) reads token 0: its sequence ends with an error, and this step's output for it is
    dropped."""
    assert prev is not None, "a sequence's token is pending but no step is in flight"
    input_ids.index_copy_(0, rows, prev.index_select(0, source).clamp_min(0).to(input_ids.dtype))


# from this many one-token sequences on, _prepare_decodes' whole-batch array operations cost less
# than the loop's per-sequence appends (below it their fixed cost, ~15 µs, is more)
WHOLE_BATCH_DECODES = 16


def whole_batch(seqs: list[Sequence]) -> bool:
    """Whether a step of these one-token sequences needs no more than :func:`decode_arrays`
    describes: none runs a LoRA adapter (rows ordered and tagged by adapter) or asks for
    prompt log-probabilities (logit rows at prompt positions; one whose prompt is all scored
    takes the loop too, with the same result)."""
    return not any(s.prompt_logprobs is not None or s.request.lora_request is not None for s in seqs)


@dataclass(frozen=True)
class DecodeArrays:
    """A step of one-token sequences as whole-batch host arrays (row ``i`` is sequence ``i``):
    the token each computes, its position and cache slot, its context length (the new token
    included), its block table padded with -1 (``tables``, with its length in ``table_lens``),
    the rows that sample (whose token is the sequence's last: not a one-token prompt chunk),
    and the rows whose token is still on the device."""

    ids: np.ndarray  # int64 [n]
    positions: np.ndarray  # int64 [n]
    slots: np.ndarray  # int64 [n]
    seq_lens: np.ndarray  # int32 [n]
    tables: np.ndarray  # int32 [n, width]
    table_lens: np.ndarray  # int64 [n]
    sampling: np.ndarray  # int64, ascending
    # the rows whose token the step in flight sampled (``ids`` holds 0 there), and where in its
    # sampled ids each is (asynchronous scheduling: :func:`fill_pending`)
    fill_rows: np.ndarray  # int64
    fill_from: np.ndarray  # int64
    own: np.ndarray | None = None  # own_tables() when gathered with the tables (BlockTableArray)

    def own_tables(self) -> np.ndarray:
        """The block tables padded with each one's own last block instead (as
        :func:`padded_rows` with ``own``)."""
        if self.own is not None:
            return self.own
        lens = self.table_lens
        last = self.tables[np.arange(len(lens)), lens - 1]
        return np.where(np.arange(self.tables.shape[1]) < lens[:, None], self.tables, last[:, None])


def pad_tables(tables: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Block tables as one int32 ``[n, width]`` array, each padded with -1 to the longest, and
    their lengths."""
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    real = np.arange(int(lens.max())) < lens[:, None]
    padded = np.full(real.shape, -1, dtype=np.int32)
    padded[real] = np.fromiter(itertools.chain.from_iterable(tables), np.int32, int(lens.sum()))
    return padded, lens


def padded_rows(tables: list[list[int]], own: bool = False) -> tuple[list[int], int]:
    """Block tables flattened, each padded to the longest (the width, returned too) with -1, or
    with ``own`` with its own last block, never another sequence's: kernels that read every
    entry multiply the padding by a zero attention weight, and another sequence's keys could be
    NaN (its own, when NaN, make it NaN anyway). The per-step loop's form (a few sequences: lists
    cost less than arrays); :func:`pad_tables` and :meth:`DecodeArrays.own_tables` are the
    whole-batch form."""
    width = max(map(len, tables))
    if own:
        return [b for t in tables for b in t + t[-1:] * (width - len(t))], width
    return [b for t in tables for b in (t + [-1] * (width - len(t)) if len(t) < width else t)], width


_PENDING_ROW = operator.attrgetter("pending_row")


def decode_arrays(
    seqs: list[Sequence], bs: int, tables: BlockTableArray | None = None, in_flight: bool = True
) -> DecodeArrays:
    """The :class:`DecodeArrays` of one-token sequences, built with a few whole-batch array
    operations instead of Python loops over the sequences; their block tables gathered from
    ``tables`` (the block manager's rows of them) where given, else from their lists. Without
    a step ``in_flight`` no sequence has a token pending on the device (none is looked for)."""
    n = len(seqs)
    tokens = [s.token_ids for s in seqs]
    starts = [s.num_computed_tokens for s in seqs]
    pos = np.array(starts, dtype=np.int64)
    if tables is None:
        (padded, lens), own = pad_tables([s.block_table for s in seqs]), None
    else:
        padded, own, lens = tables.gather(seqs)
    num_tokens = np.fromiter(map(len, tokens), np.int64, n)
    if in_flight:
        pending = np.fromiter(map(_PENDING_ROW, seqs), np.int64, n)
        fill_rows = np.flatnonzero(pending >= 0)
        fill_from = pending[fill_rows]
        num_tokens += pending >= 0  # with the token in flight
    else:
        fill_rows = fill_from = np.zeros(0, dtype=np.int64)
    if len(fill_rows):  # tokens still on the device (asynchronous scheduling): 0 here, filled there
        ids = np.fromiter((t[p] if p < len(t) else 0 for t, p in zip(tokens, starts)), np.int64, n)
    else:
        ids = np.array(list(map(list.__getitem__, tokens, starts)), dtype=np.int64)
    return DecodeArrays(
        ids=ids,
        positions=pos,
        slots=padded[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs,
        seq_lens=(pos + 1).astype(np.int32),
        tables=padded,
        table_lens=lens,
        sampling=np.flatnonzero(num_tokens == pos + 1),
        fill_rows=fill_rows,
        fill_from=fill_from,
        own=own,
    )


def _prepare_decodes(
    seqs: list[Sequence],
    bs: int,
    device: torch.device,
    prev: torch.Tensor | None = None,
    tables: BlockTableArray | None = None,
) -> StepInputs:
    """:func:`prepare_inputs` of a step where every sequence computes one token (a decode, or a
    one-token prompt chunk), from its :func:`decode_arrays` (at 256 sequences ~0.15 ms instead
    of the loop's ~0.37)."""
    n = len(seqs)
    arrays = decode_arrays(seqs, bs, tables, in_flight=prev is not None)
    pack = HostPack()
    at = (
        pack.add(arrays.ids, torch.long),
        pack.add(arrays.positions, torch.long),
        pack.add(arrays.sampling, torch.long),
        pack.add(arrays.slots, torch.long),
        pack.add(np.arange(n + 1, dtype=np.int32), torch.int32),
        pack.add(arrays.seq_lens, torch.int32),
        pack.add(arrays.tables, torch.int32, arrays.tables.shape),
    )
    fill = (
        (pack.add(arrays.fill_rows, torch.long), pack.add(arrays.fill_from, torch.long))
        if len(arrays.fill_rows)
        else None
    )
    if device.type == "cpu":  # the C++ decode kernel's batch
        decodes = (
            pack.add(np.arange(n), torch.long),
            pack.add(arrays.own_tables(), torch.int32, arrays.tables.shape),
            pack.add(arrays.seq_lens, torch.int32),
        )
    sent = pack.send(device)
    meta = AttentionMetadata(
        slot_mapping=sent[at[3]],
        prefills=[],
        decode_groups=Deferred(lambda: _decode_groups(list(range(n)), seqs, bs, device)),
        query_start_loc=sent[at[4]],
        seq_lens=sent[at[5]],
        block_tables=sent[at[6]],
        block_size=bs,
        max_query_len=1,
        max_seq_len=int(arrays.seq_lens.max()),
    )
    if device.type == "cpu":
        meta.decodes = DecodeBatch(*(sent[i] for i in decodes))
    sampling = arrays.sampling
    sample_seqs = list(seqs) if len(sampling) == n else [seqs[i] for i in sampling.tolist()]
    if fill is not None:
        fill_pending(sent[at[0]], sent[fill[0]], sent[fill[1]], prev)
    return StepInputs(sent[at[0]], sent[at[1]], meta, sent[at[2]], sample_seqs, every_row=len(sampling) == n)


def move_inputs(inputs: StepInputs, device: torch.device) -> StepInputs:
    """``inputs`` with every tensor on ``device`` (as is when already there)."""
    if inputs.input_ids.device == device:
        return inputs

    def to(x):
        return None if x is None else x.to(device, non_blocking=True)

    m: AttentionMetadata = inputs.meta
    prefills = [replace(p, kv_slots=to(p.kv_slots)) for p in m.prefills]
    host_groups = m.decode_groups
    groups = Deferred(
        lambda: [replace(g, rows=to(g.rows), block_tables=to(g.block_tables), mask=to(g.mask)) for g in host_groups]
    )
    decodes = (
        None
        if m.decodes is None or device.type != "cpu"  # the C++ decode kernel's batch: read on a CPU only
        else DecodeBatch(*(to(x) for x in (m.decodes.rows, m.decodes.block_tables, m.decodes.seq_lens)))
    )
    meta = replace(
        m,
        slot_mapping=to(m.slot_mapping),
        prefills=prefills,
        decode_groups=groups,
        query_start_loc=to(m.query_start_loc),
        seq_lens=to(m.seq_lens),
        block_tables=to(m.block_tables),
        decodes=decodes,
        lora=None if m.lora is None else m.lora.to(device),
    )
    return StepInputs(
        to(inputs.input_ids),
        to(inputs.positions),
        meta,
        to(inputs.logit_rows),
        inputs.sample_seqs,
        inputs.prompt_spans,
        move_mm(inputs.mm, device),
        inputs.every_row,
    )


def _slots(table: list[int], length: int, bs: int) -> torch.Tensor:
    """Cache slots of the first ``length`` tokens of a block table."""
    blocks = torch.tensor(table[: -(-length // bs)])
    return (blocks.unsqueeze(1) * bs + torch.arange(bs)).flatten()[:length]


DECODE_GROUPS = 8
MIN_DECODE_GROUP = 8


def _decode_groups(rows: list[int], seqs: list[Sequence], bs: int, device: torch.device) -> list[DecodeGroup]:
    """Decodes sorted by context length and split into a few groups of similar length, for
    the kernels that gather each group's keys (the PyTorch reference, MLA), on ``device``;
    a table shorter than its group's is padded with its own last block (:func:`padded_rows`)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].block_table))
    size = max(MIN_DECODE_GROUP, -(-len(order) // DECODE_GROUPS))
    pack = HostPack()
    parts = []
    for start in range(0, len(order), size):
        members = order[start : start + size]
        tables, width = padded_rows([seqs[m].block_table for m in members], own=True)
        lens = torch.tensor([seqs[m].num_computed_tokens + 1 for m in members])
        mask = torch.arange(width * bs).unsqueeze(0) < lens.unsqueeze(1)
        shape = (len(members), width)
        parts.append((pack.add([rows[m] for m in members], torch.long), pack.add(tables, torch.long, shape), mask))
    sent = pack.send(device)
    return [DecodeGroup(sent[r], sent[t], mask.to(device, non_blocking=True)) for r, t, mask in parts]


def _decode_batch(pack: HostPack, rows: list[int], seqs: list[Sequence]) -> tuple[int, int, int]:
    """All decodes in one batch, each block table padded with its own last block: their
    indices in ``pack`` (rows, block tables, context lengths)."""
    tables, width = padded_rows([s.block_table for s in seqs], own=True)
    return (
        pack.add(rows, torch.long),
        pack.add(tables, torch.int32, (len(seqs), width)),
        pack.add([s.num_computed_tokens + 1 for s in seqs], torch.int32),
    )


def _pack_metadata(
    pack: HostPack,
    slot_mapping: list[int] | torch.Tensor,
    prefills: list[tuple[int, int, int, torch.Tensor | None]],
    qsl: list[int],
    seq_lens: list[int],
    tables: list[list[int]],
    bs: int,
) -> Callable[[list[torch.Tensor]], AttentionMetadata]:
    """Add a step's metadata arrays to ``pack``; what builds the metadata from the sent arrays."""
    padded, width = padded_rows(tables)
    at = (
        pack.add(slot_mapping, torch.long),
        pack.add(qsl, torch.int32),
        pack.add(seq_lens, torch.int32),
        pack.add(padded, torch.int32, (len(tables), width)),
    )
    spans = [
        (q_start, q_len, ctx, None if kv is None else pack.add(kv, torch.long)) for q_start, q_len, ctx, kv in prefills
    ]
    max_query_len = max(b - a for a, b in zip(qsl, qsl[1:]))

    def build(sent: list[torch.Tensor]) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=sent[at[0]],
            prefills=[PrefillSpan(q, n, ctx, None if kv is None else sent[kv]) for q, n, ctx, kv in spans],
            decode_groups=[],
            query_start_loc=sent[at[1]],
            seq_lens=sent[at[2]],
            block_tables=sent[at[3]],
            block_size=bs,
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
        )

    return build


def attention_metadata(
    slot_mapping: torch.Tensor,
    prefills: list[PrefillSpan],
    groups: list[DecodeGroup],
    qsl: list[int],
    seq_lens: list[int],
    tables: list[list[int]],
    bs: int,
    device: torch.device,
) -> AttentionMetadata:
    """The metadata of a step, its tensors moved to ``device`` (in one copy per dtype)."""
    pack = HostPack()
    build = _pack_metadata(
        pack,
        slot_mapping,
        [(p.q_start, p.q_len, p.ctx_len, p.kv_slots) for p in prefills],
        qsl,
        seq_lens,
        tables,
        bs,
    )
    meta = build(pack.send(device))
    meta.decode_groups = [
        replace(
            g,
            rows=g.rows.to(device, non_blocking=True),
            block_tables=g.block_tables.to(device, non_blocking=True),
            mask=g.mask.to(device, non_blocking=True),
        )
        for g in groups
    ]
    return meta
