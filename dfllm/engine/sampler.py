"""Turning the logits of one step into next tokens, one row per sequence, on the logits' device.

A step reads as mask -> penalties -> choose -> hand off. The structured-output mask sets the
tokens a row's grammar forbids to ``-inf`` (greedy and sampled rows alike); then come each
row's ``logit_bias``, ``allowed_token_ids``, ``bad_words``, penalties and ``min_tokens`` ban
(:mod:`dfllm.engine.logit_penalties`); then greedy argmax, or temperature, top-k, top-p and
min-p followed by a draw. Draws use the exponential-race trick (``argmax(p / q)`` with
``q ~ Exp(1)``); a seeded request draws ``q`` from its own generator (on the logits' device)
so its text does not depend on the rest of the batch, the others from the sampler's
generator for that device. Log-probabilities follow vLLM's ``logprobs_mode``: by default
("raw_logprobs") they are taken before all of this, from the model's raw distribution
(constrained rows included); "raw_logits" hands back those logits themselves; the
"processed_*" modes take the logits the token was chosen from (after the mask and penalties,
and for a sampled row temperature, top-k, top-p and min-p, a token they rule out being -inf),
as log-probabilities or as logits. Prompt log-probabilities are always the raw ones, as vLLM's.

A row whose logits cannot be sampled (any NaN, any +inf, or no finite value: NaN weights, an
overflow) gets a message instead of a token. Its maximum, taken before anything else changes
the logits, tells which (torch's ``amax`` propagates NaN, is +inf with any +inf, -inf when
nothing is finite); the row is sampled with the others and its token id replaced by -1 on the
device, so no step waits on the device to learn which rows are bad (only such a row's maximum
is read afterwards, to name what is wrong).

Everything runs where the logits are; only each row's chosen token id (``[rows]``, -1 for a
row that cannot be sampled) and the requested log-probabilities (``[rows]`` and ``[rows, k]``)
come to the host, in one transfer by :func:`to_host`: the step's one device-to-host
synchronisation. The host gets them as a :class:`StepTokens`: the ids, with an object only for
a row that asked for log-probabilities or could not be sampled. :meth:`Sampler.launch`
starts it without waiting (on CUDA into pinned memory), so that the engine can schedule and launch
the next step, whose inputs read the chosen ids on the device, before it waits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dfllm.engine.logit_penalties import apply_penalties, edits_logits
from dfllm.engine.sequence import Sequence
from dfllm.engine.structured import apply_masks
from dfllm.kernels.argmax import NON_FINITE_ID, code_non_finite
from dfllm.kernels.backend import argmax_rows
from dfllm.outputs import token_first
from dfllm.sampling_params import SamplingParams


@dataclass(slots=True)
class SampledToken:
    """The token drawn for one row, with its raw log-probability information if asked."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float, int]] | None = None  # (token id, logprob, rank): the token, then the top-k


@dataclass(slots=True)
class StepTokens:
    """A step's sampled tokens, by row: every row's chosen token id; for the rows that asked
    for log-probabilities, their :class:`SampledToken` (the same id with its log-probability
    and top-k); and for a row whose logits could not be sampled (non-finite: its id means
    nothing) what is wrong with them. Most steps ask for no log-probabilities and have no
    such row: then a step is its ids alone, with no object per row."""

    ids: list[int]
    logprobs: dict[int, SampledToken] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def row(self, i: int) -> SampledToken | str:
        """Row ``i`` as one value: what is wrong with its logits, or its token (with its
        log-probabilities where asked)."""
        if i in self.errors:
            return self.errors[i]
        return self.logprobs.get(i) or SampledToken(self.ids[i])

    def rows(self) -> list[SampledToken | str]:
        """Every row as :meth:`row` gives it."""
        return [self.row(i) for i in range(len(self.ids))]

    def select(self, keep: list[int]) -> StepTokens:
        """The rows ``keep`` (in that order), renumbered from 0."""
        where = {i: j for j, i in enumerate(keep)}
        return StepTokens(
            [self.ids[i] for i in keep],
            {where[i]: t for i, t in self.logprobs.items() if i in where},
            {where[i]: e for i, e in self.errors.items() if i in where},
        )

    @classmethod
    def of(cls, rows: list[SampledToken | str]) -> StepTokens:
        """The step whose rows are ``rows`` (each a token, or what is wrong with its logits)."""
        return cls(
            [NON_FINITE_ID if isinstance(t, str) else t.token_id for t in rows],
            {i: t for i, t in enumerate(rows) if not isinstance(t, str) and t.logprob is not None},
            {i: t for i, t in enumerate(rows) if isinstance(t, str)},
        )


