"""What each sampled token does to its sequence: the one place that decides when a sequence ends.

For every sampled row of a step, in order: the token is appended (metrics, log-probabilities),
the structured-output grammar advances, and the stop checks run: a grammar that terminated,
an end-of-sequence token (unless ``ignore_eos``), a group of stop token ids the output now
ends with, a stop token id, a stop string in the new text, ``max_tokens``, and the context
limit. Prompt log-probabilities are recorded here too. ``min_tokens`` holds back every stop but the
grammar's and the length limits (as in vLLM, a stop string is not looked for in the text of
the first ``min_tokens`` tokens). The token that stops a sequence (end-of-sequence, a stop
token id or group) adds its text only with ``include_stop_str_in_output``, as in vLLM (the
end-of-sequence token's is empty unless ``skip_special_tokens=False``). A row whose logits
could not be sampled (non-finite) ends with ``finish_reason="error"``, as does one whose grammar
allows no token at all (an empty language, or characters the tokenizer cannot spell: what
was drawn there is not kept). The engine then hands
the ended sequences to the scheduler, which only frees their blocks.
"""

from __future__ import annotations

import logging

import torch
from transformers import PreTrainedTokenizerBase

from dfllm.engine.detokenizer import Detokenizer, Step
from dfllm.engine.metrics import EngineMetrics
from dfllm.engine.sampler import SampledToken, StepTokens
from dfllm.engine.sequence import Request, Sequence
from dfllm.engine.structured import GRAMMAR_DEAD_END
from dfllm.outputs import CompletionOutput, Logprob, RequestOutput, token_first

logger = logging.getLogger("dfllm")


