"""Parameters of pooling requests (embed, classify, score, encode), with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify", "token_embed")  # what a pooling request can compute


@dataclass
class PoolingParams:
    """How to pool one prompt.

    - ``normalize``: L2-normalise embeddings. None follows the model directory (the
      sentence-transformers ``Normalize`` module; decoder embedders normalise by default).
    - ``truncate_prompt_tokens``: keep at most this many tokens of the prompt (the start,
      special tokens kept, as sentence-transformers truncates). Prompts are always cut to
      the model's maximum length; this can lower the limit. -1 means the model's maximum.
    - ``use_activation``: for classify and cross-encoder scores, apply softmax (several
      labels) or sigmoid (one label) to the logits; False returns the raw logits.
    - ``task``: what to compute, as vLLM's: "embed", "classify" or "token_embed". None
      follows the call (``embed``, ``classify``, ``encode(pooling_task=...)``, which refuse
      a different task); for a request queued with ``LLM.enqueue`` it is the model's own
      task ("embed" for an embedding model, "classify" for a classifier or cross-encoder).
    """

    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool = True
    task: str | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be None or one of {POOLING_TASKS}, got {self.task!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be a positive int or -1, got {t!r}")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
