"""The response bodies of OpenAI's endpoints (and vLLM's score and rerank), built from
dfllm's outputs, as typed objects whose ``to_dict()`` is the JSON body.

:func:`chat_completion` takes what :meth:`dfllm.LLM.chat` returns for one conversation
(a :class:`~dfllm.RequestOutput`), so the same body comes out of ``LLM.chat`` and of a
batch line; :func:`completion`, :func:`embeddings`, :func:`scores` and :func:`rerank` do the
same for ``generate``, ``embed`` and ``score``. The shapes are those the ``openai`` package
parses (``ChatCompletion``, ``Completion``, ``CreateEmbeddingResponse``), plus vLLM's
``stop_reason`` on each choice; score and rerank bodies are vLLM's. A log-probability of
-inf (a token the sampling ruled out, with ``logprobs_mode="processed_logprobs"``) is written
``-9999.0`` (:data:`LOGPROB_FLOOR`), as vLLM's server writes it; any other non-finite number
(a NaN score or embedding value) is null in the JSON text (see
:func:`dfllm.jobs.openai_batch.strict_json`).
"""

from __future__ import annotations

import base64
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dfllm.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput, ScoringRequestOutput

#: The log-probability vLLM's server writes for -inf (which JSON cannot hold): OpenAI's stand-in.
LOGPROB_FLOOR = -9999.0


@dataclass
class Usage:
    """Token counts of one request: prompt, generated (0 for pooling) and their total."""

    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int = 0

    def __post_init__(self) -> None:
        self.total_tokens = self.prompt_tokens + self.completion_tokens


@dataclass
class _Body:
    def to_dict(self) -> dict:
        """The JSON body."""
        return dataclasses.asdict(self)


@dataclass
class ChatMessage(_Body):
    """The generated message of a chat choice; ``reasoning``: a thinking model's reasoning,
    given (under vLLM's names, see :func:`chat_completion`) only with a reasoning parser."""

    role: str
    content: str | None
    refusal: str | None = None
    tool_calls: list = field(default_factory=list)
    reasoning: str | None = None


@dataclass
class ChatChoice(_Body):
    index: int
    message: ChatMessage
    logprobs: dict | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class ChatCompletion(_Body):
    """A ``chat.completion`` body."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    split_reasoning: bool = False  # not in the body: whether the messages carry their reasoning

    def to_dict(self) -> dict:
        out = super().to_dict()
        split = out.pop("split_reasoning")
        for choice in out["choices"]:
            message = choice["message"]
            reasoning = message.pop("reasoning")
            if split:  # vLLM's field and its older name, which vLLM's messages carry both
                message["reasoning"] = message["reasoning_content"] = reasoning
        return out


@dataclass
class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: dict | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class Completion(_Body):
    """A ``text_completion`` body."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: str = "text_completion"


@dataclass
class Embedding(_Body):
    index: int
    embedding: list[float] | str  # a base64 string with encoding_format="base64"
    object: str = "embedding"


@dataclass
class EmbeddingList(_Body):
    """An embeddings body (``object: "list"``)."""

    data: list[Embedding]
    model: str
    usage: Usage
    object: str = "list"

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["usage"] = {"prompt_tokens": self.usage.prompt_tokens, "total_tokens": self.usage.total_tokens}
        return out


@dataclass
class ScoreData(_Body):
    index: int
    score: float
    object: str = "score"


@dataclass
class ScoreList(_Body):
    """vLLM's score body."""

    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage
    object: str = "list"


@dataclass
class RerankResult(_Body):
    index: int
    relevance_score: float
    document: dict | None = None


@dataclass
class RerankList(_Body):
    """vLLM's rerank body: the documents best first."""

    id: str
    model: str
    results: list[RerankResult]
    usage: Usage


# ---- builders ---------------------------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


def chat_completion(
    output: RequestOutput,
    *,
    model: str,
    id: str,
    role: str = "assistant",
    logprobs: bool = False,
    top_logprobs: int = 0,
    created: int | None = None,
    reasoning: bool = False,
) -> ChatCompletion:
    """The ``chat.completion`` body of one conversation's output (``LLM.chat(...)[i]``).

    ``reasoning``: the engine has a reasoning parser (``LLM(reasoning_parser=...)``), so each
    completion's ``text`` is its answer and ``reasoning_content`` its reasoning. Then, as in
    vLLM's chat responses, each message carries ``reasoning_content`` (and ``reasoning``,
    vLLM's newer name for it, with the same value; null when the parser found none) and
    ``content`` is the answer alone, null when there is none (the reasoning never ended).
    The usage counts every generated token, the reasoning's included."""
    choices = [
        ChatChoice(
            c.index,
            ChatMessage(role, (c.text or None) if reasoning else c.text, reasoning=c.reasoning_content),
            {"content": _chat_logprobs(c, top_logprobs), "refusal": None} if logprobs else None,
            c.finish_reason,
            c.stop_reason,
        )
        for c in output.outputs
    ]
    return ChatCompletion(
        id,
        created if created is not None else _now(),
        model,
        choices,
        Usage(len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs)),
        split_reasoning=reasoning,
    )