class OutputProcessor:
    """Appends sampled tokens, detokenizes, and makes every stop and finish decision."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_ids: set[int],
        max_model_len: int,
        metrics: EngineMetrics,
        logprobs_mode: str = "raw_logprobs",
    ):
        """``tokenizer`` is None without one (``skip_tokenizer_init``): the input processor then
        gives every request ``detokenize=False``, so nothing here decodes. ``logprobs_mode``
        (vLLM's): under ``"raw_logits"`` and ``"processed_logits"`` prompt log-probabilities hold
        the logits themselves, as vLLM's do (a prompt token is never processed, so "raw" and
        "processed" are the same there)."""
        self.tokenizer = tokenizer
        self.prompt_logits = logprobs_mode.endswith("logits")
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.detokenizer = Detokenizer(tokenizer)
        self._ready: dict[int, Step] = {}  # by seq_id: the detokenizer's step, prepared for the step's rows

    def start(self, seq: Sequence) -> None:
        """Get a new sequence's text state ready (its decode window starts in the prompt)."""
        self.detokenizer.start(seq)

    def process(self, seqs: list[Sequence], sampled: StepTokens, now: float) -> list[Sequence]:
        """Apply one step's sampled tokens (row ``i`` is ``seqs[i]``'s; for a row that could not
        be sampled, what was wrong with its logits); the sequences that ended, with
        ``finish_reason`` set.

        The tokens' metrics are recorded once for the step (:meth:`EngineMetrics.observe_tokens`,
        the same values as one observation per token). A row whose parameters ask for no stop
        but the end-of-sequence token and the length limits (no stop strings or stop token
        ids), with no grammar, takes a short path that makes the same decisions as
        :meth:`_check_stop` (its text, if it has one, advanced after the end-of-sequence check
        as there)."""
        ids, with_logprobs, errors = sampled.ids, sampled.logprobs, sampled.errors
        # every token appended first, so that windows decode the whole step's text in one pass
        if errors:
            for i, (seq, token) in enumerate(zip(seqs, ids)):
                if i not in errors:
                    seq.token_ids.append(token)
        else:
            for seq, token in zip(seqs, ids):
                seq.token_ids.append(token)
        if self.detokenizer.batches:  # the texts' windows decoded together, applied row by row below
            texts = [s for i, s in enumerate(seqs) if s.request.params.detokenize and i not in errors]
            self._ready = dict(zip((s.seq_id for s in texts), self.detokenizer.prepare(texts))) if texts else {}
        ended = []
        ttfts: list[float] = []
        tpots: list[float] = []
        prompt_tokens = 0
        eos, max_len = self.eos_token_ids, self.max_model_len
        last_params, plain = None, False
        try:
            for i, (seq, token) in enumerate(zip(seqs, ids)):
                if errors and i in errors:
                    seq.error = (
                        f"the model produced non-finite logits ({errors[i]}) at output token "
                        f"{seq.num_output_tokens} (0-based)"
                    )
                    logger.warning("request %s: %s", seq.request.request_id, seq.error)
                    seq.finish_reason = "error"
                    ended.append(seq)
                    continue
                token_ids = seq.token_ids  # the token already appended (above)
                req = seq.request
                m = req.metrics
                if m.first_token_time is None:
                    prompt_tokens += len(req.prompt_token_ids)
                    ttfts.append(now - m.arrival_time)
                    m.first_token_time = now
                else:
                    since = m.last_token_time
                    assert since is not None  # set with the first token
                    tpots.append(now - since)
                m.last_token_time = now
                p = req.params
                if with_logprobs and i in with_logprobs:
                    tok = with_logprobs[i]
                    assert tok.logprob is not None and seq.logprobs is not None  # asked for
                    seq.cumulative_logprob += tok.logprob
                    seq.logprobs.append(self._logprob_dict(tok, p.detokenize))
                if p is not last_params:
                    last_params = p
                    plain = not (p.stop_strings or p.stop_token_groups or p.single_stop_token_ids)
                if plain and seq.grammar is None:  # _check_stop's decisions for such a row
                    num_out = len(token_ids) - seq.num_prompt_tokens
                    if num_out >= p.min_tokens and not p.ignore_eos and token in eos:
                        if p.include_stop_str_in_output and p.detokenize:  # its text too, as vLLM's
                            self._advance_text(seq)
                        seq.finish_reason, seq.stop_reason = "stop", None
                    else:
                        if p.detokenize:
                            self._advance_text(seq)
                        if num_out == p.min_tokens:
                            seq.stop_offset = seq.text_len
                        if (p.max_tokens is not None and num_out >= p.max_tokens) or len(token_ids) >= max_len:
                            seq.finish_reason, seq.stop_reason = "length", None
                        else:
                            seq.finish_reason, seq.stop_reason = None, None
                else:
                    seq.finish_reason, seq.stop_reason = self._check_stop(seq, token)
                if seq.finish_reason is not None:
                    ended.append(seq)
        finally:
            self._ready = {}
            self.metrics.observe_tokens(prompt_tokens, ttfts, tpots)
        return ended

    def _advance_text(self, seq: Sequence) -> str:
        """The detokenizer's step for ``seq``'s newest token: the one :meth:`process` prepared
        with the step's other sequences, else decoded now."""
        if seq.seq_id not in self._ready:
            return self.detokenizer.step(seq)
        return self.detokenizer.apply(seq, self._ready.pop(seq.seq_id))

    def _check_stop(self, seq: Sequence, token: int) -> tuple[str | None, int | str | None]:
        """(finish_reason, stop_reason) after ``token`` was appended; (None, None) to go on."""
        p = seq.request.params
        if seq.grammar is not None:
            if not seq.grammar.accept(token, seq.token_ids):  # the mask allowed no token (below)
                seq.token_ids.pop()  # not the output's: nothing the grammar allows could be drawn
                seq.error = (
                    f"structured outputs: no token can continue the output at output token "
                    f"{seq.num_output_tokens} (0-based): {GRAMMAR_DEAD_END}"
                )
                logger.warning("request %s: %s", seq.request.request_id, seq.error)
                return "error", None  # as vLLM's scheduler ends a request whose grammar rejects its token
            if seq.grammar.terminated:  # complete, and a stop token accepted: done whatever ignore_eos says
                return "stop", None
        num_out = len(seq.token_ids) - seq.num_prompt_tokens  # the token ids do not change below
        stops_allowed = num_out >= p.min_tokens
        if stops_allowed and not p.ignore_eos and token in self.eos_token_ids:
            if p.include_stop_str_in_output and p.detokenize:  # its text too (empty when skipped as special)
                self._advance_text(seq)
            return "stop", None
        if p.stop_token_groups:
            seq.text_marks.append(seq.text_len)  # the text before this token, to cut a group's text
            group = _ended_group(seq) if stops_allowed else None
            if group is not None:  # its text only with include_stop_str_in_output
                if p.include_stop_str_in_output and p.detokenize:
                    self._advance_text(seq)
                elif p.detokenize:
                    seq.cut_text(seq.text_marks[-len(group)])
                return "stop", str(list(group))
        if stops_allowed and token in p.single_stop_token_ids:  # its text only with include_stop_str_in_output
            if p.include_stop_str_in_output and p.detokenize:
                self._advance_text(seq)
            return "stop", token
        delta = self._advance_text(seq) if p.detokenize else ""
        if num_out == p.min_tokens:  # as vLLM: no stop string in these tokens' text
            seq.stop_offset = seq.text_len
        if num_out > p.min_tokens and delta and p.stop_strings:
            stop = _cut_at_stop_string(seq, len(delta))
            if stop is not None:
                return "stop", stop
        if p.max_tokens is not None and num_out >= p.max_tokens:
            return "length", None
        if len(seq.token_ids) >= self.max_model_len:
            return "length", None
        return None, None

    def add_prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        """Record the prompt log-probabilities that the logits at prompt positions ``start``,
        ``start + 1``, ... give: each scores the next prompt token, with the top
        ``prompt_logprobs`` alternatives (the whole vocabulary for -1), from the model's raw
        distribution as vLLM does (its logits under the ``*_logits`` modes). A position already
        recorded (a recomputed prefill) is skipped."""
        assert seq.prompt_logprobs is not None  # only sequences that asked have a span
        k = seq.params.prompt_logprobs
        assert k is not None
        # computed where the logits are; only the chosen values, ranks and top-k come back, at once
        lp = logits.float() if self.prompt_logits else torch.log_softmax(logits.float(), dim=-1)
        target_ids = seq.token_ids[start + 1 : start + 1 + lp.shape[0]]
        targets = torch.tensor(target_ids).to(lp.device, non_blocking=True)
        chosen = lp.gather(1, targets.unsqueeze(1))
        ranks = (lp > chosen).sum(dim=1) + 1
        top_vals, top_ids = lp.topk(lp.shape[1] if k == -1 else k, dim=1)
        host = torch.cat([chosen.double(), ranks.double().unsqueeze(1), top_vals.double(), top_ids.double()], dim=1)
        width = top_vals.shape[1]
        for i, row in enumerate(host.tolist()):
            if start + 1 + i != len(seq.prompt_logprobs):  # recorded before (or a gap: never expected)
                continue
            ranked = [(int(t), v, r + 1) for r, (v, t) in enumerate(zip(row[2 : 2 + width], row[2 + width :]))]
            top = token_first(target_ids[i], row[0], int(row[1]), ranked)
            seq.prompt_logprobs.append(self._logprobs(top, seq.params.detokenize))

    def _logprob_dict(self, tok: SampledToken, detokenize: bool) -> dict[int, Logprob]:
        assert tok.top is not None  # sampled with its logprob
        return self._logprobs(tok.top, detokenize)

    def _logprobs(self, top: list[tuple[int, float, int]], detokenize: bool) -> dict[int, Logprob]:
        texts = (
            self.detokenizer.token_texts([t for t, _, _ in top])
            if detokenize and self.tokenizer is not None
            else [None] * len(top)
        )
        return {t: Logprob(lp, rank, text) for (t, lp, rank), text in zip(top, texts)}

    # ---- outputs ---------------------------------------------------------------------
    @staticmethod
    def make_output(req: Request) -> RequestOutput:
        """The ``RequestOutput`` of a (finished) request; with a reasoning parser each
        completion's text is its answer and ``reasoning_content`` its reasoning."""
        outs = []
        for s in req.seqs:
            reasoning, text = _split(req, s.text)
            outs.append(
                CompletionOutput(
                    index=s.index,
                    text=text,
                    token_ids=s.output_token_ids,
                    cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                    logprobs=s.logprobs,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    structured_output_complete=None
                    if s.grammar is None
                    else (
                        s.grammar.rejected is None
                        and s.grammar.completed
                        and not isinstance(s.stop_reason, str)
                        and s.finish_reason != "error"
                    ),
                    error=s.error,
                    reasoning_content=reasoning,
                )
            )
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            outs,
            req.is_finished,
            req.num_cached_tokens,
            req.metrics,
            prompt_logprobs=req.seqs[0].prompt_logprobs if req.seqs else None,
        )

    @staticmethod
    def error_output(req: Request, message: str) -> RequestOutput:
        """The ``RequestOutput`` of a request that failed as a whole: each of its ``n``
        completions empty, with ``finish_reason="error"`` and ``message``."""
        outs = [
            CompletionOutput(
                index=i,
                text="",
                token_ids=[],
                cumulative_logprob=None,
                logprobs=None,
                finish_reason="error",
                error=message,
            )
            for i in range(req.params.n)
        ]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, True, 0, req.metrics)


