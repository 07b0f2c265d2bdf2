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

With ``structured_outputs`` (vLLM's ``BeamSearchParams.structured_outputs``, as its offline
search has them) every beam's continuation is constrained: before each step the constraint's
grammar replays the beam's generated tokens and gives the tokens allowed next
(:meth:`dfllm.engine.structured.Grammar.allowed_after`); the step's request carries them as
``allowed_token_ids`` (when there are at most :data:`MAX_ALLOWED_TOKEN_IDS`, vLLM's cap), and
the candidates are the step's logprobs entries among them (the logprobs are the raw ones,
taken before any mask, so this filter is what enforces the grammar). A beam whose grammar has
terminated (it accepted an end-of-sequence token) is completed; one whose grammar allows no
token at all (:data:`~dfllm.engine.structured.GRAMMAR_DEAD_END`) is dropped, since it can never
satisfy the constraint. A prompt none of whose beams can go on has no sequence: ``LLM.beam_search``
raises :class:`BeamSearchError` naming it, and :func:`beam_outputs` gives it one completion with
``finish_reason="error"`` (:data:`NO_SEQUENCE`), that row's or line's error.

:func:`search_requests` runs the search over requests an engine's input processor checked
(the dataframe accessors' rows and ``dfllm run-batch``'s lines, through their own engine), and
:func:`beam_outputs` turns one prompt's best beams into completions as vLLM's OpenAI server
gives them: best first, the text and token ids of the continuation alone (without the
end-of-sequence token; the ids keep it with ``include_stop_str_in_output``),
``finish_reason="stop"`` (``stop_reason`` the end-of-sequence id) for a beam that ended with it,
else ``"length"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from dfllm.engine.structured import GRAMMAR_DEAD_END
from dfllm.errors import InvalidRequestError
from dfllm.outputs import CompletionOutput, Logprob, RequestOutput
from dfllm.sampling_params import SamplingParams
from dfllm.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from dfllm.engine.input_processor import EngineRequest

#: The error of a constrained prompt none of whose beams could go on.
NO_SEQUENCE = f"structured outputs: beam search found no sequence that satisfies the constraint: {GRAMMAR_DEAD_END}"

#: The most ``allowed_token_ids`` a constrained beam's step carries (vLLM's cap); past it the
#: step is unconstrained and only the candidates are filtered.
MAX_ALLOWED_TOKEN_IDS = 1024


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters: ``beam_width`` sequences kept, at most ``max_tokens``
    new tokens; ``ignore_eos`` keeps extending past the end-of-sequence token; ``temperature``
    of the step's draw (0: greedy; the candidates are the top-k either way, plus the drawn token);
    ``length_penalty`` the exponent of the length dividing the score; ``include_stop_str_in_output``
    is vLLM's (its server's; offline the text always holds every token, as vLLM's);
    ``structured_outputs`` constrains every beam's continuation (module docstring)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                # vLLM's words first (its _verify_num_sequences, for beam_width), then dfllm's
                vllm = (
                    f"{name} must be an int, but is of type {type(value)}"
                    if isinstance(value, bool) or not isinstance(value, int)
                    else f"{name} must be at least 1, got {value}."
                )
                raise InvalidRequestError(
                    f"{vllm} ({name} must be an int >= 1, got {value!r})", parameter=name, value=value
                )
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, int | float) or penalty != penalty:
            raise ValueError(f"length_penalty must be a number, got {penalty!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}"
            )

    def step_params(self, allowed_token_ids: list[int] | None = None) -> SamplingParams:
        """The params of one step of one beam: one token, ``2 * beam_width`` logprobs, the
        search's temperature; ``allowed_token_ids``: its constraint's next tokens."""
        return SamplingParams(
            logprobs=2 * self.beam_width,
            max_tokens=1,
            temperature=self.temperature,
            allowed_token_ids=allowed_token_ids,
        )

    def check_params(self) -> SamplingParams:
        """What an input processor checks a beam search's prompt with: a step's params with the
        search's ``max_tokens`` and ``structured_outputs`` (compiled there)."""
        return dataclasses.replace(
            self.step_params(), max_tokens=self.max_tokens, structured_outputs=self.structured_outputs
        )


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


