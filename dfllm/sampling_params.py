"""Sampling parameters for text generation, with vLLM's field names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from dfllm.structured_outputs import StructuredOutputsParams

_MAX_N = 16384


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    The fields, their names and their defaults follow vLLM's ``SamplingParams``:

    - ``n``: number of completions returned for the prompt.
    - ``temperature``: 0 means greedy decoding; otherwise logits are divided by it (any
      non-negative value, as in vLLM).
    - ``top_p``, ``top_k`` (0 or -1 disables), ``min_p``: nucleus, top-k and min-p filtering.
    - ``seed``: a per-request seed. A seeded request yields the same text whatever else is
      in the batch. With ``n > 1`` completion ``i`` uses ``seed + i``.
    - ``stop``: strings that end the completion; they are cut from the text unless
      ``include_stop_str_in_output``.
    - ``stop_token_ids``: token ids that end the completion (kept in ``token_ids``; their
      text is left out of ``text`` unless ``include_stop_str_in_output``). An entry may also
      be a list of ids, a group: the completion ends when its tokens end with the group,
      ``stop_reason`` is the group as a string (``"[2318, 310, 2305]"``) and the group's
      text is left out likewise. Groups are checked before single ids, as in vLLM.
    - ``ignore_eos``: keep generating past the end-of-sequence token.
    - ``max_tokens`` (default 16) and ``min_tokens``: bounds on generated tokens.
    - ``logprobs``: return this many top log-probabilities per generated token (plus the
      sampled one); -1 returns the whole vocabulary. Log-probabilities are those of the
      model's raw distribution, before temperature, penalties and filtering.
    - ``presence_penalty``, ``frequency_penalty`` (over generated tokens, in [-2, 2]) and
      ``repetition_penalty`` (over prompt and generated tokens, > 0; 1 disables).
    - ``skip_special_tokens``: leave special tokens out of the text.
    - ``structured_outputs``: a :class:`~dfllm.StructuredOutputsParams` (or a dict of its
      fields) constraining the output to a JSON schema, a regex, a choice or a grammar.
    - ``detokenize``: False leaves ``text`` empty (token ids only; no stop strings then).
    - ``bad_words``: words never generated (each word's tokens, at the start of the text and
      after a space, as vLLM bans them: the last token of a word whose other tokens were just
      generated).
    - ``allowed_token_ids``: only these tokens may be generated.
    - ``logit_bias``: ``{token_id: bias}`` added to the logits before sampling.
    - ``truncate_prompt_tokens``: keep only the last k prompt tokens (-1: ``max_model_len``).
    - ``prompt_logprobs``: the log-probability of every prompt token given the ones before
      it (``RequestOutput.prompt_logprobs``: None for the first token, then a dict holding
      the prompt token and this many top alternatives; -1 the whole vocabulary). Such a
      request takes no prefix-cache hit, as in vLLM.
    - Per-request ``logits_processors`` and ``best_of`` other than ``n`` raise
      ``ValueError``: not supported (vLLM V1 refuses them as well).

    Invalid values raise ``ValueError`` naming the field, at construction time.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int | list[int]] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    detokenize: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    logits_processors: list | None = None
    best_of: int | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False, compare=False)
    _stop_ids: list[int] = field(default_factory=list, init=False, repr=False, compare=False)
    _stop_groups: list[tuple[int, ...]] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.seed == -1:
            self.seed = None
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif self.stop is None:
            self._stop_list = []
        else:
            self._stop_list = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict of its fields, "
                             f"got {type(self.structured_outputs).__name__}")
        self._validate()

    @classmethod
    def from_dict(cls, values: dict) -> SamplingParams:
        """Build from a plain dict (as held in a dataframe column); unknown keys raise."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"SamplingParams: unknown field(s) {unknown}")
        return cls(**values)

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list (``stop`` normalised)."""
        return self._stop_list

    @property
    def single_stop_token_ids(self) -> list[int]:
        """The entries of ``stop_token_ids`` that are single ids."""
        return self._stop_ids

    @property
    def stop_token_groups(self) -> list[tuple[int, ...]]:
        """The entries of ``stop_token_ids`` that are groups (token sequences)."""
        return self._stop_groups

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Every token id ``stop_token_ids`` mentions, singly or in a group."""
        return set(self._stop_ids).union(*self._stop_groups)

    @property
    def is_greedy(self) -> bool:
        """True when decoding takes the most likely token at every step."""
        return self.temperature == 0.0

    def _validate(self) -> None:
        _check_int("n", self.n, 1, _MAX_N)
        _check_float("temperature", self.temperature, 0.0, None)  # no upper bound, as in vLLM
        if 0.0 < self.temperature < 1e-2:
            self.temperature = 1e-2
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1, None)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**63 - 1)
        for s in self._stop_list:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop: every stop string must be a non-empty str, got {s!r}")
        self._stop_ids, self._stop_groups = [], []
        for t in self.stop_token_ids:
            if isinstance(t, (list, tuple)):
                if not t:
                    raise ValueError("stop_token_ids: a group of stop token ids must not be empty")
                for u in t:
                    _check_int("stop_token_ids", u, 0, None)
                self._stop_groups.append(tuple(t))
            else:
                _check_int("stop_token_ids", t, 0, None)
                self._stop_ids.append(t)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, -1, None)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, None, low_open=True)
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize must be a bool, got {self.detokenize!r}")
        if not self.detokenize and self._stop_list:
            raise ValueError("stop: stop strings are only supported when detokenize is True")
        if self.bad_words is not None:
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
            if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids: the list is empty (no token could be generated)")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, 0, None)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}  # JSON keys are text
            for t, bias in self.logit_bias.items():
                _check_int("logit_bias", t, 0, None)
                _check_float("logit_bias", bias, -math.inf, None)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, None)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, -1, None)
        if self.logits_processors:
            raise ValueError("logits_processors: per-request logits processors are not supported "
                             "(vLLM V1 does not support them either)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of is not supported (vLLM V1 removed it); got best_of={self.best_of}, n={self.n}")
        if self.n > 1 and self.is_greedy:
            raise ValueError("n: greedy sampling (temperature=0) gives one completion; set n=1")


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_float(
    name: str, value: object, low: float, high: float | None, *, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{name} must be finite, got {value}")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        left = "(" if low_open else "["
        bound = f"in {left}{low}, {high}]" if high is not None else f"{'>' if low_open else '>='} {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