def _split(req: Request, text: str) -> tuple[str | None, str]:
    """``(reasoning, answer)`` of a completion's text: its reasoning parser's split (a missing
    answer is ``""``), or ``(None, text)`` without a parser or text."""
    if req.reasoning is None or not req.params.detokenize:
        return None, text
    reasoning, content = req.reasoning.extract_reasoning(text)
    return reasoning, content or ""


def _ended_group(seq: Sequence) -> tuple[int, ...] | None:
    """The first ``stop_token_ids`` group that the output tokens now end with, if any."""
    out = seq.output_token_ids
    for group in seq.params.stop_token_groups:
        if len(out) >= len(group) and tuple(out[-len(group) :]) == group:
            return group
    return None


def _cut_at_stop_string(seq: Sequence, new_len: int) -> str | None:
    """The first stop string the last ``new_len`` characters of ``seq.text`` completed, with
    the text cut there (after it with ``include_stop_str_in_output``); None if there is none."""
    params = seq.params
    end = seq.text_len
    # each stop string is looked for from where it could start and end in the new text: the
    # text from the earliest of those is read once (not the whole text)
    starts = [max(seq.stop_offset, end - new_len - len(stop) + 1) for stop in params.stop_strings]
    if not starts:
        return None
    base = min(starts)
    tail = seq.text_from(base)
    best: tuple[int, str] | None = None
    for stop, start in zip(params.stop_strings, starts):
        idx = tail.find(stop, start - base)
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return None
    idx, stop = best
    seq.cut_text(base + idx + (len(stop) if params.include_stop_str_in_output else 0))
    return stop
