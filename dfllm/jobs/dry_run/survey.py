"""One partition on a worker: its rows turned into requests by the job's engine and
summarized (:class:`PartitionSurvey`): lengths, refusals, and the engine's own keys of what it
computes once (:func:`dfllm.engine.dedupe.dedupe_digest`) and what its prefix cache shares
(:func:`dfllm.engine.prefix_hash.prefix_block_hashes`)."""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from dfllm.engine.dedupe import dedupe_digest
from dfllm.jobs.dry_run.requests import RequestSource

if TYPE_CHECKING:
    from dfllm.engine.input_processor import EngineRequest
    from dfllm.engine.llm_engine import LLMEngine


EXAMPLES = 3  # refused rows shown per reason
TOO_LONG = "longer than max_model_len="  # the input processor's detail for a prompt with no room left


@dataclasses.dataclass
class EngineFacts:
    """The engine settings a dry run's figures depend on, as the worker loaded them."""

    model: str
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prefix_caching: bool
    deduplicate: bool


@dataclasses.dataclass
class PartitionSurvey:
    """What one partition's rows would be: the figures a worker sends back for a dry run."""

    partition: int
    rows: int
    prompt_tokens: np.ndarray  # per accepted request, in the order the engine would get them
    max_tokens: np.ndarray  # per accepted request: the most it may generate (max_tokens, within the context)
    runs: np.ndarray  # per accepted request: whether the engine computes it (not a duplicate, not a cache hit)
    refused: int
    reasons: dict[str, list]  # reason -> [rows, [(row label, message)...] examples]
    longest: tuple[int, Any]  # (prompt tokens, row label) of the longest accepted prompt
    duplicates: int  # requests identical to an earlier one of the partition (the engine computes them once)
    duplicate_tokens: int  # their prompt tokens
    request_digests: np.ndarray  # uint64 per distinct deterministic request (job-wide duplicates)
    block_digests: np.ndarray  # uint64 per distinct full block looked up in the prefix cache
    looked_up_blocks: int  # full blocks the prefix cache would look up (over requests computed)
    cache_hits: int | None
    engine: EngineFacts
    load_seconds: float  # loading the engine, if this task did
    seconds: float
    not_estimated: dict[str, int] = dataclasses.field(default_factory=dict)  # why -> rows run elsewhere


def survey_partition(df: pd.DataFrame, source: RequestSource, partition: int) -> PartitionSurvey:
    """Turn one partition's rows into requests on this worker's engine (loaded if need be)
    and summarize them (see the module docstring)."""
    from dfllm.worker.engine_cache import lease, load_count

    start = time.perf_counter()
    loads = load_count()
    with lease(source.model, dict(source.engine_kwargs)) as entry:
        load = time.perf_counter() - start if load_count() > loads else 0.0
        engine = generative_engine(entry.llm)
        got = source_requests(source, df, engine, entry.lock) if len(df) else ([], {})
        requests, refused = got[0], got[1]
        skipped: dict[int, str] = got[2] if len(got) > 2 else {}
        hits = source.cache_hits(requests, entry.llm.config) if requests else None
        facts = engine_facts(entry.llm)
    survey = _summarize(partition, df, requests, refused, hits, facts, load, time.perf_counter() - start, skipped)
    survey.not_estimated = dict(Counter(skipped.values()))
    return survey


def source_requests(source: RequestSource, df: pd.DataFrame, engine: LLMEngine, lock: threading.Lock) -> tuple:
    """``source.requests`` of ``df`` on ``engine``, with the engine's LoRA check
    (``check_lora=``, the one the real run calls on each row's adapter) where the source
    takes it."""
    import inspect

    try:
        takes = "check_lora" in inspect.signature(source.requests).parameters
    except (TypeError, ValueError):
        takes = False
    lora = {"check_lora": engine.check_lora} if takes else {}
    return source.requests(df, engine.input_processor, lock, **lora)


def generative_engine(llm) -> LLMEngine:
    if llm.engine is None:
        raise ValueError(
            f"dry run: {llm.config.model_path.name} is loaded as a pooling model; a dry run checks "
            "generate and chat jobs"
        )
    return llm.engine


