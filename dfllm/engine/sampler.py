"""Turning the logits of one step into next tokens, one row per sequence.

Order of operations per row: the structured-output mask (tokens the row's grammar forbids
set to ``-inf``, for greedy and sampled rows alike), ``logit_bias``, ``allowed_token_ids``
and ``bad_words``, penalties (repetition over prompt and
output, presence and frequency over output), the ``min_tokens`` ban on stop tokens (not
for constrained rows, whose grammar decides where they end), then greedy argmax or
temperature, top-k, top-p and min-p followed by a draw. Draws use the exponential-race
trick (``argmax(p / q)`` with ``q ~ Exp(1)``); a seeded request draws ``q`` from its own
generator so its text does not depend on the rest of the batch. Log-probabilities are
taken before all of this, from the model's raw distribution (constrained rows included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dfllm.engine.sequence import Sequence
from dfllm.engine.structured import apply_masks


@dataclass
class SampledToken:
    """The token drawn for one row, with its raw log-probability information if asked."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float, int]] | None = None  # (token id, logprob, rank)


class Sampler:
    """Samples next tokens for a batch of sequences."""

    def __init__(self, eos_token_ids: set[int], seed: int):
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        logits = logits.float()
        raw_logprobs = self._raw_logprobs(logits, seqs)
        if any(s.grammar is not None for s in seqs):
            apply_masks(logits, [s.grammar for s in seqs])
        logits = self._apply_penalties(logits, seqs)
        token_ids = self._choose(logits, seqs)
        return [
            self._sampled(i, token_ids[i], raw_logprobs, seq) for i, seq in enumerate(seqs)
        ]

    # ---- logprobs ---------------------------------------------------------------------
    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, torch.Tensor]:
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return {}
        lp = torch.log_softmax(logits[rows], dim=-1)
        return {row: lp[j] for j, row in enumerate(rows)}

    @staticmethod
    def _sampled(i: int, token_id: int, raw: dict[int, torch.Tensor], seq: Sequence) -> SampledToken:
        if i not in raw:
            return SampledToken(token_id)
        lp = raw[i]
        chosen = float(lp[token_id])
        rank = int((lp > chosen).sum()) + 1
        k = seq.params.logprobs
        assert k is not None  # raw holds only the rows that asked for logprobs
        k = lp.numel() if k == -1 else k
        top: list[tuple[int, float, int]] = []
        if k > 0:
            values, ids = lp.topk(k)
            top = [(int(t), float(v), r + 1) for r, (v, t) in enumerate(zip(values, ids))]
        if all(t != token_id for t, _, _ in top):
            top.insert(0, (token_id, chosen, rank))
        return SampledToken(token_id, chosen, top)

    # ---- logit processing ---------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
            if p.allowed_token_ids is not None:
                allowed = logits[i, p.allowed_token_ids].clone()
                logits[i] = float("-inf")
                logits[i, p.allowed_token_ids] = allowed
            for word in seq.request.bad_words_ids:  # its last token, once the others were just generated
                if len(word) == 1 or (seq.num_output_tokens >= len(word) - 1
                                      and tuple(seq.output_token_ids[-(len(word) - 1):]) == word[:-1]):
                    logits[i, word[-1]] = float("-inf")
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
                counts = torch.bincount(torch.tensor(seq.output_token_ids), minlength=logits.shape[1])
                counts = counts[: logits.shape[1]].to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
            if seq.num_output_tokens < p.min_tokens and seq.grammar is None:  # a grammar decides its own end
                banned = set(p.single_stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
                if banned:
                    logits[i, sorted(banned)] = float("-inf")
        return logits

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        chosen = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        if rows:
            probs = self._probs(logits[rows], [seqs[i].params for i in rows])
            noise = torch.empty_like(probs)
            for j, i in enumerate(rows):
                noise[j].exponential_(generator=seqs[i].generator or self.generator)
            chosen[rows] = (probs / noise).argmax(dim=-1)
        return chosen.tolist()

    @staticmethod
    def _probs(logits: torch.Tensor, params: list) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
        logits = logits / temps
        top_k = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
        top_p = [p.top_p for p in params]
        if min(top_k) < logits.shape[1] or min(top_p) < 1.0:
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
        if bool((min_p > 0).any()):
            keep = probs >= min_p * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        return probs


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1]).unsqueeze(0)
    remove = ranks >= torch.tensor(top_k).unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= torch.tensor(top_p, dtype=probs.dtype).unsqueeze(1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