@dataclass
class BeamStep:
    """One beam's next step: the beam, the index of its prompt, its search's params, and the
    tokens its constraint allows next (None: unconstrained)."""

    beam: BeamSearchSequence
    index: int
    params: BeamSearchParams
    allowed_token_ids: list[int] | None = None

    def sampling_params(self) -> SamplingParams:
        """The step's params (the allowed tokens only up to :data:`MAX_ALLOWED_TOKEN_IDS`)."""
        allowed = self.allowed_token_ids
        return self.params.step_params(
            allowed if allowed is not None and len(allowed) <= MAX_ALLOWED_TOKEN_IDS else None
        )


#: A prompt's constraint: the tokens allowed after a continuation (None: nothing may follow).
Constraint = Callable[[list[int]], "list[int] | None"]


def beam_search(
    step: Callable[[list[BeamStep]], list[dict[int, Logprob]]],
    prompts: list[list[int]],
    params: BeamSearchParams | Sequence[BeamSearchParams],
    eos_token_id: int | None,
    max_model_len: int,
    *,
    loras: list[Any] | None = None,
    concurrency_limit: int | None = None,
    use_tqdm: bool = False,
    constraints: Sequence[Constraint | None] | None = None,
) -> list[list[BeamSearchSequence]]:
    """The best sequences of each prompt (module docstring), their ``text`` unset;
    ``step(steps)`` returns the logprobs dict of each beam's next token. ``params`` is one
    search's for every prompt or one per prompt (their steps share each call of ``step``);
    ``constraints`` one per prompt (None: unconstrained)."""
    per_prompt = [params] * len(prompts) if isinstance(params, BeamSearchParams) else list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"beam_search: {len(per_prompt)} params for {len(prompts)} prompts")
    limits = constraints or [None] * len(prompts)

    def best(beams: list[BeamSearchSequence], p: BeamSearchParams) -> list[BeamSearchSequence]:
        def key(beam: BeamSearchSequence) -> float:
            return beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, p.length_penalty)

        return sorted(beams, key=key, reverse=True)[: p.beam_width]

    limit = concurrency_limit or len(prompts) or 1
    loras = loras or [None] * len(prompts)
    results: list[list[BeamSearchSequence]] = []
    for start in range(0, len(prompts), limit):
        batch = range(start, min(start + limit, len(prompts)))
        live = {i: [BeamSearchSequence(list(prompts[i]), [], loras[i])] for i in batch}
        done: dict[int, list[BeamSearchSequence]] = {i: [] for i in batch}
        steps = max(per_prompt[i].max_tokens for i in batch)
        for t in tqdm(range(steps), desc="Beam search", disable=not use_tqdm):
            todo: list[BeamStep] = []
            for i, beams in live.items():
                if t >= per_prompt[i].max_tokens:
                    continue
                kept = []
                constraint = limits[i]
                for beam in beams:
                    allowed = None if constraint is None else constraint(beam.tokens[len(prompts[i]) :])
                    if allowed == []:  # a dead end (GRAMMAR_DEAD_END): it can never satisfy the constraint
                        continue
                    if len(beam.tokens) >= max_model_len or (constraint is not None and not allowed):
                        if len(beam.tokens) > len(prompts[i]):  # cannot grow (context full, grammar done)
                            done[i].append(beam)
                        continue
                    kept.append(beam)
                    todo.append(BeamStep(beam, i, per_prompt[i], allowed))
                live[i] = kept
            if not todo:
                break
            candidates: dict[int, list[BeamSearchSequence]] = {s.index: [] for s in todo}
            for s, logprobs in zip(todo, step(todo)):
                allowed_set = None if s.allowed_token_ids is None else set(s.allowed_token_ids)
                for token, lp in logprobs.items():
                    if allowed_set is not None and token not in allowed_set:
                        continue
                    beam = s.beam
                    new = BeamSearchSequence(
                        beam.tokens + [token],
                        beam.logprobs + [logprobs],
                        beam.lora_request,
                        beam.cum_logprob + lp.logprob,
                    )
                    if token == eos_token_id and not s.params.ignore_eos:
                        new.finish_reason, new.stop_reason = "stop", eos_token_id
                        done[s.index].append(new)
                    else:
                        candidates[s.index].append(new)
            for i, found in candidates.items():
                live[i] = best(found, per_prompt[i])
        results += [best(done[i] + live[i], per_prompt[i]) for i in batch]
    return results


