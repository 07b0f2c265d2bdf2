"""The pooling half of :class:`dfllm.LLM`: ``embed``, ``classify``, ``score`` and ``encode``,
and the request queue (``enqueue``/``wait_for_completion``) of a pooling model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from tqdm.auto import tqdm

from dfllm.engine.input_processor import PoolingRequest, score_pairs
from dfllm.engine.pooling_engine import PoolingEngine, PoolingFailedError
from dfllm.errors import InvalidRequestError
from dfllm.lora.request import LoRARequest, per_prompt
from dfllm.models.colbert import maxsim
from dfllm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestError,
    RequestFailedError,
    ScoringOutput,
    ScoringRequestOutput,
)
from dfllm.pooling_params import POOLING_TASKS, PoolingParams


def check_pooling_task(pooling_task: str | None) -> str:
    """``pooling_task`` of ``encode``, or :class:`~dfllm.errors.InvalidRequestError` if it is
    not one of :data:`POOLING_TASKS` (starting with vLLM's words)."""
    if pooling_task not in POOLING_TASKS:
        # vLLM 0.32: "pooling_task required for `LLM.encode`. ..." for None, else "Unsupported task: 'x' ..."
        vllm = (
            "pooling_task required for `LLM.encode`." if pooling_task is None else f"Unsupported task: {pooling_task!r}"
        )
        raise InvalidRequestError(
            f"{vllm} pooling_task must be one of {POOLING_TASKS}, got {pooling_task!r}",
            parameter="pooling_task",
            value=pooling_task,
        )
    return pooling_task


def truncation(truncate_prompt_tokens: int | None, tokenization_kwargs: dict[str, Any] | None) -> int | None:
    """A pooling call's truncation size: vLLM's current ``tokenization_kwargs={"truncate_prompt_tokens": N}``,
    else its older ``truncate_prompt_tokens=N`` argument (-1: ``max_model_len``; above it is refused when
    the prompts are read). Other tokenization keys are refused by name, as is a clash of the two forms."""
    kwargs = dict(tokenization_kwargs or {})
    size = kwargs.pop("truncate_prompt_tokens", truncate_prompt_tokens)
    if kwargs:
        raise InvalidRequestError(
            f"tokenization_kwargs {sorted(kwargs)} are not supported by dfllm (it takes 'truncate_prompt_tokens')",
            parameter="tokenization_kwargs",
            value=sorted(kwargs),
        )
    if truncate_prompt_tokens is not None and size != truncate_prompt_tokens:
        raise InvalidRequestError(
            f"truncate_prompt_tokens={truncate_prompt_tokens} and tokenization_kwargs' {size} differ: give one",
            parameter="truncate_prompt_tokens",
            value=truncate_prompt_tokens,
        )
    return size


def not_pooling_error(task: str) -> InvalidRequestError:
    """The error for a pooling method (``task``) called on a generative model."""
    return InvalidRequestError(
        f"{task}: this is a generative model; load a pooling model "
        "(an embedding model, a classifier, or LLM(..., runner='pooling')). "
        "This model does not support pooling"
    )


@dataclass
class _Queued:
    """A checked pooling request waiting for :meth:`PoolingFrontend.wait_for_completion`."""

    request_id: str
    request: PoolingRequest
    task: str


class PoolingFrontend:
    """Pooling requests (vLLM's ``encode``/``embed``/``classify``/``score``) on a pooling
    engine: prompts are checked, tokenized and truncated by the engine's input processor
    (as ``LLM.generate``'s); ``next_id`` names the requests."""

    def __init__(self, engine: PoolingEngine, next_id: Callable[[], str]):
        self.engine = engine
        self.processor = engine.input_processor
        self._next_id = next_id
        self._queued: list[_Queued] = []  # enqueued, not yet waited for; in enqueue order

    def encode(
        self,
        prompts,
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
        *,
        pooling_task: str | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Raw pooled tensors: ``pooling_task`` is "embed", "classify" or "token_embed" (required;
        "token_embed" gives a ``[tokens, dim]`` tensor per prompt, see :mod:`dfllm.engine.pooling_engine`).

        ``lora_request`` (vLLM's; a decoder with ``runner="pooling"`` and ``enable_lora=True``):
        one :class:`~dfllm.lora.request.LoRARequest` for every prompt, or a list with one per
        prompt (None: the base model).

        ``tokenization_kwargs={"truncate_prompt_tokens": N}`` (vLLM's form; the older
        ``truncate_prompt_tokens=N`` works too, on ``embed``/``classify``/``score`` as well) keeps
        at most N tokens of each prompt (-1: ``max_model_len``; more than ``max_model_len`` is
        refused with vLLM's message).

        Every prompt is checked before any work starts; a bad one (or params whose ``task``
        is another one, or an adapter that cannot run) raises
        :class:`~dfllm.errors.InvalidRequestError` naming its index."""
        task = check_pooling_task(pooling_task)
        truncate = truncation(truncate_prompt_tokens, tokenization_kwargs)
        outs, errors = self._encode(task, prompts, pooling_params, use_tqdm, truncate, lora_request)
        return _raise_failed(outs, errors)

    def embed(
        self,
        prompts,
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding (a list of floats) per prompt, in input order; ``lora_request`` as in
        :meth:`encode`."""
        truncate = truncation(truncate_prompt_tokens, tokenization_kwargs)
        outs, errors = self._encode("embed", prompts, pooling_params, use_tqdm, truncate, lora_request)
        return _raise_failed(
            [
                EmbeddingRequestOutput(
                    o.request_id,
                    EmbeddingOutput(o.outputs.data.tolist()),
                    o.prompt_token_ids,
                    o.finished,
                    o.num_cached_tokens,
                    o.error,
                )
                for o in outs
            ],
            errors,
        )

    def classify(
        self,
        prompts,
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt; ``outputs.label`` names the most likely class
        (``id2label``); ``lora_request`` as in :meth:`encode`."""
        truncate = truncation(truncate_prompt_tokens, tokenization_kwargs)
        outs, errors = self._encode("classify", prompts, pooling_params, use_tqdm, truncate, lora_request)
        id2label = self.engine.cfg.model.id2label or {}
        return _raise_failed(
            [
                ClassificationRequestOutput(
                    o.request_id,
                    ClassificationOutput(
                        o.outputs.data.tolist(),
                        id2label.get(int(o.outputs.data.argmax())) if o.finished else None,
                    ),
                    o.prompt_token_ids,
                    o.finished,
                    o.num_cached_tokens,
                    o.error,
                )
                for o in outs
            ],
            errors,
        )

    def score(
        self,
        data_1,
        data_2,
        /,
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[ScoringRequestOutput]:
        """Similarity of text pairs: one to one, one to many, or many to many (pairwise);
        ``lora_request``: one adapter every text runs with (as in :meth:`encode`).

        A cross-encoder (a sequence classifier with one label) reads each pair together and
        its sigmoid is the score; a late-interaction (ColBERT) model scores by MaxSim over
        the two texts' normalised token vectors (the sum over the first text's tokens of the
        best dot product with any token of the second); any other embedding model scores by
        the cosine similarity of the two embeddings (then, as vLLM's, each output's
        ``prompt_token_ids`` are the two texts' joined by the pad token, its
        ``outputs.num_text_tokens`` how many each text has, and its ``request_id`` the two
        embedding requests' ids joined by "_").

        ``lora_request``: an adapter that cannot be read into a slot when its texts run fails
        their pairs (:class:`~dfllm.outputs.RequestFailedError`, as in :meth:`encode`).
        """
        left, right = score_pairs(data_1, data_2)
        truncate_prompt_tokens = truncation(truncate_prompt_tokens, tokenization_kwargs)
        params = pooling_params or PoolingParams()
        self.require("score")
        if self.processor.tokenizer is None:
            raise InvalidRequestError(
                "You cannot pass text prompts when `skip_tokenizer_init` is True (score "
                "reads texts; this LLM has no tokenizer)",
                parameter="prompt",
            )
        if isinstance(lora_request, list | tuple):
            raise InvalidRequestError(
                "score: lora_request takes one LoRARequest (every text runs with it), "
                f"got a {type(lora_request).__name__}",
                parameter="lora_request",
            )
        self._loras(lora_request, 1)  # checked before any work
        pooling_task = (
            "classify" if self.engine.num_labels == 1 else "token_embed" if self.engine.late_interaction else "embed"
        )
        if params.task is not None and params.task != pooling_task:
            # vLLM 0.32's words (vllm/entrypoints/pooling/offline.py, ``score``), then dfllm's
            raise InvalidRequestError(
                f"You cannot overwrite pooling_params.task={params.task!r} with pooling_task={pooling_task!r}! "
                f"(score on this model runs {pooling_task!r}; leave PoolingParams.task unset)",
                parameter="task",
                value=params.task,
            )
        if self.engine.num_labels == 1:
            return self._cross_encode(left, right, params, truncate_prompt_tokens, use_tqdm, lora_request)
        late = self.engine.late_interaction  # token vectors and MaxSim; else one normalised vector and a dot
        unique = list(dict.fromkeys(left + right))  # a 1-to-N query is encoded once
        vectors = PoolingParams(
            normalize=True, truncate_prompt_tokens=params.truncate_prompt_tokens, dimensions=params.dimensions
        )
        task = "token_embed" if late else "embed"
        outs, errors = self._encode(task, unique, vectors, use_tqdm, truncate_prompt_tokens, lora_request)
        by_text = dict(zip(unique, outs))
        pad = self.processor.tokenizer.pad_token_id  # vLLM joins the two texts' tokens with it
        sep = [] if pad is None else [pad]
        scores = [
            ScoringRequestOutput(
                f"{a.request_id}_{b.request_id}",
                ScoringOutput(
                    float("nan")
                    if not (a.finished and b.finished)
                    else maxsim(a.outputs.data, b.outputs.data)
                    if late
                    else float(a.outputs.data @ b.outputs.data),
                    (len(a.prompt_token_ids), len(b.prompt_token_ids)),
                ),
                a.prompt_token_ids + sep + b.prompt_token_ids,
                a.finished and b.finished,
                a.num_cached_tokens + b.num_cached_tokens,
                a.error or b.error,
            )
            for a, b in ((by_text[x], by_text[y]) for x, y in zip(left, right))
        ]
        pos = {text: i for i, text in enumerate(unique)}
        failed = {
            k: errors.get(pos[x], errors.get(pos[y]))
            for k, (x, y) in enumerate(zip(left, right))
            if pos[x] in errors or pos[y] in errors
        }
        return _raise_failed(scores, cast(dict[int, BaseException], failed))

    def require(self, task: str) -> str:
        """``task``, or :class:`~dfllm.errors.InvalidRequestError` if the model does not serve
        it (e.g. "classify" on an embedder), starting with vLLM's words."""
        if task not in self.engine.supported_tasks:
            # vLLM 0.32's messages for the same calls
            embed = "Embedding API is not supported by this model. Try converting the model using `--convert embed`."
            vllm = {
                "embed": embed,
                "token_embed": embed,
                "classify": "Classification API is not supported by this model. "
                "Try converting the model using `--convert classify`.",
                "score": "Scoring API is only enabled for num_labels == 1."
                if self.engine.num_labels
                else "This model does not support the Scoring API.",
            }[task]
            labels = self.engine.num_labels
            kind = (
                f"a classifier with {labels} labels"
                if labels
                else "a late-interaction (ColBERT) model"
                if self.engine.late_interaction
                else "an embedding model"
            )
            raise InvalidRequestError(
                f"{vllm} {task} is not supported by this model, {kind} (it supports "
                f"{', '.join(self.engine.supported_tasks)}); score needs an embedding "
                f"model or a cross-encoder (one label). Unsupported task: {task!r}",
                parameter="task",
                value=task,
            )
        return task

    # ---- the queue ------------------------------------------------------------------------
    def enqueue(
        self,
        prompts,
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[str]:
        """Queue prompts without running them; return their request ids.

        Each prompt is checked (and tokenized, and truncated) now, as ``encode`` checks it: a
        bad one raises :class:`~dfllm.errors.InvalidRequestError` naming its index and
        nothing of the call is queued. A request computes its params' ``task``, or when that
        is None the model's own task: "embed" for an embedding model, "classify" for a
        classifier or cross-encoder (a task the model does not serve is refused here).
        """
        requests = self.processor.process_pooling(prompts, pooling_params, truncate_prompt_tokens)
        tasks = [self.require(r.params.task or self.engine.supported_tasks[0]) for r in requests]
        for r, t in zip(requests, tasks):
            self.engine.check_params(r.params, t)
        queued = [_Queued(self._next_id(), r, t) for r, t in zip(requests, tasks)]
        self._queued += queued
        return [q.request_id for q in queued]

    def has_queued(self) -> bool:
        """True while some enqueued request has not been returned by :meth:`wait_for_completion`."""
        return bool(self._queued)

    def wait_for_completion(self, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Run every queued request; one :class:`~dfllm.outputs.PoolingRequestOutput` each
        (its raw tensor, as ``encode`` returns), in enqueue order, each returned once.

        Requests of the same task run batched together, whichever ``enqueue`` call queued
        them. If a batch raises, its requests are run again one at a time; one that still
        raises does not stop the others: once all are done the call raises
        :class:`~dfllm.outputs.RequestFailedError` (a ``RuntimeError``) naming the failed
        ones by request id, with every output in its ``outputs`` (a failed one's is
        ``finished=False`` with an empty tensor) and their positions in ``failed``. If the
        call is interrupted (``KeyboardInterrupt``) the requests stay queued.
        """
        queued, self._queued = self._queued, []
        try:
            results, errors = self._run_queued(queued, use_tqdm)
        except BaseException:
            self._queued = queued + self._queued
            raise
        outputs = [
            PoolingRequestOutput(
                q.request_id,
                PoolingOutput(results.get(q.request_id, torch.empty(0))),
                q.request.prompt_token_ids,
                finished=q.request_id not in errors,
                num_cached_tokens=0,  # dfllm's pooling caches no prompt tokens
                error=RequestError.from_exception(errors[q.request_id]) if q.request_id in errors else None,
            )
            for q in queued
        ]
        failed = [i for i, q in enumerate(queued) if q.request_id in errors]
        if failed:
            lines = [f"request {queued[i].request_id}: {errors[queued[i].request_id]!r}" for i in failed[:5]]
            more = f"; and {len(failed) - 5} more" if len(failed) > 5 else ""
            raise RequestFailedError(
                f"{len(failed)} of {len(queued)} requests failed (the others completed; their outputs are in this "
                "error's .outputs): " + "; ".join(lines) + more,
                outputs,  # type: ignore[arg-type]  # pooling outputs, same contract
                failed,
            )
        return outputs

    def _run_queued(
        self, queued: list[_Queued], use_tqdm: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, BaseException]]:
        """Pool ``queued``, batched by task; (request id -> tensor, request id -> error)."""
        results: dict[str, torch.Tensor] = {}
        errors: dict[str, BaseException] = {}
        by_task: dict[str, list[_Queued]] = {}
        for q in queued:
            by_task.setdefault(q.task, []).append(q)
        bar = tqdm(total=len(queued), desc="Pooling (queued requests)", dynamic_ncols=True, disable=not use_tqdm)
        try:
            for task, items in by_task.items():
                start = bar.n
                try:
                    data = self.engine.encode([q.request for q in items], task, on_batch=bar.update)
                    results.update((q.request_id, d) for q, d in zip(items, data))
                    continue
                except Exception:  # which request caused it is found below, one at a time
                    bar.n = start
                for q in items:
                    try:
                        results[q.request_id] = self.engine.encode([q.request], task)[0]
                    except Exception as exc:  # this request fails on its own: its error, the others go on
                        errors[q.request_id] = exc
                    bar.update(1)
        finally:
            bar.close()
        return results, errors

    # ---- helpers ----------------------------------------------------------------------
    def _loras(self, lora_request, num_prompts: int) -> list[LoRARequest | None] | None:
        """vLLM's ``lora_request`` as one adapter (or None) per prompt, each checked now
        (:class:`~dfllm.errors.InvalidRequestError` naming the adapter and why); None if none."""
        if lora_request is None:
            return None
        loras = per_prompt(lora_request, num_prompts)
        checked: set[int] = set()
        for i, lora in enumerate(loras):
            if lora is not None and id(lora) not in checked:
                self.engine.check_lora(lora, f"lora_request (prompt {i})")
                checked.add(id(lora))
        return loras if any(lora is not None for lora in loras) else None

    def _check_params(self, requests: list[PoolingRequest], task: str) -> None:
        """Each request's params can run ``task`` on this model (``dimensions``), else
        :class:`~dfllm.errors.InvalidRequestError` with vLLM's message."""
        checked: set[int] = set()
        for r in requests:
            if id(r.params) not in checked:
                self.engine.check_params(r.params, task)
                checked.add(id(r.params))

    def _encode(
        self, task: str, prompts, pooling_params, use_tqdm: bool, truncate_prompt_tokens, lora_request
    ) -> tuple[list[PoolingRequestOutput], dict[int, BaseException]]:
        """:meth:`encode` of a checked ``task`` name (refused here if the model does not serve it):
        the outputs, and the error of each failed prompt by index (its output ``finished=False``
        with an empty tensor)."""
        task = self.require(task)
        requests = self.processor.process_pooling(prompts, pooling_params, truncate_prompt_tokens, task)
        self._check_params(requests, task)
        data, errors = self._pool(requests, task, use_tqdm, self._loras(lora_request, len(requests)))
        return [
            PoolingRequestOutput(
                self._next_id(),
                PoolingOutput(torch.empty(0) if d is None else d),
                r.prompt_token_ids,
                d is not None,
                0,  # num_cached_tokens: dfllm's pooling caches no prompt tokens
                RequestError.from_exception(errors[i]) if i in errors else None,
            )
            for i, (d, r) in enumerate(zip(data, requests))
        ], errors

    def _cross_encode(self, left, right, params, truncate_prompt_tokens, use_tqdm, lora_request=None):
        requests = self.processor.process_pairs(left, right, params, truncate_prompt_tokens, self.engine.is_decoder)
        self._check_params(requests, "classify")
        data, errors = self._pool(
            requests, "classify", use_tqdm, None if lora_request is None else [lora_request] * len(left)
        )
        return _raise_failed(
            [
                ScoringRequestOutput(
                    self._next_id(),
                    ScoringOutput(float("nan") if d is None else float(d[0])),
                    r.prompt_token_ids,
                    d is not None,
                    0,
                    RequestError.from_exception(errors[i]) if i in errors else None,
                )
                for i, (d, r) in enumerate(zip(data, requests))
            ],
            errors,
        )

    def _pool(
        self, requests: list[PoolingRequest], task: str, use_tqdm: bool, loras=None
    ) -> tuple[list[torch.Tensor | None], dict[int, BaseException]]:
        """Each request's tensor (None for a failed one), and each failed one's error by index."""
        bar = tqdm(total=len(requests), desc=f"Pooling ({task})", dynamic_ncols=True, disable=not use_tqdm)
        try:
            return list(self.engine.encode(requests, task, on_batch=bar.update, loras=loras)), {}
        except PoolingFailedError as exc:  # some prompts' LoRA adapters broke; the others ran
            return exc.results, exc.errors
        finally:
            bar.close()


def _raise_failed(outputs: list, errors: dict[int, BaseException]) -> list:
    """``outputs``, or :class:`~dfllm.outputs.RequestFailedError` naming the failed ones by
    prompt index (each ``finished=False``), with every output in its ``outputs``."""
    if not errors:
        return outputs
    failed = sorted(errors)
    lines = [f"prompt {i}: {errors[i]}" for i in failed[:5]]
    more = f"; and {len(failed) - 5} more" if len(failed) > 5 else ""
    raise RequestFailedError(
        f"{len(failed)} of {len(outputs)} requests failed (the others completed; their outputs are in this "
        "error's .outputs): " + "; ".join(lines) + more,
        outputs,
        failed,
    )
