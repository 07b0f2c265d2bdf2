"""The inputs of one step: the scheduled tokens flattened into one batch, and where their keys live."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from dfllm.engine.scheduler import SchedulerOutput
from dfllm.engine.sequence import Sequence
from dfllm.kernels.lora import lora_metadata
from dfllm.kernels.metadata import AttentionMetadata, DecodeBatch, DecodeGroup, PrefillSpan
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
    (``sample_seqs``), then the prompt positions of ``prompt_spans``, in order."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor
    sample_seqs: list[Sequence]
    prompt_spans: list[PromptLogitSpan] = field(default_factory=list)
    # a vision-language model's extra forward arguments (dfllm.multimodal.encoder.step_mm_kwargs)
    mm: dict = field(default_factory=dict)


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
    """Flatten the step's tokens and describe where their keys live (tensors on ``device``)."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    prefills: list[PrefillSpan] = []
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
    for seq, n in scheduled:
        start, end, row = seq.num_computed_tokens, seq.num_computed_tokens + n, len(ids)
        ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        if n == 1:
            dec_rows.append(row)
            dec_seqs.append(seq)
        else:
            kv_slots = None if start == 0 else _slots(table, end, bs)
            prefills.append(PrefillSpan(row, n, end, kv_slots))
        if end == seq.num_tokens:
            logit_rows.append(row + n - 1)
            sample_seqs.append(seq)
        if seq.needs_prompt_logprobs:
            assert seq.prompt_logprobs is not None
            # positions p scoring prompt token p + 1, from the first not yet scored
            first = max(start, len(seq.prompt_logprobs) - 1)
            last = min(end, seq.num_prompt_tokens - 1)
            if last > first:
                prompt_rows.extend(range(row + first - start, row + last - start))
                prompt_spans.append(PromptLogitSpan(seq, first, last - first))
        qsl.append(len(ids))
    seq_lens = [s.num_computed_tokens + n for s, n in scheduled]
    tables = [s.block_table for s, _ in scheduled]
    groups = _decode_groups(dec_rows, dec_seqs, bs)
    meta = attention_metadata(torch.tensor(slots), prefills, groups, qsl, seq_lens, tables, bs, device)
    meta.decodes = _decode_batch(dec_rows, dec_seqs, device)
    if lora:  # each token row's adapter slot
        meta.lora = lora_metadata([s.request.lora_slot for s, n in scheduled for _ in range(n)], device)
    return StepInputs(
        torch.tensor(ids, device=device),
        torch.tensor(positions, device=device),
        meta,
        torch.tensor(logit_rows + prompt_rows, dtype=torch.long, device=device),
        sample_seqs,
        prompt_spans,
    )


def move_inputs(inputs: StepInputs, device: torch.device) -> StepInputs:
    """``inputs`` with every tensor on ``device`` (as is when already there)."""
    if inputs.input_ids.device == device:
        return inputs

    def to(x):
        return None if x is None else x.to(device, non_blocking=True)

    m: AttentionMetadata = inputs.meta
    prefills = [replace(p, kv_slots=to(p.kv_slots)) for p in m.prefills]
    groups = [replace(g, rows=to(g.rows), block_tables=to(g.block_tables), mask=to(g.mask)) for g in m.decode_groups]
    decodes = (
        None
        if m.decodes is None
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
    )


def _slots(table: list[int], length: int, bs: int) -> torch.Tensor:
    """Cache slots of the first ``length`` tokens of a block table."""
    blocks = torch.tensor(table[: -(-length // bs)])
    return (blocks.unsqueeze(1) * bs + torch.arange(bs)).flatten()[:length]


DECODE_GROUPS = 8
MIN_DECODE_GROUP = 8


def _decode_groups(rows: list[int], seqs: list[Sequence], bs: int) -> list[DecodeGroup]:
    """Decodes sorted by context length and split into a few groups of similar length.

    A table shorter than its group's is padded with its own last block, never another
    sequence's: the padding is masked out, but still multiplied by a zero attention weight,
    and another sequence's keys could be NaN (its own, when NaN, make it NaN anyway).
    """
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].block_table))
    size = max(MIN_DECODE_GROUP, -(-len(order) // DECODE_GROUPS))
    groups = []
    for start in range(0, len(order), size):
        members = order[start : start + size]
        width = len(seqs[members[-1]].block_table)
        # padded as lists, then one tensor (a tensor per row cost 1.6 ms a step at 64 decodes)
        tables = torch.tensor(
            [seqs[m].block_table + [seqs[m].block_table[-1]] * (width - len(seqs[m].block_table)) for m in members],
            dtype=torch.long,
        )
        lens = torch.tensor([seqs[m].num_computed_tokens + 1 for m in members])
        mask = torch.arange(width * bs).unsqueeze(0) < lens.unsqueeze(1)
        groups.append(DecodeGroup(torch.tensor([rows[m] for m in members]), tables, mask))
    return groups


def _decode_batch(rows: list[int], seqs: list[Sequence], device: torch.device) -> DecodeBatch | None:
    """All decodes in one batch, each block table padded with its own last block."""
    if not seqs:
        return None
    width = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [s.block_table[-1]] * (width - len(s.block_table)) for s in seqs]
    return DecodeBatch(
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(tables, dtype=torch.int32, device=device),
        torch.tensor([s.num_computed_tokens + 1 for s in seqs], dtype=torch.int32, device=device),
    )


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
    """The metadata of a step, its tensors moved to ``device``."""
    width = max(len(t) for t in tables)
    block_tables = torch.full((len(tables), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)

    def to(x):
        return None if x is None else x.to(device)

    for span in prefills:
        span.kv_slots = to(span.kv_slots)
    for g in groups:
        g.rows, g.block_tables, g.mask = to(g.rows), to(g.block_tables), to(g.mask)
    return AttentionMetadata(
        slot_mapping=to(slot_mapping),
        prefills=prefills,
        decode_groups=groups,
        query_start_loc=to(torch.tensor(qsl, dtype=torch.int32)),
        seq_lens=to(torch.tensor(seq_lens, dtype=torch.int32)),
        block_tables=to(block_tables),
        block_size=bs,
        max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
        max_seq_len=max(seq_lens),
    )