@dataclass
class LogprobPayload:
    """The requested log-probabilities of a step, still on the device: for the rows
    ``rows`` (those that asked), the chosen token's log-probability and rank (``[r]``), and
    per distinct top-k size ``k`` the rows asking for it (positions in ``rows``) with their
    top ``k`` log-probabilities and token ids (``[r_k, k]``, best first)."""

    rows: list[int]
    chosen: torch.Tensor
    ranks: torch.Tensor
    top: list[tuple[list[int], torch.Tensor, torch.Tensor]]


@dataclass
class HostLogprobs:
    """:class:`LogprobPayload` on the host, as Python numbers."""

    rows: list[int]
    chosen: list[float]
    ranks: list[int]
    top: dict[int, list[tuple[int, float, int]]]  # position in rows -> (token id, logprob, rank), best first


@dataclass
class HostCopy:
    """The sampler's one host hand-off, under way: the chosen token ids, each row's coded -1
    where its logits could not be sampled (the check ran on the device), alone as int64 or,
    with log-probabilities, packed with them in one float64 tensor (exact for all of them), on
    its way to the host. On a CUDA device the copy goes into pinned memory without waiting
    (``done`` marks its end), so the host can prepare the next step meanwhile; :meth:`read`
    waits for it and unpacks. ``maxima`` (on the device) is read only for a row coded -1, to
    say what is wrong with it."""

    flat: torch.Tensor
    done: torch.cuda.Event | None
    num_rows: int
    maxima: torch.Tensor  # each row's logit maximum [rows], or the logits [rows, vocab] it is the maximum of
    logprobs: LogprobPayload | None

    def read(self) -> tuple[list[int], HostLogprobs | None]:
        """The chosen token ids (-1 where the row's logits could not be sampled) and the
        requested log-probabilities."""
        if self.done is not None:
            self.done.synchronize()
        n, logprobs = self.num_rows, self.logprobs
        if logprobs is None:
            return self.flat.tolist(), None
        flat = self.flat.tolist()
        ids_host = [int(v) for v in flat[:n]]
        at = n
        r = len(logprobs.rows)
        chosen, ranks = flat[at : at + r], [int(v) for v in flat[at + r : at + 2 * r]]
        at += 2 * r
        top: dict[int, list[tuple[int, float, int]]] = {}
        for positions, values, _ in logprobs.top:
            k = values.shape[1]
            vals, toks = flat[at : at + len(positions) * k], flat[at + len(positions) * k : at + 2 * len(positions) * k]
            at += 2 * len(positions) * k
            for j, pos in enumerate(positions):
                top[pos] = [(int(toks[j * k + c]), vals[j * k + c], c + 1) for c in range(k)]
        return ids_host, HostLogprobs(logprobs.rows, chosen, ranks, top)

    def what_is_wrong(self, row: int) -> str:
        """Why row ``row`` (coded -1) could not be sampled, from its logit maximum: torch's
        ``amax`` propagates NaN, is +inf with any +inf and -inf when nothing is finite."""
        values = self.maxima[row]
        top = float(values.amax() if values.dim() else values)
        return "NaN" if math.isnan(top) else "+inf" if top > 0 else "no finite value"


def to_host(
    token_ids: torch.Tensor,
    logprobs: LogprobPayload | None,
    row_max: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
) -> HostCopy:
    """Start the sampler's only host hand-off: the chosen ``token_ids`` (``[rows]``), coded -1
    on the device where ``row_max`` (``[rows]``, each row's logit maximum) is not finite, and
    the requested log-probabilities, in one transfer; :meth:`HostCopy.read` gives them as
    Python numbers. Without ``row_max`` the ids come coded already (``argmax_rows``'
    ``code_non_finite``), from ``logits`` as the model gave them."""
    if row_max is None:
        assert logits is not None  # what a coded row's maximum is read from
        coded, maxima = token_ids, logits
    else:
        coded, maxima = code_non_finite(token_ids, row_max), row_max
    if logprobs is None:
        flat = coded
    else:
        parts = [coded.double(), logprobs.chosen.double(), logprobs.ranks.double()]
        for _, values, ids in logprobs.top:
            parts += [values.double().flatten(), ids.double().flatten()]
        flat = torch.cat(parts)
    done = None
    if flat.device.type == "cuda":
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        flat = host
    elif flat.device.type != "cpu":
        flat = flat.cpu()
    return HostCopy(flat, done, token_ids.numel(), maxima, logprobs)


