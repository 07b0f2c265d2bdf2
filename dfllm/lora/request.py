"""vLLM's ``LoRARequest``: which LoRA adapter a request runs with."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any

from dfllm.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request, with vLLM's fields and meaning.

    ``lora_name`` names the adapter, ``lora_int_id`` (an int >= 1) is its identity in the
    engine (two requests with the same id run the same adapter; the id keys the adapter
    slots, the prefix cache and request deduplication), and ``lora_path`` is a local
    directory as PEFT's ``save_pretrained`` writes it (``adapter_config.json`` and
    ``adapter_model.safetensors``). ``base_model_name`` is accepted, as vLLM's, and unused.

    ``identity`` (dfllm's, not vLLM's) is what the adapter's files must hold
    (:func:`~dfllm.lora.resolve.adapter_identity`): a dataframe row's adapter has one, and the
    engine refuses to run it from files that hold anything else; the response cache keys
    its rows by it (a request without one bypasses the cache).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    identity: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest: lora_name must be a non-empty str, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(
                f"LoRARequest: lora_int_id must be an int >= 1, got {self.lora_int_id!r} (adapter {self.lora_name!r})"
            )
        if not isinstance(self.lora_path, str):  # a pathlib.Path: kept as its string
            object.__setattr__(self, "lora_path", str(self.lora_path))

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def local_path(self) -> str:
        return self.lora_path

    @classmethod
    def for_path(cls, path: str, name: str | None = None, identity: str | None = None) -> LoRARequest:
        """A request for the adapter at ``path`` (a dataframe row's adapter) holding
        ``identity``, with an int id derived from ``name`` (default: the path) and
        ``identity``, so that every worker gives it the same one; an id this process gave
        another adapter already (a 31-bit hash collision) moves to the next free one."""
        key = name or path
        with _ids_lock:
            known = _ids.get((key, path, identity))
            if known is not None:
                return cls(key, known, path, identity=identity)
            text = key if identity is None else f"{key}\0{identity}"
            int_id = int.from_bytes(hashlib.sha1(text.encode("utf-8", "surrogatepass")).digest()[:4], "big")
            int_id = int_id % _ID_RANGE + 1
            while int_id in _taken:
                int_id = int_id % _ID_RANGE + 1
            _ids[(key, path, identity)] = int_id
            _taken.add(int_id)
        return cls(key, int_id, path, identity=identity)


_ID_RANGE = 2**31 - 1
_ids_lock = threading.Lock()
_ids: dict[tuple, int] = {}  # (name, path, identity) -> the id this process gave it
_taken: set[int] = set()


def per_prompt(lora_request: Any, num_prompts: int) -> list:
    """vLLM's ``lora_request`` argument (one adapter, or a list with one per prompt) as one
    entry per prompt; a list of another length is an :class:`InvalidRequestError`."""
    if not isinstance(lora_request, list | tuple):
        return [lora_request] * num_prompts
    if len(lora_request) != num_prompts:
        raise InvalidRequestError(
            f"lora_request: got {len(lora_request)} LoRA requests for {num_prompts} prompts "
            "(give one, or a list with one per prompt)",
            parameter="lora_request",
        )
    return list(lora_request)
