"""The pooling half of :class:`dfllm.LLM`: ``embed``, ``classify``, ``score`` and ``encode``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from dfllm.config import EngineConfig
from dfllm.engine.pooling_engine import PoolingEngine
from dfllm.inputs import (
    as_prompt_list,
    check_token_ids,
    check_unicode,
    per_prompt_params,
)
from dfllm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from dfllm.pooling_params import PoolingParams

POOLING_TASKS = ("embed", "classify", "token_embed")


def check_pooling_task(pooling_task: str | None) -> str:
    """``pooling_task`` of ``encode``, or ``ValueError`` if it is not one of :data:`POOLING_TASKS`."""
    if pooling_task not in POOLING_TASKS:
        raise ValueError(f"pooling_task must be one of {POOLING_TASKS}, got {pooling_task!r}")
    return pooling_task


def not_pooling_error(task: str) -> ValueError:
    """The error for a pooling method (``task``) called on a generative model."""
    return ValueError(f"{task}: this is a generative model; load a pooling model "
                      "(an embedding model, a classifier, or LLM(..., runner='pooling'))")


class PoolingFrontend:
    """Pooling requests (vLLM's ``encode``/``embed``/``classify``/``score``) on a pooling
    engine: prompts are checked, tokenized and truncated here; ``next_id`` names the requests."""

    def __init__(self, cfg: EngineConfig, tokenizer: PreTrainedTokenizerBase, engine: PoolingEngine,
                 next_id: Callable[[], str]):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.engine = engine
        self._next_id = next_id

    def encode(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, *,
               pooling_task: str | None = None, use_tqdm: bool = True,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Raw pooled tensors: ``pooling_task`` is "embed", "classify" or "token_embed" (required)."""
        self.require(check_pooling_task(pooling_task))
        ids, params = self._pooling_inputs(prompts, pooling_params, truncate_prompt_tokens)
        data = self._pool(ids, params, pooling_task, use_tqdm)
        return [PoolingRequestOutput(self._next_id(), PoolingOutput(d), p) for d, p in zip(data, ids)]

    def embed(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, *,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding (a list of floats) per prompt, in input order."""
        outs = self.encode(prompts, pooling_params, pooling_task="embed", use_tqdm=use_tqdm,
                           truncate_prompt_tokens=truncate_prompt_tokens)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data.tolist()), o.prompt_token_ids)
                for o in outs]

    def classify(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, *,
                 use_tqdm: bool = True,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt; ``outputs.label`` names the most likely class (``id2label``)."""
        outs = self.encode(prompts, pooling_params, pooling_task="classify", use_tqdm=use_tqdm,
                           truncate_prompt_tokens=truncate_prompt_tokens)
        id2label = self.cfg.model.id2label or {}
        return [
            ClassificationRequestOutput(o.request_id, ClassificationOutput(
                o.outputs.data.tolist(), id2label.get(int(o.outputs.data.argmax()))), o.prompt_token_ids)
            for o in outs
        ]

    def score(self, data_1, data_2, /, *, use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """Similarity of text pairs: one to one, one to many, or many to many (pairwise).

        A cross-encoder (a sequence classifier with one label) reads each pair together and
        its sigmoid is the score; any other embedding model scores by the cosine similarity
        of the two embeddings.
        """
        left, right = _pairs(data_1, data_2)
        params = pooling_params or PoolingParams()
        self.require("score")
        if self.engine.num_labels == 1:
            return self._cross_encode(left, right, params, truncate_prompt_tokens, use_tqdm)
        unique = list(dict.fromkeys(left + right))  # a 1-to-N query is embedded once
        embs = self.embed(unique, PoolingParams(normalize=True, truncate_prompt_tokens=params.truncate_prompt_tokens),
                          use_tqdm=use_tqdm, truncate_prompt_tokens=truncate_prompt_tokens)
        by_text = {t: e for t, e in zip(unique, embs)}
        return [
            ScoringRequestOutput(self._next_id(), ScoringOutput(float(torch.tensor(a.outputs.embedding)
                                                                      @ torch.tensor(b.outputs.embedding))),
                                 a.prompt_token_ids + b.prompt_token_ids)
            for a, b in ((by_text[x], by_text[y]) for x, y in zip(left, right))
        ]

    def require(self, task: str) -> None:
        """Raise ``ValueError`` if the model does not serve ``task`` (e.g. "classify" on an embedder)."""
        if task not in self.engine.supported_tasks:
            labels = self.engine.num_labels
            kind = f"a classifier with {labels} labels" if labels else "an embedding model"
            raise ValueError(f"{task} is not supported by this model, {kind} (it supports "
                             f"{', '.join(self.engine.supported_tasks)}); score needs an embedding "
                             "model or a cross-encoder (one label)")

    # ---- helpers ----------------------------------------------------------------------
    def _limit(self, params: PoolingParams, truncate_prompt_tokens: int | None) -> int:
        limit = min(self.cfg.max_model_len, self.engine.pooler.max_length or self.cfg.max_model_len)
        for t in (truncate_prompt_tokens, params.truncate_prompt_tokens):
            if t is not None and t != -1:
                PoolingParams(truncate_prompt_tokens=t)  # validates
                limit = min(limit, t)
        return limit

    def _pooling_inputs(self, prompts, pooling_params, truncate_prompt_tokens):
        items = as_prompt_list(prompts)
        params = per_prompt_params(pooling_params, len(items), PoolingParams, "pooling_params")
        ids: list[list[int] | None] = [None] * len(items)
        texts: dict[int, list[int]] = {}
        for i, (item, p) in enumerate(zip(items, params)):
            limit = self._limit(p, truncate_prompt_tokens)
            if isinstance(item, dict) and "prompt_token_ids" in item:
                ids[i] = check_token_ids(item["prompt_token_ids"], f"prompt {i}", self.cfg.model.vocab_size)[:limit]
            else:
                text = item.get("prompt") if isinstance(item, dict) else item
                if not isinstance(text, str):
                    raise ValueError(f"prompt {i}: expected a str or a dict with 'prompt' or 'prompt_token_ids', "
                                     f"got {type(item).__name__}")
                check_unicode(text, f"prompt {i}")
                texts.setdefault(limit, []).append(i)
        for limit, idx in texts.items():
            enc = self.tokenizer([items[i]["prompt"] if isinstance(items[i], dict) else items[i] for i in idx],
                                 truncation=True, max_length=limit)["input_ids"]
            for i, e in zip(idx, enc):
                ids[i] = e
        for i, e in enumerate(ids):
            if not e:
                raise ValueError(f"prompt {i} is empty")
        return ids, params

    def _cross_encode(self, left, right, params, truncate_prompt_tokens, use_tqdm):
        limit = self._limit(params, truncate_prompt_tokens)
        enc = self.tokenizer(list(left), list(right), truncation=True, max_length=limit)
        ids, types = enc["input_ids"], enc.get("token_type_ids")
        data = self._pool(ids, [params] * len(ids), "classify", use_tqdm, types)
        return [ScoringRequestOutput(self._next_id(), ScoringOutput(float(d[0])), p) for d, p in zip(data, ids)]

    def _pool(self, ids, params, task, use_tqdm, types=None):
        bar = tqdm(total=len(ids), desc=f"Pooling ({task})", dynamic_ncols=True, disable=not use_tqdm)
        try:
            return self.engine.encode(ids, params, task, types, on_batch=bar.update)
        finally:
            bar.close()


def _pairs(data_1, data_2) -> tuple[list[str], list[str]]:
    """Broadcast score inputs: 1 to 1, 1 to N, or N to N."""
    left = [data_1] if isinstance(data_1, str) else list(data_1)
    right = [data_2] if isinstance(data_2, str) else list(data_2)
    if not left or not right:
        raise ValueError("score needs at least one text on each side")
    for side, texts in (("data_1", left), ("data_2", right)):
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise ValueError(f"score {side}[{i}] must be a str, got {type(t).__name__}")
            check_unicode(t, f"score {side}[{i}]")
    if len(left) == 1 and len(right) > 1:
        left = left * len(right)
    if len(left) != len(right):
        raise ValueError(f"score takes 1 to 1, 1 to N or N to N texts; got {len(left)} and {len(right)}")
    return left, right
