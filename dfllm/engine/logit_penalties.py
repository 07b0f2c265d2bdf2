"""The per-request edits of a step's logits, applied on the logits' device.

Each row's ``logit_bias``, ``allowed_token_ids``, ``bad_words``, repetition, presence and
frequency penalties and ``min_tokens`` ban on stop tokens are first gathered on the host
as flat ``(row, token)`` index lists (one pass over the sequences). The lists are packed
into one integer and one float tensor, moved to the device once (without waiting for
it), and every edit is then one vectorised operation over all the rows that have it.

The edits are applied in this order, each row as if alone: bias, allowed tokens, bad
words, repetition penalty (over prompt and output), presence and frequency penalties
(over output), ``min_tokens`` (not for constrained rows, whose grammar decides where they end).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dfllm.engine.sequence import Sequence

_NEG_INF = float("-inf")


@dataclass
class _Pack:
    """Named integer and float lists, moved to a device as two tensors and split back."""

    ints: dict[str, list[int]] = field(default_factory=dict)
    floats: dict[str, list[float]] = field(default_factory=dict)

    def add_ints(self, name: str, values) -> None:
        self.ints.setdefault(name, []).extend(values)

    def add_floats(self, name: str, values) -> None:
        self.floats.setdefault(name, []).extend(values)

    def to(self, device: torch.device) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for lists, dtype in ((self.ints, torch.long), (self.floats, torch.float32)):
            if not lists:
                continue
            flat = torch.tensor([v for values in lists.values() for v in values], dtype=dtype)
            moved = flat.to(device, non_blocking=True)  # pageable memory: copied before this returns
            for name, part in zip(lists, moved.split([len(v) for v in lists.values()])):
                out[name] = part
        return out


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> None:
    """Edit ``logits`` (one row per sequence of ``seqs``) in place with each row's bias,
    allowed tokens, bad words, penalties and ``min_tokens`` ban."""
    if not edits_logits(seqs):
        return
    vocab = logits.shape[1]
    pack = _Pack()
    allowed_rows: list[int] = []
    counted_rows: list[int] = []
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.logit_bias:
            pack.add_ints("bias_rows", [i] * len(p.logit_bias))
            pack.add_ints("bias_ids", p.logit_bias)
            pack.add_floats("bias", p.logit_bias.values())
        if p.allowed_token_ids is not None:
            pack.add_ints("allowed_at", [len(allowed_rows)] * len(p.allowed_token_ids))
            pack.add_ints("allowed_ids", p.allowed_token_ids)
            allowed_rows.append(i)
        for word in seq.request.bad_words_ids:  # its last token, once the others were just generated
            if len(word) == 1 or (
                seq.num_output_tokens >= len(word) - 1 and tuple(seq.output_token_ids[-(len(word) - 1) :]) == word[:-1]
            ):
                pack.add_ints("bad_rows", [i])
                pack.add_ints("bad_ids", [word[-1]])
        if p.repetition_penalty != 1.0:
            seen = sorted(set(seq.token_ids))
            pack.add_ints("rep_rows", [i] * len(seen))
            pack.add_ints("rep_ids", seen)
            pack.add_floats("rep", [p.repetition_penalty] * len(seen))
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
            out_ids = [t for t in seq.output_token_ids if t < vocab]
            pack.add_ints("count_at", [len(counted_rows)] * len(out_ids))
            pack.add_ints("count_ids", out_ids)
            pack.add_floats("frequency", [p.frequency_penalty])
            pack.add_floats("presence", [p.presence_penalty])
            counted_rows.append(i)
        # a grammar decides its own end (once engaged: a reasoning model's reasoning is unconstrained)
        if seq.num_output_tokens < p.min_tokens and (seq.grammar is None or not seq.grammar.engaged):
            banned = sorted(set(p.single_stop_token_ids) | (set() if p.ignore_eos else eos_token_ids))
            pack.add_ints("min_rows", [i] * len(banned))
            pack.add_ints("min_ids", banned)
    if allowed_rows:
        pack.add_ints("allowed_rows", allowed_rows)
    if counted_rows:
        pack.add_ints("counted_rows", counted_rows)
    t = pack.to(logits.device)
    if "bias_rows" in t:
        logits.index_put_((t["bias_rows"], t["bias_ids"]), t["bias"], accumulate=True)
    if "allowed_rows" in t:
        rows = t["allowed_rows"]
        keep = torch.zeros(len(allowed_rows), vocab, dtype=torch.bool, device=logits.device)
        keep[t["allowed_at"], t["allowed_ids"]] = True
        logits[rows] = torch.where(keep, logits[rows], _NEG_INF)
    if "bad_rows" in t:
        logits[t["bad_rows"], t["bad_ids"]] = _NEG_INF
    if "rep_rows" in t:
        index, penalty = (t["rep_rows"], t["rep_ids"]), t["rep"]
        vals = logits[index]
        logits[index] = torch.where(vals > 0, vals / penalty, vals * penalty)
    if "counted_rows" in t:
        rows = t["counted_rows"]
        counts = torch.zeros(len(counted_rows), vocab, dtype=logits.dtype, device=logits.device)
        counts.index_put_(
            (t["count_at"], t["count_ids"]), torch.ones_like(t["count_ids"], dtype=logits.dtype), accumulate=True
        )
        present = (counts > 0).to(logits.dtype)
        logits[rows] -= t["frequency"].unsqueeze(1) * counts + t["presence"].unsqueeze(1) * present
    if "min_rows" in t:
        logits[t["min_rows"], t["min_ids"]] = _NEG_INF


def edits_logits(seqs: list[Sequence]) -> bool:
    """Whether some row may have an edit: False only where no row has a bias, allowed tokens,
    bad words, a penalty or ``min_tokens`` (each parameters object checked once in a run of
    rows that share it, the usual case)."""
    last = None
    for seq in seqs:
        req = seq.request
        if req.bad_words_ids:
            return True
        p = req.params
        if p is last:
            continue
        if (
            p.logit_bias
            or p.allowed_token_ids is not None
            or p.repetition_penalty != 1.0
            or p.presence_penalty
            or p.frequency_penalty
            or p.min_tokens
        ):
            return True
        last = p
    return False
