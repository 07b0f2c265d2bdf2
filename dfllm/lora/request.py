"""vLLM's ``LoRARequest``: which LoRA adapter a request runs with."""

from __future__ import annotations

import hashlib
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
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

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
    def for_path(cls, path: str, name: str | None = None) -> LoRARequest:
        """A request for the adapter at ``path`` (a dataframe row's adapter), with an int id
        derived from ``name`` (default: the path) so that every worker gives it the same one."""
        key = name or path
        int_id = int.from_bytes(hashlib.sha1(key.encode()).digest()[:4], "big") % (2**31 - 1) + 1
        return cls(name or path, int_id, path)


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