def engine_facts(llm) -> EngineFacts:
    """The settings of ``llm``'s engine that a dry run's figures depend on."""
    cfg = llm.config
    return EngineFacts(
        cfg.model_path.name,
        cfg.max_model_len,
        cfg.block_size,
        cfg.max_num_seqs,
        cfg.max_num_batched_tokens,
        bool(cfg.enable_prefix_caching),
        bool(cfg.deduplicate_requests),
    )


def _summarize(
    partition: int,
    df: pd.DataFrame,
    requests: list[EngineRequest],
    refused: dict[int, str],
    hits: list[bool] | None,
    facts: EngineFacts,
    load: float,
    seconds: float,
    skipped: dict[int, str] | None = None,
) -> PartitionSurvey:
    lengths = np.array([len(r.prompt_token_ids) for r in requests], dtype=np.int64)
    limits = np.array([generation_limit(r, facts.max_model_len) for r in requests], dtype=np.int64)
    reasons: dict[str, list] = {}
    for i, message in refused.items():
        entry = reasons.setdefault(refusal_reason(message), [0, []])
        entry[0] += 1
        if len(entry[1]) < EXAMPLES:
            entry[1].append((_label(df.index[i]), message))
    # identical deterministic requests of a partition meet in the engine at once: computed once
    digests, seen, runs = [], set(), np.ones(len(requests), dtype=bool)
    for k, r in enumerate(requests):
        key = dedupe_digest(r) if facts.deduplicate else None
        if key is None:
            continue
        if key in seen:
            runs[k] = False
        else:
            seen.add(key)
            digests.append(key)
    duplicates = int((~runs).sum())
    duplicate_tokens = int(lengths[~runs].sum()) if len(requests) else 0
    if hits is not None:
        runs &= ~np.array(hits, dtype=bool)
    blocks: set[int] = set()
    looked_up = 0
    if facts.prefix_caching:
        for k, r in enumerate(requests):
            if runs[k]:
                lora = None if r.lora_request is None else r.lora_request.lora_int_id
                chain = block_digests(r.prompt_token_ids, facts.block_size, lora, r.mm_inputs)
                looked_up += len(chain)
                blocks.update(chain)
    longest: tuple[int, Any] = (0, None)
    if len(requests):
        k = int(lengths.argmax())
        positions = sorted(set(range(len(df))) - set(refused) - set(skipped or {}))  # the accepted rows, in order
        longest = (int(lengths[k]), _label(df.index[positions[k]]) if len(positions) == len(requests) else None)
    return PartitionSurvey(
        partition,
        len(df),
        lengths,
        limits,
        runs,
        len(refused),
        reasons,
        longest,
        duplicates,
        duplicate_tokens,
        np.array(digests, dtype=np.uint64),
        np.array(sorted(blocks), dtype=np.uint64),
        looked_up,
        None if hits is None else int(sum(hits)),
        facts,
        load,
        seconds,
    )


def _label(value) -> Any:
    """A row's index label as a plain Python value."""
    return value.item() if hasattr(value, "item") else value


def generation_limit(request: EngineRequest, max_model_len: int) -> int:
    """The most tokens ``request`` may generate: its ``max_tokens`` (None: up to the context),
    within ``max_model_len``."""
    room = max(0, max_model_len - len(request.prompt_token_ids))
    cap = request.params.max_tokens
    return room if cap is None else min(int(cap), room)


def refusal_reason(message: str) -> str:
    """A refused row's message as a reason shared by rows failing the same way (its numbers
    left out)."""
    if TOO_LONG in message:
        return "prompt longer than max_model_len"
    text = re.sub(r"\d+", "N", message)
    return text if len(text) <= 100 else text[:97] + "..."


def block_digests(
    token_ids: Sequence[int], block_size: int, lora_int_id: int | None = None, mm_inputs=None
) -> list[int]:
    """The hash chain of the full blocks the prefix cache looks up for a prompt: the engine's
    own (:func:`dfllm.engine.prefix_hash.prefix_block_hashes`, every full block but one that
    would leave no token to compute; per LoRA adapter and images), as unsigned 64-bit ints."""
    from dfllm.engine.prefix_hash import prefix_block_hashes

    chain = prefix_block_hashes(token_ids, block_size, lora_int_id=lora_int_id, mm_inputs=mm_inputs)
    return [h & 0xFFFFFFFFFFFFFFFF for h in chain]