def completion(
    outputs: list[RequestOutput],
    *,
    model: str,
    id: str,
    echo: bool = False,
    logprobs: int | None = None,
    created: int | None = None,
) -> Completion:
    """The ``text_completion`` body of one request's prompts (``LLM.generate(...)``, one
    output per prompt): choice ``i * n + j`` is completion ``j`` of prompt ``i``."""
    choices: list[CompletionChoice] = []
    for out in outputs:
        for c in out.outputs:
            prefix = (out.prompt or "") if echo else ""
            choices.append(
                CompletionChoice(
                    len(choices),
                    prefix + c.text,
                    _completion_logprobs(c, logprobs) if logprobs is not None else None,
                    c.finish_reason,
                    c.stop_reason,
                )
            )
    return Completion(
        id,
        created if created is not None else _now(),
        model,
        choices,
        Usage(sum(len(o.prompt_token_ids) for o in outputs), sum(len(c.token_ids) for o in outputs for c in o.outputs)),
    )


def embeddings(outputs: list[EmbeddingRequestOutput], *, model: str, encoding_format: str = "float") -> EmbeddingList:
    """The embeddings body of one request's inputs (``LLM.embed(...)``)."""
    data = [Embedding(i, _encode(o.outputs.embedding, encoding_format)) for i, o in enumerate(outputs)]
    return EmbeddingList(data, model, Usage(sum(len(o.prompt_token_ids) for o in outputs)))


def scores(
    outputs: list[ScoringRequestOutput],
    *,
    model: str,
    id: str,
    created: int | None = None,
    prompt_tokens: int | None = None,
) -> ScoreList:
    """vLLM's score body of one request's pairs (``LLM.score(...)``); ``prompt_tokens``
    (default: the outputs' ``prompt_token_ids``) is its usage."""
    data = [ScoreData(i, float(o.outputs.score)) for i, o in enumerate(outputs)]
    return ScoreList(
        id,
        created if created is not None else _now(),
        model,
        data,
        Usage(sum(len(o.prompt_token_ids) for o in outputs) if prompt_tokens is None else prompt_tokens),
    )


def rerank(
    outputs: list[ScoringRequestOutput],
    documents: list[str],
    *,
    model: str,
    id: str,
    top_n: int = 0,
    return_documents: bool = True,
    prompt_tokens: int | None = None,
) -> RerankList:
    """vLLM's rerank body: ``LLM.score(query, documents)`` sorted best first, the first
    ``top_n`` (0: all)."""
    ranked = sorted(range(len(outputs)), key=lambda i: -float(outputs[i].outputs.score))
    if top_n:
        ranked = ranked[:top_n]
    results = [
        RerankResult(i, float(outputs[i].outputs.score), {"text": documents[i]} if return_documents else None)
        for i in ranked
    ]
    usage = sum(len(o.prompt_token_ids) for o in outputs) if prompt_tokens is None else prompt_tokens
    return RerankList(id, model, results, Usage(usage))


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI sends it
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


def _logprob(lp: Logprob | None) -> float | None:
    """A token's log-probability as vLLM's server writes it: at least :data:`LOGPROB_FLOOR`
    (a token the sampling ruled out, -inf, is ``-9999.0``); None for a token with none."""
    return None if lp is None else max(lp.logprob, LOGPROB_FLOOR)


def _token(lp: Logprob | None) -> str:
    return (lp.decoded_token if lp is not None else None) or ""


def _top(step: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely tokens of one step (by rank; the sampled token is in ``step``
    whatever its rank)."""
    ranked = sorted(step.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return [(t, lp) for t, lp in ranked if lp.rank is not None and lp.rank <= k][:k]


def _chat_logprobs(c: CompletionOutput, k: int) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content``: per generated token its text, log-probability, UTF-8
    bytes and the ``k`` most likely alternatives."""
    out = []
    for tid, step in zip(c.token_ids, c.logprobs or []):
        lp = step.get(tid)
        text = _token(lp)
        out.append(
            {
                "token": text,
                "logprob": _logprob(lp),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": _token(a), "logprob": _logprob(a), "bytes": list(_token(a).encode())}
                    for _, a in _top(step, k)
                ],
            }
        )
    return out


def _completion_logprobs(c: CompletionOutput, k: int) -> dict[str, list]:
    """The legacy completions ``logprobs``: tokens, their log-probabilities, the ``k`` most
    likely alternatives per token and each token's offset in the text."""
    tokens, values, tops, offsets = [], [], [], []
    offset = 0
    for tid, step in zip(c.token_ids, c.logprobs or []):
        lp = step.get(tid)
        text = _token(lp)
        tokens.append(text)
        values.append(_logprob(lp))
        tops.append({_token(a): _logprob(a) for _, a in _top(step, k)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
