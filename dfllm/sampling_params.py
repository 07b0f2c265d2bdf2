"""Sampling parameters for text generation, with vLLM's field names and defaults."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from dfllm.errors import MAX_NESTING_DEPTH, array_as_list, invalid_field, nesting_depth
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
    - Per-request ``logits_processors`` raise ``ValueError``: not supported (vLLM V1 refuses
      them as well). ``best_of`` (at least ``n``) is accepted here, as by vLLM, and a
      ``best_of`` above ``n`` is refused by ``generate`` (vLLM V1: "vLLM V1 does not yet
      support best_of."), so that params built once fail per call as in vLLM.

    - ``spaces_between_special_tokens`` (vLLM's; default True) and ``extra_args`` (vLLM's, for
      plugins: kept, unused) are accepted; the text is what the tokenizer decodes, which with a
      fast tokenizer is what vLLM 0.32 gives either way. No field may nest containers more than
      :data:`~dfllm.errors.MAX_NESTING_DEPTH` levels deep.

    Normalised as vLLM's: ``logprobs=True``/``prompt_logprobs=True`` ask for 1; a greedy request
    (``temperature=0``) has ``top_p=1``, ``top_k=0``, ``min_p=0`` (checked first); repeated
    ``stop_token_ids`` and ``bad_words`` are dropped, the first occurrence kept.

    Invalid values raise :class:`~dfllm.errors.InvalidRequestError` (a ``ValueError``, vLLM's
    ``VLLMValidationError``) naming the field (``parameter``), at construction time, with
    vLLM's message first and dfllm's detail after it in parentheses.
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
    spaces_between_special_tokens: bool = True
    extra_args: dict[str, Any] | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False, compare=False)
    _stop_ids: list[int] = field(default_factory=list, init=False, repr=False, compare=False)
    _stop_groups: list[tuple[int, ...]] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for f in fields(self):  # every key of a request, and every message, walks the fields
            if f.init and f.name != "structured_outputs":  # checked by StructuredOutputsParams
                setattr(self, f.name, array_as_list(getattr(self, f.name)))
                if nesting_depth(getattr(self, f.name)) > MAX_NESTING_DEPTH:
                    raise invalid_field(
                        f.name, "...", f"{f.name} must be nested at most {MAX_NESTING_DEPTH} levels deep"
                    )
        if self.seed == -1:
            self.seed = None
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif self.stop is None:
            self._stop_list = []
        else:
            self._stop_list = list(_as_list("stop", self.stop, "a str or a list of str"))
        # as vLLM: duplicates dropped (first occurrence kept), a group compared as a tuple
        ids = _as_list("stop_token_ids", self.stop_token_ids or [], "a list of token ids")
        self.stop_token_ids = _dedupe(ids)
        if self.logprobs is True:  # as vLLM: True asks for 1
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams or a dict of its fields, "
                f"got {type(self.structured_outputs).__name__}"
            )
        self._validate()

    @classmethod
    def from_dict(cls, values: dict) -> SamplingParams:
        """Build from a plain dict (as held in a dataframe column); unknown keys raise."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(values) - known, key=repr)  # keys of any type (a dataframe cell's)
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
        _check_int("n", self.n, 1, _MAX_N, _vllm_n)
        _check_float(
            "temperature",
            self.temperature,
            0.0,
            None,  # no upper bound, as in vLLM V1
            vllm=lambda v: f"temperature must be {'non-negative' if math.isfinite(v) else 'a finite number'}, got {v}.",
        )
        if 0.0 < self.temperature < 1e-2:
            self.temperature = 1e-2
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True, vllm=lambda v: f"top_p must be in (0, 1], got {v}.")
        _check_int(
            "top_k",
            self.top_k,
            -1,
            None,
            lambda v: (
                f"top_k must be 0 (disable), or at least 1, got {v}."
                if _is_int(v)
                else f"top_k must be an integer, got {type(v).__name__}"
            ),
        )
        _check_float("min_p", self.min_p, 0.0, 1.0, vllm=lambda v: f"min_p must be in [0, 1], got {v}.")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**63 - 1)
        for s in self._stop_list:
            if not isinstance(s, str):
                raise invalid_field("stop", self.stop, f"stop must be a str or a list of str, got an entry {s!r}")
            if s == "":
                raise invalid_field(
                    "stop",
                    self.stop,
                    "stop cannot contain an empty string.",
                    f"stop: every stop string must be a non-empty str, got {s!r}",
                )
        self._stop_ids, self._stop_groups = [], []
        stop_token_ids = self.stop_token_ids or []
        for t in stop_token_ids:
            if isinstance(t, (list, tuple)):
                if not t:
                    raise invalid_field(
                        "stop_token_ids", t, "stop_token_ids: a group of stop token ids must not be empty"
                    )
                for u in t:
                    _check_int("stop_token_ids", u, 0, None, _vllm_stop_token_id(stop_token_ids))
                self._stop_groups.append(tuple(t))
            else:
                _check_int("stop_token_ids", t, 0, None, _vllm_stop_token_id(stop_token_ids))
                self._stop_ids.append(t)
        if not isinstance(self.ignore_eos, bool):
            raise invalid_field("ignore_eos", self.ignore_eos, f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None, lambda v: f"max_tokens must be at least 1, got {v}.")
        _check_int(
            "min_tokens",
            self.min_tokens,
            0,
            self.max_tokens,
            lambda v: (
                f"min_tokens must be greater than or equal to 0, got {v}."
                if not _is_int(v) or v < 0  # a value of the wrong type: dfllm's detail names it
                else f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {v}."
            ),
        )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, -1, None, lambda v: f"logprobs must be non-negative or -1, got {v}.")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), -2.0, 2.0, vllm=functools.partial(_outside_penalty_range, name))
        _check_float(
            "repetition_penalty",
            self.repetition_penalty,
            0.0,
            None,
            low_open=True,
            vllm=lambda v: (
                f"repetition_penalty must be {'greater than zero' if math.isfinite(v) else 'a finite number'}, got {v}."
            ),
        )
        if not isinstance(self.detokenize, bool):
            raise invalid_field("detokenize", self.detokenize, f"detokenize must be a bool, got {self.detokenize!r}")
        if not self.detokenize and self._stop_list:
            raise invalid_field(
                "stop",
                self.stop,
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.",
                "stop: stop strings are only supported when detokenize is True",
            )
        if self.bad_words is not None:
            words = (
                [self.bad_words]
                if isinstance(self.bad_words, str)
                else _as_list("bad_words", self.bad_words, "a str or a list of str")
            )
            self.bad_words = _dedupe(words)  # as vLLM
            if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                vllm = (
                    f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}"
                    if any(w == "" for w in self.bad_words)
                    else "bad_words entries must tokenize to at least one token."
                )
                raise invalid_field(
                    "bad_words", self.bad_words, vllm, f"bad_words must be non-empty strings, got {self.bad_words!r}"
                )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids, "a list of token ids")
            if not self.allowed_token_ids:
                raise invalid_field(
                    "allowed_token_ids",
                    [],
                    "allowed_token_ids is not None and empty!",
                    "allowed_token_ids: the list is empty (no token could be generated)",
                )
            for t in self.allowed_token_ids:
                _check_int(
                    "allowed_token_ids", t, 0, None, lambda v: "allowed_token_ids contains out-of-vocab token id!"
                )
        if self.logit_bias is not None:
            self._check_logit_bias()
        if self.truncate_prompt_tokens is not None and not (
            _is_int(self.truncate_prompt_tokens) and self.truncate_prompt_tokens == -1
        ):
            _check_int(
                "truncate_prompt_tokens",
                self.truncate_prompt_tokens,
                1,
                None,
                lambda v: f"truncate_prompt_tokens must be an integer >= 1 or -1, got {v}",
            )
        if self.prompt_logprobs is not None:
            _check_int(
                "prompt_logprobs",
                self.prompt_logprobs,
                -1,
                None,
                lambda v: f"prompt_logprobs must be non-negative or -1, got {v}.",
            )
        if self.logits_processors:
            raise invalid_field(
                "logits_processors",
                self.logits_processors,
                "vLLM V1 does not support per request user provided logits processors.",
                "logits_processors: per-request logits processors are not supported by dfllm either",
            )
        if self.best_of is not None:  # as vLLM V1: checked here; best_of > n is refused by generate
            _check_int(
                "best_of",
                self.best_of,
                1,
                None,
                lambda v: (
                    f"best_of must be at least 1, got {v}"
                    if _is_int(v)
                    else f"best_of must be an integer, got {type(v)}"
                ),
            )
            if self.best_of < self.n:
                raise invalid_field(
                    "best_of",
                    self.best_of,
                    f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}.",
                )
        if self.n > 1 and self.is_greedy:
            raise invalid_field(
                "n",
                self.n,
                f"n must be 1 when using greedy sampling, got {self.n}.",
                "n: greedy sampling (temperature=0) gives one completion; set n=1",
            )
        if self.is_greedy:  # as vLLM: greedy sampling has no top-p, top-k or min-p
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        if not isinstance(self.spaces_between_special_tokens, bool):
            raise invalid_field(
                "spaces_between_special_tokens",
                self.spaces_between_special_tokens,
                f"spaces_between_special_tokens must be a bool, got {self.spaces_between_special_tokens!r}",
            )
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict):
                raise invalid_field(
                    "extra_args", self.extra_args, f"extra_args must be a dict, got {type(self.extra_args).__name__}"
                )

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise invalid_field(
                "logit_bias",
                self.logit_bias,
                f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}",
            )
        bias: dict[int, float] = {}
        for k, b in self.logit_bias.items():  # JSON keys are text
            if not _intable(k):
                bad = [k for k in self.logit_bias if not _intable(k)]
                raise invalid_field(
                    "logit_bias",
                    bad,
                    f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}",
                )
            try:
                bias[int(k)] = float(b)
            except (TypeError, ValueError):
                raise invalid_field(
                    "logit_bias", b, f"logit_bias: the bias of token {k!r} must be a number, got {b!r}"
                ) from None
        for t, b in bias.items():
            _check_int(
                "logit_bias",
                t,
                0,
                None,
                lambda v: f"token_id(s) {[k for k in bias if k < 0]} in logit_bias contain out-of-vocab token ids.",
            )
            _check_float("logit_bias", b, -math.inf, None)
        self.logit_bias = bias

    def check_supported(self, what: str = "the request") -> None:
        """Refuse what dfllm, as vLLM V1, does not run although the params were built: a
        ``best_of`` above ``n``. :class:`~dfllm.errors.InvalidRequestError` naming ``what`` (e.g.
        "prompt 3"); raised by ``generate`` (the engine's input processor), not at
        construction, as vLLM does, so that params built once fail per call."""
        if self.best_of is not None and self.best_of > self.n:
            raise invalid_field(
                "best_of",
                self.best_of,
                "vLLM V1 does not yet support best_of.",
                f"{what}: best_of={self.best_of} with n={self.n}; dfllm returns the n completions it "
                "samples, with no best-of selection: set best_of=None or best_of=n",
            )


