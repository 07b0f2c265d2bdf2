"""Beam search, as vLLM's ``LLM.beam_search``: its parameters, its outputs and the search.

``LLM.beam_search(prompts, BeamSearchParams(beam_width, max_tokens, ...))`` keeps, for each
prompt, the ``beam_width`` best sequences. Each step runs one ``generate`` call of one token
over every live beam with ``logprobs=2 * beam_width`` (vLLM's, after transformers: twice the
width of candidates per beam), extends each beam by each token of its logprobs dict (the
sampled one first, then the top-k), moves a candidate ending in the end-of-sequence token to
the completed ones (unless ``ignore_eos``) and keeps the ``beam_width`` best of the others by
:func:`beam_search_score` (the cumulative log-probability divided by the sequence's length,
prompt included and a final end-of-sequence token not counted, to the power
``length_penalty``). After ``max_tokens`` steps, or when no beam is left, the completed and
live beams are ranked together and the best ``beam_width`` returned, each with its text
(the prompt's and the completion's tokens decoded, as vLLM's offline search does).

Beams are prompts of their own tokens: the engine's prefix cache shares their common
prefixes' KV blocks, so nothing is copied between beams. A beam that reaches
``max_model_len`` tokens cannot grow and is completed. ``concurrency_limit`` (vLLM's) runs the
prompts that many at a time (None: all at once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from dfllm.outputs import Logprob


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters: ``beam_width`` sequences kept, at most ``max_tokens``
    new tokens; ``ignore_eos`` keeps extending past the end-of-sequence token; ``temperature``
    of the step's draw (0: greedy; the candidates are the top-k either way, plus the drawn token);
    ``length_penalty`` the exponent of the length dividing the score; ``include_stop_str_in_output``
    is vLLM's (its server's; offline the text always holds every token, as vLLM's)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")


@dataclass
class BeamSearchSequence:
    """One beam: its ``tokens`` (the prompt's, then the generated ones), the logprobs dict of
    each generated position, and its cumulative log-probability; ``text`` is set on the
    sequences returned."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best sequences of one prompt, best first (at most ``beam_width``)."""

    sequences: list[BeamSearchSequence]


def beam_search_score(
    tokens: list[int], cumulative_logprob: float, eos_token_id: int | None, length_penalty: float = 1.0
) -> float:
    """vLLM's (and transformers') score of a beam: ``cumulative_logprob / length ** length_penalty``,
    the length counting the prompt and not a final end-of-sequence token."""
    length = len(tokens) - (tokens[-1] == eos_token_id)
    return cumulative_logprob / (length**length_penalty)


def beam_search(
    step: Callable[[list[BeamSearchSequence]], list[dict[int, Logprob]]],
    prompts: list[list[int]],
    params: BeamSearchParams,
    eos_token_id: int | None,
    max_model_len: int,
    *,
    loras: list[Any] | None = None,
    concurrency_limit: int | None = None,
    use_tqdm: bool = False,
) -> list[list[BeamSearchSequence]]:
    """The best sequences of each prompt (module docstring), their ``text`` unset;
    ``step(beams)`` returns the logprobs dict of each beam's next token."""

    def key(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, params.length_penalty)

    width, limit = params.beam_width, concurrency_limit or len(prompts) or 1
    loras = loras or [None] * len(prompts)
    results: list[list[BeamSearchSequence]] = []
    for start in range(0, len(prompts), limit):
        live = [
            [BeamSearchSequence(list(p), [], lora)] for p, lora in zip(prompts[start : start + limit], loras[start:])
        ]
        done: list[list[BeamSearchSequence]] = [[] for _ in live]
        for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
            for beams, completed in zip(live, done):  # a beam at max_model_len cannot grow
                completed += [b for b in beams if len(b.tokens) >= max_model_len]
                beams[:] = [b for b in beams if len(b.tokens) < max_model_len]
            growing = [b for beams in live for b in beams]
            if not growing:
                break
            found = iter(step(growing))
            for i, beams in enumerate(live):
                candidates: list[BeamSearchSequence] = []
                for beam in beams:
                    logprobs = next(found)
                    for token, lp in logprobs.items():
                        new = BeamSearchSequence(
                            beam.tokens + [token],
                            beam.logprobs + [logprobs],
                            beam.lora_request,
                            beam.cum_logprob + lp.logprob,
                        )
                        (done[i] if token == eos_token_id and not params.ignore_eos else candidates).append(new)
                live[i] = sorted(candidates, key=key, reverse=True)[:width]
        results += [sorted(completed + beams, key=key, reverse=True)[:width] for beams, completed in zip(live, done)]
    return results
