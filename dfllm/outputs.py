"""Result objects returned by :class:`dfllm.LLM`, with vLLM's names and fields."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    import torch

OutputT = TypeVar("OutputT")  # the outputs of one prompt of a pooling task


@dataclass
class Logprob:
    """Log-probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def token_first(
    token_id: int, logprob: float, rank: int, top: list[tuple[int, float, int]]
) -> list[tuple[int, float, int]]:
    """The entries of one position's logprobs dict in vLLM's order: the token that was chosen
    (sampled, or the prompt's) first, then the top-k ``(token id, logprob, rank)`` by rank
    without it; sampled and prompt logprobs both use this."""
    return [(token_id, logprob, rank)] + [entry for entry in top if entry[0] != token_id]


@dataclass(slots=True)
class RequestMetrics:
    """Timings of one request, as ``time.time()`` seconds.

    ``first_token_time - arrival_time`` is the time to first token; ``finished_time -
    arrival_time`` the end-to-end latency.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_in_queue(self) -> float | None:
        """Seconds between arrival and the first step that scheduled the request."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    ``finish_reason`` is ``"stop"`` (end-of-sequence token, stop token or stop string),
    ``"length"`` (``max_tokens`` or ``max_model_len`` reached) or ``"error"`` (the completion
    failed: ``error`` says why; after non-finite logits ``text`` and ``token_ids`` hold what
    was generated before, after an engine error they are empty); ``stop_reason`` is the stop
    string or stop token id that ended it, or None.

    ``structured_output_complete`` is None for an unconstrained request; for a request with
    ``structured_outputs`` it is True when ``text`` satisfies the constraint in full (the
    grammar ended it with ``finish_reason="stop"``, or it was complete when ``max_tokens``
    came), and False when generation stopped first (``max_tokens``, ``max_model_len``, a stop
    string): then ``text`` is a prefix of a valid output, not a valid output.

    ``reasoning_content`` (dfllm's; vLLM's offline outputs have no such field, its chat
    responses call it ``message.reasoning_content``/``reasoning``) is None unless the engine
    has a reasoning parser (``LLM(reasoning_parser="qwen3")``, :mod:`dfllm.reasoning`): then
    it holds the completion's reasoning (None when the parser finds none) and ``text`` only
    the answer (``""`` when there is none, e.g. the reasoning was cut short by ``max_tokens``).
    ``token_ids``, ``logprobs`` and ``finish_reason`` stay those of the whole generation,
    reasoning and end-of-reasoning token included.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    structured_output_complete: bool | None = None
    error: str | None = None
    reasoning_content: str | None = None

    def finished(self) -> bool:
        """True once the completion has a finish reason."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything produced for one prompt: its tokens and its ``n`` completions, and with
    ``SamplingParams.prompt_logprobs`` the prompt tokens' log-probabilities (None for the
    first token, then one ``{token_id: Logprob}`` per prompt token, the token itself first)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class RequestFailedError(RuntimeError):
    """Some requests of a call failed while every other one completed.

    Raised by ``LLM.generate``/``chat`` (naming the failed prompts by index) and by
    ``LLM.wait_for_completion`` (naming them by request id). ``outputs`` holds the call's
    outputs in input order, the other requests' complete and the failed ones' with
    ``finish_reason="error"`` and the reason in ``CompletionOutput.error``; ``failed`` lists
    the positions of the failed ones in ``outputs``.
    """

    def __init__(self, message: str, outputs: list[RequestOutput], failed: list[int]):
        super().__init__(message)
        self.outputs = outputs
        self.failed = failed


def failed_outputs(outputs: list[RequestOutput]) -> list[int]:
    """Positions of the outputs with a completion that ended with ``finish_reason="error"``."""
    return [i for i, o in enumerate(outputs) if any(c.finish_reason == "error" for c in o.outputs)]


def raise_for_errors(outputs: list[RequestOutput], name: Callable[[int], str]) -> list[RequestOutput]:
    """``outputs``, or ``RequestFailedError`` if any failed; ``name(i)`` names output ``i``
    in the message (e.g. "prompt 3")."""
    failed = failed_outputs(outputs)
    if not failed:
        return outputs
    lines = [
        f"{name(i)}: {next(c.error for c in outputs[i].outputs if c.finish_reason == 'error')}" for i in failed[:5]
    ]
    more = f"; and {len(failed) - 5} more" if len(failed) > 5 else ""
    raise RequestFailedError(
        f"{len(failed)} of {len(outputs)} requests failed (the others completed; their "
        f"outputs are in this error's .outputs): " + "; ".join(lines) + more,
        outputs,
        failed,
    )


# ---- pooling outputs ----------------------------------------------------------------------
@dataclass
class PoolingOutput:
    """The raw pooled tensor of one prompt (an embedding, class probabilities, or per-token states)."""

    data: torch.Tensor


@dataclass(frozen=True)
class RequestError:
    """Why one request failed while the others of its call completed (vLLM's
    ``vllm.outputs.RequestError``): ``code`` names the kind of failure, ``message`` says what
    failed, ``retryable`` is True when the same request may succeed if sent again.

    dfllm's codes: ``"lora_adapter_error"`` (a LoRA adapter that could not be read into a
    slot when its prompts ran), else the snake-case name of the exception's class."""

    code: str
    message: str
    retryable: bool = False

    @classmethod
    def from_exception(cls, exc: BaseException) -> RequestError:
        """The error of a request that failed with ``exc``."""
        name = type(exc).__name__.replace("LoRA", "Lora")  # LoRAAdapterError: lora_adapter_error
        return cls("".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(name)).lower(), str(exc))


@dataclass
class _PromptOutput(Generic[OutputT]):
    """What a pooling task produced for one prompt: its ``outputs`` (one kind per task).

    As vLLM's ``PoolingRequestOutput``: ``num_cached_tokens`` is how many prompt tokens were
    a prefix-cache hit (always 0: dfllm's pooling caches no prompt tokens); ``error`` is None,
    or for a prompt that failed while the others of its call completed (``finished=False``,
    its outputs empty or NaN) a :class:`RequestError` saying why.
    """

    request_id: str
    outputs: OutputT
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    error: RequestError | None = None


@dataclass
class PoolingRequestOutput(_PromptOutput[PoolingOutput]):
    """Everything produced for one pooling prompt."""


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(_PromptOutput[EmbeddingOutput]):
    pass


@dataclass
class ClassificationOutput:
    """Class probabilities (or logits with ``use_activation=False``) and the top label's name."""

    probs: list[float]
    label: str | None = None

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(_PromptOutput[ClassificationOutput]):
    pass


@dataclass
class ScoringOutput:
    """One pair's score; ``num_text_tokens`` (dfllm's, not in vLLM's) is how many prompt tokens
    each of the two texts has when they are embedded apart (a bi-encoder or late-interaction
    model: the output's ``prompt_token_ids`` are the first text's, the pad token if the
    tokenizer has one, then the second's), None when the pair is read as one prompt (a
    cross-encoder)."""

    score: float
    num_text_tokens: tuple[int, int] | None = field(default=None, compare=False)


@dataclass
class ScoringRequestOutput(_PromptOutput[ScoringOutput]):
    pass