def _as_list(name: str, value: object, what: str = "a list of str") -> list:
    """``value`` (any iterable but a str, a bytes or a dict) as a list; otherwise an
    :class:`InvalidRequestError` naming the field (not Python's "'int' object is not iterable")."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise invalid_field(name, value, f"{name} must be {what}, got {type(value).__name__} {value!r}")
    return list(value)


def _dedupe(values: list) -> list:
    """``values`` without repeats, in first-occurrence order (a group compared as a tuple);
    an unhashable entry is kept for the checks to name."""
    seen: set = set()
    out = []
    for v in values:
        key = tuple(v) if isinstance(v, (list, tuple)) else v
        try:
            if key in seen:
                continue
            seen.add(key)
        except TypeError:
            pass
        out.append(v)
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _intable(value: object) -> bool:
    try:
        int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False
    return True


def _vllm_n(value: object) -> str:
    if not _is_int(value):
        return f"n must be an int, but is of type {type(value)}"
    assert isinstance(value, int)
    return f"n must be at least 1, got {value}." if value < 1 else f"n must be at most {_MAX_N}, got {value}."


def _vllm_stop_token_id(ids: list) -> Callable[[Any], str]:
    def text(value: object) -> str:
        if not _is_int(value):
            return f"stop_token_ids must contain only integers, got {ids}."
        return f"token_id(s) {[value]} in stop_token_ids contain out-of-vocab token ids."

    return text


def _check_int(name: str, value: object, low: int, high: int | None, vllm: Callable[[Any], str] | None = None) -> None:
    """``value`` an int in [low, high]; otherwise an :class:`InvalidRequestError` with vLLM's
    text (``vllm(value)``) first, then dfllm's."""
    if not _is_int(value):
        why = f"{name} must be an int, got {value!r}"
    else:
        assert isinstance(value, int)
        if low <= value and (high is None or value <= high):
            return
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        why = f"{name} must be {bound}, got {value}"
    raise invalid_field(name, value, vllm(value), why) if vllm is not None else invalid_field(name, value, why)


def _outside_penalty_range(name: str, value: object) -> str:
    return f"{name} must be in [-2, 2], got {value}."


def _check_float(
    name: str,
    value: object,
    low: float,
    high: float | None,
    *,
    low_open: bool = False,
    vllm: Callable[[Any], str] | None = None,
) -> None:
    """``value`` a finite number within the bounds; otherwise an :class:`InvalidRequestError`
    with vLLM's text (``vllm(value)``, for a number) first, then dfllm's."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid_field(name, value, f"{name} must be a number, got {value!r}")
    if math.isnan(value) or math.isinf(value):
        why = f"{name} must be finite, got {value}"
    else:
        too_low = value <= low if low_open else value < low
        if not too_low and (high is None or value <= high):
            return
        left = "(" if low_open else "["
        bound = f"in {left}{low}, {high}]" if high is not None else f"{'>' if low_open else '>='} {low}"
        why = f"{name} must be {bound}, got {value}"
    raise invalid_field(name, value, vllm(value), why) if vllm is not None else invalid_field(name, value, why)