class BeamSearchError(RuntimeError):
    """A step of a beam search failed (its request ended with ``finish_reason="error"``), or
    (``LLM.beam_search``) some prompts found no sequence (:data:`NO_SEQUENCE`): ``outputs``
    then holds every prompt's output in input order (the failed ones' ``sequences`` empty) and
    ``failed`` their positions."""

    def __init__(self, message: str, outputs: list[BeamSearchOutput] | None = None, failed: list[int] | None = None):
        super().__init__(message)
        self.outputs = outputs
        self.failed = failed or []


def search_requests(
    requests: Sequence[EngineRequest],
    params: Sequence[BeamSearchParams],
    run: Callable[[list[EngineRequest]], list[RequestOutput]],
    eos_token_id: int | None,
    max_model_len: int,
) -> list[list[BeamSearchSequence]]:
    """The best beams of each request (checked by an engine's input processor with its
    params' :meth:`BeamSearchParams.check_params`: its ``grammar`` is the constraint), all
    searched together: each step is one call of ``run`` (the engine's generation of checked
    requests, in order) over every live beam of every request, each beam a copy of its
    request with the beam's tokens as prompt (its LoRA adapter kept) and the step's params.
    :class:`BeamSearchError` if a step fails."""

    def step(steps: list[BeamStep]) -> list[dict[int, Logprob]]:
        outs = run(
            [
                dataclasses.replace(
                    requests[s.index],
                    prompt=None,
                    prompt_token_ids=list(s.beam.tokens),
                    params=s.sampling_params(),
                    grammar=None,
                    reasoning=None,
                )
                for s in steps
            ]
        )
        found = []
        for o in outs:
            c = o.outputs[0]
            if c.finish_reason == "error" or not c.logprobs:
                raise BeamSearchError(f"a beam search step failed: {c.error or 'no token generated'}")
            found.append(c.logprobs[0])
        return found

    constraints = [None if r.grammar is None else r.grammar.allowed_after for r in requests]
    return beam_search(
        step,
        [list(r.prompt_token_ids) for r in requests],
        params,
        eos_token_id,
        max_model_len,
        constraints=constraints,
    )


def beam_outputs(
    beams: list[BeamSearchSequence],
    prompt_len: int,
    params: BeamSearchParams,
    eos_token_id: int | None,
    decode: Callable[[list[int]], str],
) -> list[CompletionOutput]:
    """One prompt's best beams as completions, best first, as vLLM's OpenAI server gives them
    (module docstring); ``decode`` turns token ids into text. A constrained beam's
    ``structured_output_complete`` is whether it ended with the end-of-sequence token (which
    its grammar allows only once complete)."""
    if not beams and params.structured_outputs is not None:  # every beam reached a dead end
        error = CompletionOutput(0, "", [], None, None, "error", structured_output_complete=False, error=NO_SEQUENCE)
        return [error]
    outputs = []
    for index, beam in enumerate(beams):
        generated = beam.tokens[prompt_len:]
        ended = beam.finish_reason == "stop"
        text_ids = generated[:-1] if ended and generated and generated[-1] == eos_token_id else generated
        token_ids = generated if params.include_stop_str_in_output else text_ids
        outputs.append(
            CompletionOutput(
                index,
                decode(text_ids),
                token_ids,
                beam.cum_logprob,
                beam.logprobs[: len(token_ids)],
                "stop" if ended else "length",
                beam.stop_reason if ended else None,
                structured_output_complete=None if params.structured_outputs is None else ended,
            )
        )
    return outputs