@dataclass
class SampledStep:
    """A step's sampling, launched: the chosen token ids on the device (the next step's inputs
    can read them there: asynchronous scheduling; a row that could not be sampled may hold
    -1, read as token 0 there: its sequence ends with an error before that step's output is
    applied) and their copy to the host under way."""

    token_ids: torch.Tensor
    copy: HostCopy

    def tokens(self) -> StepTokens:
        """The step's tokens (:class:`StepTokens`); waits for the copy."""
        ids, host = self.copy.read()
        logprobs: dict[int, SampledToken] = {}
        if host is not None:
            for j, i in enumerate(host.rows):
                token_id, chosen = ids[i], host.chosen[j]
                top = token_first(token_id, chosen, host.ranks[j], host.top.get(j, []))
                logprobs[i] = SampledToken(token_id, chosen, top)
        errors = (
            {i: self.copy.what_is_wrong(i) for i, t in enumerate(ids) if t == NON_FINITE_ID}
            if ids and min(ids) == NON_FINITE_ID
            else {}
        )
        return StepTokens(ids, logprobs, errors)


class Sampler:
    """Samples next tokens for a batch of sequences, on the device of the logits it is given."""

    def __init__(self, eos_token_ids: set[int], seed: int, logprobs_mode: str = "raw_logprobs"):
        """``logprobs_mode`` is vLLM's engine argument (:data:`dfllm.engine_args.LOGPROBS_MODES`): what the
        log-probabilities handed back are (module docstring)."""
        self.eos_token_ids = eos_token_ids
        self.seed = seed
        self.logprobs_mode = logprobs_mode
        self.generators: dict[torch.device, torch.Generator] = {}  # one per device, made on first use

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator of unseeded draws on ``device`` (seeded with the engine's seed)."""
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[device]

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken | str]:
        """A token per row (with its log-probabilities where asked), or for a row whose logits
        cannot be sampled what is wrong with them (module docstring; the engine takes the
        step's :class:`StepTokens` from :meth:`launch`). ``logits`` may be changed."""
        return self.launch(logits, seqs).tokens().rows()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledStep:
        """Sample every row on the logits' device and start the copy of the results to the
        host, without waiting for the device. ``logits`` may be changed."""
        logits = logits.float()
        lp_rows, drawn_rows, grammars = _row_kinds(seqs)
        if logits.device.type == "cpu" and not (lp_rows or drawn_rows or grammars or edits_logits(seqs)):
            # every row greedy, on the logits as the model gave them: the argmax and the
            # non-finite check in one pass of the C++ kernel (a row that fails it is -1 there
            # too). On a GPU the logits would be held until the copy is read, a step later under
            # asynchronous scheduling: there each row's maximum is kept instead (below).
            token_ids = argmax_rows(logits, code_non_finite=True)
            return SampledStep(token_ids, to_host(token_ids, None, logits=logits))
        row_max = logits.amax(dim=-1)  # before the masks and penalties change the logits
        raw, as_logprobs = self.logprobs_mode.startswith("raw"), self.logprobs_mode.endswith("logprobs")
        values = _logprob_values(_rows(logits, lp_rows), as_logprobs) if lp_rows and raw else None
        if grammars:
            apply_masks(logits, [s.grammar for s in seqs])
        apply_penalties(logits, seqs, self.eos_token_ids)
        token_ids, processed_logits = self._choose(logits, seqs, drawn_rows, keep_processed=bool(lp_rows) and not raw)
        if processed_logits is not None:
            values = _logprob_values(_rows(processed_logits, lp_rows), as_logprobs)
        payload = None if values is None else _logprob_payload(values, token_ids, lp_rows, seqs)
        return SampledStep(token_ids, to_host(token_ids, payload, row_max))

    def _choose(
        self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int], keep_processed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chosen token of every row (``[rows]``, on the logits' device) and, with
        ``keep_processed``, the logits the choice was made from (vLLM's processed logits: a
        greedy row's as given, a sampled row's, one of ``rows``, after temperature, top-k,
        top-p and min-p)."""
        if not rows:
            return argmax_rows(logits), logits if keep_processed else None
        scaled, probs = _probs(_rows(logits, rows), [seqs[i].params for i in rows])
        noise = race_noise(
            probs,
            [seqs[i].generator for i in rows],
            self.generator(logits.device),
            one_launch=logits.device.type != "cpu",
        )
        drawn = argmax_rows(probs / noise)
        processed = None
        if keep_processed:
            processed = logits.clone()
            processed[_index(rows, logits.device)] = scaled
        if len(rows) == len(seqs):
            return drawn, processed
        chosen = argmax_rows(logits)  # the greedy rows'
        chosen[_index(rows, logits.device)] = drawn
        return chosen, processed


def _row_kinds(seqs: list[Sequence]) -> tuple[list[int], list[int], bool]:
    """In one pass over the rows (each parameters object read once in a run of rows sharing
    it, the usual case): the rows asking for log-probabilities, the rows drawn at a
    temperature (the others are greedy), and whether some row has a grammar."""
    lp_rows: list[int] = []
    drawn: list[int] = []
    grammars = False
    last, wants_lp, draws = None, False, False
    for i, seq in enumerate(seqs):
        p = seq.request.params
        if p is not last:
            last, wants_lp, draws = p, p.logprobs is not None, not p.is_greedy
        if wants_lp:
            lp_rows.append(i)
        if draws:
            drawn.append(i)
        if seq.grammar is not None:
            grammars = True
    return lp_rows, drawn, grammars


def race_noise(
    probs: torch.Tensor, generators: list[torch.Generator | None], engine: torch.Generator, one_launch: bool
) -> torch.Tensor:
    """The ``q ~ Exp(1)`` of the exponential race, one row per row of ``probs``: a row with a
    generator of its own (a seeded request) draws from it, a whole row at a time, so its
    draws do not depend on the batch; the others draw from ``engine``. On the host each
    row draws in turn (the order dfllm always had); with ``one_launch`` (a GPU) every row is
    first drawn from ``engine`` in one kernel and the seeded rows are then drawn again."""
    noise = torch.empty_like(probs)
    if one_launch:
        noise.exponential_(generator=engine)
    for j, gen in enumerate(generators):
        if gen is not None or not one_launch:
            noise[j].exponential_(generator=gen or engine)
    return noise


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]``: all of ``x`` when ``rows`` are all its rows, else gathered with an index
    moved to the device without waiting for it."""
    return x if rows == list(range(x.shape[0])) else x[_index(rows, x.device)]


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


def _logprob_values(logits: torch.Tensor, logprobs: bool) -> torch.Tensor:
    """What the log-probabilities handed back are made of: ``logits`` as log-probabilities, or
    (vLLM's ``*_logits`` modes) a copy of the logits themselves."""
    return torch.log_softmax(logits, dim=-1) if logprobs else logits.clone()


def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logits after temperature, top-k, top-p and min-p (-inf outside them), and its
    distribution."""
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).to(dev, non_blocking=True)
    logits = logits / temps.unsqueeze(1)
    top_k = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
    top_p = [p.top_p for p in params]
    if min(top_k) < logits.shape[1] or min(top_p) < 1.0:
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).to(dev, non_blocking=True).unsqueeze(1)
        keep = probs >= min_p * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits, probs


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf."""
    dev = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=dev).unsqueeze(0)
    remove = ranks >= torch.tensor(top_k).to(dev, non_blocking=True).unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(top_p, dtype=probs.dtype).to(dev, non_blocking=True).unsqueeze(1)
    remove |= (mass_before >= p) & (p < 1.0)  # top_p=1 keeps all (a saturated sum would drop some)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _logprob_payload(
    raw: torch.Tensor, token_ids: torch.Tensor, rows: list[int], seqs: list[Sequence]
) -> LogprobPayload:
    """The chosen tokens' log-probabilities and ranks, and each row's top-k (``raw``: the
    values of ``rows`` that ``logprobs_mode`` hands back), all on the device."""
    chosen = raw.gather(1, _rows(token_ids.unsqueeze(1), rows))
    ranks = (raw > chosen).sum(dim=1) + 1
    by_k: dict[int, list[int]] = {}
    for j, i in enumerate(rows):
        k = seqs[i].params.logprobs
        assert k is not None  # rows holds only the rows that asked for logprobs
        k = raw.shape[1] if k == -1 else k
        if k > 0:
            by_k.setdefault(k, []).append(j)
    top = []
    for k, positions in by_k.items():
        values, ids = _rows(raw, positions).topk(k, dim=-1)
        top.append((positions, values, ids))
    return LogprobPayload(rows, chosen.squeeze(1), ranks, top)
