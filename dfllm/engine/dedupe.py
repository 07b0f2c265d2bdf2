"""Which requests the engine computes once: the one definition of request deduplication.

Two deterministic requests (greedy, or sampled with a seed) with the same :func:`dedupe_key`
produce the same output, so the engine (:mod:`dfllm.engine.llm_engine`) computes the first
and copies its output to the others; a dry run (:mod:`dfllm.jobs.dry_run`) counts the
duplicates of a job with the same key, so its estimate cannot disagree with the engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from typing import Any


def dedupe_key(request: Any) -> Hashable | None:
    """What identical deterministic requests share: prompt tokens, every sampling parameter,
    banned words, how their text is split into reasoning and answer, their images and their
    LoRA adapter; None for a request whose output may differ from an identical one's.

    ``request`` is an engine request (:class:`~dfllm.engine.input_processor.EngineRequest`)
    or a queued one (:class:`~dfllm.engine.sequence.Request`): anything with those fields."""
    params = request.params
    if not (params.is_greedy or params.seed is not None):
        return None
    lora = request.lora_request
    return (
        tuple(request.prompt_token_ids),
        repr(params),
        request.bad_words_ids,
        None if request.reasoning is None else request.reasoning.key,
        None if request.mm_inputs is None else request.mm_inputs.keys,
        None if lora is None else ("lora", lora.lora_int_id),
    )


def dedupe_digest(request: Any) -> int | None:
    """:func:`dedupe_key` as an unsigned 64-bit digest that is the same in every process (the
    key's ``hash`` is not: Python salts the hashes of strings per process); None where the key is."""
    key = dedupe_key(request)
    if key is None:
        return None
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")
