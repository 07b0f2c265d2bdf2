"""Answering OpenAI batch lines with the engines of this process: :func:`answer`.

``answer(lines, engines)`` takes parsed lines (:class:`~dfllm.jobs.openai_batch.BatchRequestInput`)
and an :class:`Engines` and gives one :class:`LineResult` per line, in order: the response
body, or the status and error of a line that cannot be answered. It is the per-line
pipeline of ``dfllm run-batch`` (each partition of the input calls it once for its lines)
and works the same in any process: on a Dask worker, or in the caller's.

- Generative lines (chat, completions) are rendered and checked by the engine's input
  processor (the same path as :meth:`dfllm.LLM.chat` and ``generate``: a prompt longer than
  the context, a bad constraint... is that line's 400), then handed to the process's driver
  thread in one call, so that they share the engine's continuous batches with each other
  and with every other partition running on the worker.
- Pooling lines (embeddings, score, rerank) run together in one pooling call per endpoint.
- A failure stays with its line. If the engine fails on a call, the call's lines are split
  in halves and run again until the lines that fail on their own are found: those get
  status 500 (400 for a request the pooling model refuses), every other line its
  response. A completion that ends with ``finish_reason="error"`` (non-finite logits) is
  its line's 500.

Without ``--model`` a chat or completions line runs on the bundled chat model and an
embeddings, score or rerank line on the bundled MiniLM; with a model, every line runs on
it, and a line whose endpoint the model does not serve (embeddings on a generative model)
gets a 400 saying so.

With a reasoning parser (``--reasoning-parser``, the ``reasoning_parser`` engine argument),
a chat line's message carries the reasoning in ``reasoning_content`` (and ``reasoning``) and
the answer alone in ``content``, as vLLM's chat responses do; a completions line's text stays
whole (reasoning, ``</think>`` and answer), as vLLM's completions responses do, while its
structured output still constrains only what follows the reasoning (:class:`WholeText`).

With a response cache (:class:`Engines`' ``cache``), the generative lines' requests go
through :func:`dfllm.tasks.response_cache.generate_cached`: a deterministic request
(greedy, or seeded) asked before on the same engine is answered from the cache, not the engine.

A beam search line (``use_beam_search: true``, see :mod:`dfllm.jobs.openai_requests`) is checked
by the same input processor, then searched (:func:`dfllm.beam_search.search_requests`) together
with every other beam search line of the call, while the sampled lines generate: each step of
the search is one call of the driver over every live beam of every such line, in the engine's
shared batches (the response cache is not used for the steps). Its ``n`` choices are the best
beams, best first (:func:`dfllm.beam_search.beam_outputs`). A failure is isolated to its lines
as above.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dfllm.beam_search import BeamSearchParams, beam_outputs, search_requests
from dfllm.errors import InvalidRequestError
from dfllm.jobs.openai_batch import BatchRequestInput
from dfllm.jobs.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    LineError,
    RerankRequest,
    ScoreRequest,
)
from dfllm.jobs.openai_responses import chat_completion, completion, embeddings, rerank, scores
from dfllm.outputs import RequestOutput
from dfllm.pooling_params import PoolingParams
from dfllm.reasoning import ReasoningParser
from dfllm.tasks.response_cache import ResponseCache, generate_cached
from dfllm.worker.driver import driver

GENERATIVE = ("chat", "completions")
POOLING = ("embeddings", "score", "rerank")
DEFAULT_POOLING_MODEL = "all-minilm-l6-v2"  # embeddings, score and rerank without --model
DEFAULT_CHAT_MODEL = "smollm2-135m-instruct"  # chat and completions without --model
URLS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "score": "/v1/score",
    "rerank": "/v1/rerank",
}


@dataclass(frozen=True)
class BatchOptions:
    """What, besides its lines, decides a batch job's answers: the model (None: the bundled
    default of each endpoint), the engine's keyword arguments (``LLM(...)``), the role of
    generated chat messages (vLLM's ``--response-role``) and the model name the responses
    give (default: the model as given)."""

    model: str | None = None
    engine_kwargs: tuple = ()
    response_role: str = "assistant"
    served_model_name: str | None = None

    def model_for(self, endpoint: str) -> str | None:
        """The model that answers ``endpoint``'s lines (None: the bundled chat model)."""
        if self.model is not None:
            return self.model
        return DEFAULT_POOLING_MODEL if endpoint in POOLING else None

    def model_name(self, endpoint: str) -> str:
        """The ``model`` of ``endpoint``'s response bodies."""
        return self.served_model_name or self.model_for(endpoint) or DEFAULT_CHAT_MODEL


@dataclass
class LineResult:
    """One line's answer: ``status_code`` 200 and its response ``body``, or the status and
    :class:`~dfllm.jobs.openai_requests.LineError`; prompt and generated token counts."""

    status_code: int
    body: dict | None = None
    error: LineError | None = None
    input_tokens: int = 0
    output_tokens: int = 0

    @classmethod
    def failed(cls, error: LineError) -> LineResult:
        return cls(error.status, error=error)


class UnsupportedEndpoint(LineError):
    """The job's model does not serve the line's endpoint."""


def unsupported_endpoint(endpoint: str, options: BatchOptions) -> UnsupportedEndpoint:
    """The error of a line whose endpoint the job's model does not serve (a generative
    endpoint on a pooling model, or a pooling endpoint on a generative one)."""
    model = options.model_name(endpoint)
    if endpoint in GENERATIVE:
        why = f"{model} is a pooling model (embeddings, score, rerank); chat and completions need a generative model"
    else:
        why = (
            f"{model} is a generative model; embeddings, score and rerank need an embedding model or a "
            "cross-encoder (run them in a job of their own, with such a --model or none)"
        )
    return UnsupportedEndpoint(
        f"Model does not support endpoint {URLS[endpoint]}: {why}", code="model_not_supported", param="body.model"
    )


@dataclass
class Generation:
    """A generative engine as lines use it: its input processor (call it holding ``lock``)
    and ``generate``, which runs checked requests in the driver's shared batches (through
    the response cache, if the job has one)."""

    processor: Any
    lock: threading.Lock
    generate: Callable[[list], list]
    decode: Callable[[list[int]], str]
    # beam search lines: the driver's generation without the response cache (their steps), the
    # engine's context length and end-of-sequence token
    run: Callable[[list], list] | None = None
    max_model_len: int = 0
    eos_token_id: int | None = None
    block_size: int = 16  # the engine's KV block (prefix-aware placement keys prompts by its blocks)

    @property
    def reasoning(self) -> bool:
        """Whether the engine has a reasoning parser (its outputs' text is the answer alone)."""
        return getattr(self.processor, "reasoning", None) is not None


@dataclass
class PoolingModel:
    """A pooling model as lines use it: ``call(fn)`` runs ``fn(llm)`` on the driver thread
    holding the engine's lock."""

    llm: Any
    lock: threading.Lock

    def call(self, fn: Callable[[Any], Any]) -> Any:
        with self.lock:
            return driver().call(lambda: fn(self.llm))


@dataclass
class Engines:
    """The engines a set of lines runs on: the process's cached engines (see
    :mod:`dfllm.worker.engine_cache`), leased on first use and held until :meth:`close`
    (use it as a context manager); ``cache``, the job's response cache (None: none)."""

    options: BatchOptions
    cache: ResponseCache | None = None
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    _entries: dict = field(default_factory=dict)

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._entries.clear()

    def _entry(self, endpoint: str):
        from dfllm.dashboard import ensure_installed
        from dfllm.worker.engine_cache import lease

        model = self.options.model_for(endpoint)
        if model not in self._entries:
            ensure_installed()  # on a Dask worker, the first engine brings the dashboard page
            self._entries[model] = self._stack.enter_context(lease(model, dict(self.options.engine_kwargs)))
        return self._entries[model]

    def generation(self, endpoint: str) -> Generation:
        """The generative engine of ``endpoint``; :class:`UnsupportedEndpoint` if the model is
        a pooling model."""
        entry = self._entry(endpoint)
        engine = entry.llm.engine
        if engine is None:
            raise unsupported_endpoint(endpoint, self.options)
        lock = entry.lock

        def decode(ids: list[int]) -> str:
            with lock:
                return engine.input_processor.tokenizer.decode(ids) if engine.input_processor.tokenizer else ""

        config, engine_kwargs, cache = entry.llm.config, self.options.engine_kwargs, self.cache

        def run(requests: list) -> list:
            return driver().generate(engine, lock, requests)

        def generate(requests: list) -> list:
            return generate_cached(cache, config, engine_kwargs, requests, run)[0]

        tokenizer = engine.input_processor.tokenizer
        eos = None if tokenizer is None else tokenizer.eos_token_id
        return Generation(
            engine.input_processor, lock, generate, decode, run, int(config.max_model_len), eos, int(config.block_size)
        )

    def pooling(self, endpoint: str) -> PoolingModel:
        """The pooling model of ``endpoint``; :class:`UnsupportedEndpoint` if the model is
        generative."""
        entry = self._entry(endpoint)
        if entry.llm.pooling_engine is None:
            raise unsupported_endpoint(endpoint, self.options)
        return PoolingModel(entry.llm, entry.lock)


# ---- the pipeline ---------------------------------------------------------------------------------------
def answer(lines: Sequence[BatchRequestInput], engines: Engines) -> list[LineResult]:
    """One :class:`LineResult` per line, in order (see the module docstring)."""
    results: list[LineResult | None] = [None] * len(lines)
    by_endpoint: dict[str, list[int]] = {}
    for i, line in enumerate(lines):
        by_endpoint.setdefault(line.endpoint, []).append(i)
    for endpoint, idx in by_endpoint.items():
        run = _generative if endpoint in GENERATIVE else _pooling
        try:
            answered = run(endpoint, [lines[i] for i in idx], engines)
        except UnsupportedEndpoint as exc:  # the job's model does not serve the endpoint: every line's error
            answered = [LineResult.failed(exc)] * len(idx)
        for i, r in zip(idx, answered):
            results[i] = r
    return [
        r if r is not None else LineResult.failed(LineError("not answered", status=500, code="engine_error"))
        for r in results
    ]


T = TypeVar("T")


def _isolating(groups: list[T], run: Callable[[list[T]], list]) -> list:
    """``run(groups)`` (one result per group); if it raises, each half again, down to the
    single groups that fail on their own, whose result is their exception."""
    try:
        return list(run(groups))
    except Exception as exc:  # noqa: BLE001  (any failure of the engine stays with the lines that cause it)
        if len(groups) == 1:
            return [exc]
        mid = len(groups) // 2
        return _isolating(groups[:mid], run) + _isolating(groups[mid:], run)


def as_line_error(exc: BaseException, pooling: bool = False) -> LineError:
    """The :class:`LineError` a line gets for ``exc``: a request the engine refuses is a 400
    naming its field, any other failure a 500."""
    if isinstance(exc, LineError):
        return exc
    if isinstance(exc, InvalidRequestError) or (pooling and isinstance(exc, ValueError)):
        parameter = getattr(exc, "parameter", None)
        return LineError(str(exc), param=f"body.{parameter}" if parameter else None)
    return LineError(f"the engine failed on this request: {type(exc).__name__}: {exc}", status=500, code="engine_error")


# ---- chat and completions ---------------------------------------------------------------------------------
def _generative(endpoint: str, lines: list[BatchRequestInput], engines: Engines) -> list[LineResult]:
    gen = engines.generation(endpoint)
    results: list[LineResult | None] = [None] * len(lines)
    planned: list[tuple[int, list]] = []
    beams: list[tuple[int, list]] = []  # the beam search lines
    for i, line in enumerate(lines):
        try:
            (planned if line.request.beam is None else beams).append((i, engine_requests(line.request, gen)))
        except Exception as exc:  # noqa: BLE001  (whatever a line's checks raise stays with the line)
            results[i] = LineResult.failed(as_line_error(exc))

    def run(groups: list[tuple[int, list]]) -> list[list]:
        return _split(gen.generate([r for _, reqs in groups for r in reqs]), [len(reqs) for _, reqs in groups])

    def search(groups: list[tuple[int, list]]) -> list[list]:
        return _beam_search([(lines[i].request, reqs) for i, reqs in groups], gen)

    with ThreadPoolExecutor(1) as pool:  # the beam search lines search while the others generate
        searched = pool.submit(_isolating, beams, search) if beams else None
        answered = list(zip(planned, _isolating(planned, run) if planned else []))
        answered += zip(beams, searched.result() if searched is not None else [])
    for (i, _), outs in answered:
        if isinstance(outs, Exception):
            results[i] = LineResult.failed(as_line_error(outs))
        else:
            results[i] = _generative_result(endpoint, lines[i], outs, engines.options, gen)
    return [r for r in results if r is not None]


def _beam_search(lines: list[tuple[Any, list]], gen: Generation) -> list[list[RequestOutput]]:
    """The outputs of beam search lines (each its request and its checked engine requests, one
    per prompt), one list per line with one output per prompt: every prompt searched together
    (:func:`dfllm.beam_search.search_requests`), its ``n`` completions the best beams."""
    assert gen.run is not None  # a generative engine's Generation (Engines.generation)
    flat = [(request, r) for request, reqs in lines for r in reqs]
    params = [_beam_params(request, r, gen.max_model_len) for request, r in flat]
    found = search_requests([r for _, r in flat], params, gen.run, gen.eos_token_id, gen.max_model_len)
    outputs = []
    for (request, r), p, best in zip(flat, params, found):
        skip = request.params.skip_special_tokens

        def decode(ids: list[int], skip: bool = skip) -> str:
            with gen.lock:
                tokenizer = gen.processor.tokenizer
                return str(tokenizer.decode(ids, skip_special_tokens=skip)) if tokenizer is not None else ""

        completions = beam_outputs(best, len(r.prompt_token_ids), p, gen.eos_token_id, decode)
        outputs.append(RequestOutput("beam-search", r.prompt, list(r.prompt_token_ids), completions, True))
    return _split(outputs, [len(reqs) for _, reqs in lines])


def _beam_params(request, checked, max_model_len: int) -> BeamSearchParams:
    """A beam search line's params for one of its checked prompts: at most its ``max_tokens``
    (a chat line without one: up to the context length), within the context left."""
    room = max(1, max_model_len - len(checked.prompt_token_ids))
    return dataclasses.replace(request.beam, max_tokens=min(request.params.max_tokens or room, room))


def engine_requests(request, gen: Generation) -> list:
    """The checked engine requests of one chat or completions request (as ``LLM.chat`` and
    ``LLM.generate`` check them): :class:`LineError` (or ``ValueError``) for one the engine
    refuses. Only ``gen``'s processor and lock are used (a dry run makes them too). A chat
    template that cannot render the conversation (it raises, as real templates do when the
    roles do not alternate; a syntax error; an undefined variable) is the line's 400, naming
    ``body.chat_template`` when the line gave the template, else ``body.messages``."""
    aliases = request.param_fields()
    if isinstance(request, ChatCompletionRequest):
        with gen.lock:
            rendered = _render(gen, request)
            return [_process(gen, rendered, request.params, "body.messages", "the conversation", aliases)]
    assert isinstance(request, CompletionRequest)
    with gen.lock:
        checked = [
            _process(
                gen,
                p,
                request.params,
                "body.prompt" + (f"[{k}]" if len(request.prompts) > 1 else ""),
                "the prompt" + (f" {k}" if len(request.prompts) > 1 else ""),
                aliases,
            )
            for k, p in enumerate(request.prompts)
        ]
    return [r if r.reasoning is None else dataclasses.replace(r, reasoning=WholeText(r.reasoning)) for r in checked]


class WholeText(ReasoningParser):
    """A reasoning parser that leaves the text whole: a completions line's, whose response
    text vLLM does not split (only its chat responses are). Everything else is ``parser``'s,
    so the line's structured output still engages after the reasoning, as in vLLM; its
    :attr:`key` differs from ``parser``'s, so the engine never merges the line with an
    identical chat request and the response cache never answers one with the other."""

    name = "whole-text"

    def __init__(self, parser: ReasoningParser):  # noqa: D107 (no tokenizer: nothing of its own to read)
        self.parser = parser
        self.chat_template_kwargs = parser.chat_template_kwargs

    @property
    def key(self) -> tuple:
        return ("whole-text", *self.parser.key)

    def for_request(self, chat_template_kwargs: Mapping[str, Any] | None) -> ReasoningParser:
        return WholeText(self.parser.for_request(chat_template_kwargs))

    def is_reasoning_end(self, input_ids: Seq[int]) -> bool:
        return self.parser.is_reasoning_end(input_ids)

    def is_reasoning_end_streaming(self, input_ids: Seq[int], delta_ids: Iterable[int]) -> bool:
        return self.parser.is_reasoning_end_streaming(input_ids, delta_ids)

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        return self.parser.extract_content_ids(input_ids)

    def count_reasoning_tokens(self, token_ids: Seq[int]) -> int:
        return self.parser.count_reasoning_tokens(token_ids)

    def extract_reasoning(self, model_output: str, request: Any = None) -> tuple[str | None, str | None]:
        return None, model_output


def _render(gen: Generation, request: ChatCompletionRequest):
    """The line's conversation rendered by the chat template (call holding ``gen.lock``)."""
    try:
        return gen.processor.render_chat(
            request.messages,
            request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs,
        )
    except InvalidRequestError:
        raise
    except Exception as exc:  # noqa: BLE001  (a template that cannot render this conversation: this line's 400)
        where = "body.chat_template" if request.chat_template is not None else "body.messages"
        raise LineError(
            f"{where}: the chat template cannot render this conversation ({type(exc).__name__}: {exc})",
            param=where,
        ) from None


def _process(gen: Generation, prompt, params, field_name: str, what: str, aliases: Mapping[str, str]):
    """``prompt`` checked by the engine's input processor; :class:`LineError` naming the body
    field at fault (``aliases``: the processor's name of a field -> the body's)."""
    try:
        return gen.processor.process(prompt, params, what=what)
    except InvalidRequestError as exc:
        param = exc.parameter
        if param is None and params.structured_outputs is not None and "(structured_outputs." in str(exc):
            param = "structured_outputs"  # the constraint did not compile for this tokenizer
        if param is not None and param in aliases:
            where = f"body.{aliases[param]}"
        elif param in (None, "prompt", "prompt_token_ids", "messages", "input_tokens", "input_text"):
            where = field_name
        else:
            where = f"body.{param}"
        raise LineError(f"{where}: {exc}", param=where) from None


def _generative_result(
    endpoint: str, line: BatchRequestInput, outputs: list, options: BatchOptions, gen: Generation
) -> LineResult:
    failed = [c for o in outputs for c in o.outputs if c.finish_reason == "error"]
    if failed:
        return LineResult.failed(
            LineError(f"generation failed: {failed[0].error or 'unknown error'}", status=500, code="engine_error")
        )
    request = line.request
    model = options.model_name(endpoint)
    if isinstance(request, ChatCompletionRequest):
        body = chat_completion(
            outputs[0],
            model=model,
            id=f"chatcmpl-{line.key}",
            role=options.response_role,
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
            reasoning=gen.reasoning,
        ).to_dict()
    else:
        if request.echo:
            for o in outputs:
                if o.prompt is None:  # given as token ids: their text
                    o.prompt = gen.decode(o.prompt_token_ids)
        body = completion(
            outputs, model=model, id=f"cmpl-{line.key}", echo=request.echo, logprobs=request.logprobs
        ).to_dict()
    usage = body["usage"]
    return LineResult(200, body, None, usage["prompt_tokens"], usage["completion_tokens"])


# ---- embeddings, score and rerank ----------------------------------------------------------------------------
def _pooling(endpoint: str, lines: list[BatchRequestInput], engines: Engines) -> list[LineResult]:
    model = engines.pooling(endpoint)
    name = engines.options.model_name(endpoint)
    groups = list(range(len(lines)))

    if endpoint == "embeddings":

        def run(group: list[int]) -> list:
            inputs = [p for i in group for p in lines[i].request.inputs]
            params = [
                PoolingParams(
                    truncate_prompt_tokens=lines[i].request.truncate_prompt_tokens,
                    dimensions=lines[i].request.dimensions,  # vLLM's Matryoshka truncation; the engine checks it
                )
                for i in group
                for _ in lines[i].request.inputs
            ]
            outs = model.call(lambda llm: llm.embed(inputs, params, use_tqdm=False))
            return _split(outs, [len(lines[i].request.inputs) for i in group])
    else:

        def run(group: list[int]) -> list:
            pairs = [p for i in group for p in _pairs(lines[i].request)]
            truncate = {lines[i].request.truncate_prompt_tokens for i in group}
            if len(truncate) > 1 and len(group) > 1:  # lines with different truncation: one call each
                raise ValueError("mixed truncation")
            params = PoolingParams(truncate_prompt_tokens=truncate.pop())
            outs = model.call(
                lambda llm: llm.score(
                    [a for a, _ in pairs], [b for _, b in pairs], use_tqdm=False, pooling_params=params
                )
            )
            return _split(outs, [len(_pairs(lines[i].request)) for i in group])

    results = []
    for i, outs in zip(groups, _isolating(groups, run)):
        if isinstance(outs, Exception):
            results.append(LineResult.failed(as_line_error(outs, pooling=True)))
            continue
        try:
            body = _pooling_body(endpoint, lines[i], outs, name)
        except LineError as exc:
            results.append(LineResult.failed(exc))
            continue
        results.append(LineResult(200, body, None, body["usage"]["prompt_tokens"], 0))
    return results


def _score_prompt_tokens(outs: list, one_query: bool) -> int:
    """vLLM's ``usage.prompt_tokens`` of a score or rerank line: a cross-encoder's pairs'
    tokens (each pair is read as one prompt); for a bi-encoder each text's tokens, counted as
    vLLM encodes them: every ``text_1`` and ``text_2`` entry, the single query of a 1-to-N
    line once (each output's ``num_text_tokens``, the engine's count of its two texts)."""
    counts = [o.outputs.num_text_tokens for o in outs]
    if any(c is None for c in counts):
        return sum(len(o.prompt_token_ids) for o in outs)
    total = sum(a + b for a, b in counts)
    if one_query and len(counts) > 1:
        total -= counts[0][0] * (len(counts) - 1)
    return total


def _pairs(request: ScoreRequest | RerankRequest) -> list[tuple[str, str]]:
    if isinstance(request, RerankRequest):
        return [(request.query, d) for d in request.documents]
    return request.pairs()


def _split(outs: list, sizes: list[int]) -> list[list]:
    """``outs`` cut into consecutive lists of ``sizes`` (each group's own outputs)."""
    out, at = [], 0
    for n in sizes:
        out.append(outs[at : at + n])
        at += n
    return out


def _pooling_body(endpoint: str, line: BatchRequestInput, outs: list, model: str) -> dict:
    request = line.request
    if isinstance(request, EmbeddingRequest):
        return embeddings(outs, model=model, encoding_format=request.encoding_format).to_dict()
    if isinstance(request, RerankRequest):
        return rerank(
            outs,
            request.documents,
            model=model,
            id=f"rerank-{line.key}",
            top_n=request.top_n,
            return_documents=request.return_documents,
            prompt_tokens=_score_prompt_tokens(outs, True),
        ).to_dict()
    one_query = len(request.text_1) == 1
    return scores(
        outs, model=model, id=f"score-{line.key}", prompt_tokens=_score_prompt_tokens(outs, one_query)
    ).to_dict()
