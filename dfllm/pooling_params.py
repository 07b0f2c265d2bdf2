"""Parameters of pooling requests (embed, classify, score, encode), with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, fields

from dfllm.errors import MAX_NESTING_DEPTH, invalid_field, nesting_depth

POOLING_TASKS = ("embed", "classify", "token_embed")  # what a pooling request can compute


@dataclass
class PoolingParams:
    """How to pool one prompt.

    - ``normalize``: L2-normalise embeddings. None follows the model directory (the
      sentence-transformers ``Normalize`` module; decoder embedders normalise by default).
    - ``truncate_prompt_tokens``: keep at most this many tokens of the prompt (the start,
      special tokens kept, as sentence-transformers truncates). Prompts are always cut to
      the model's maximum length; this can lower the limit. -1 means the model's maximum.
    - ``use_activation``: as vLLM's. For classify and cross-encoder scores, apply softmax
      (several labels) or sigmoid (one label) to the logits; False returns the raw logits.
      For embeddings (``embed``, ``token_embed``) it is vLLM's normalisation switch: True
      L2-normalises, False does not, when ``normalize`` is None. None (the default): the
      model's own (True for classifiers; the ``Normalize`` module for embedders).
    - ``dimensions``: vLLM's Matryoshka truncation of an embedding to its first N values
      (normalised after truncation). Only for a model whose ``config.json`` has
      ``matryoshka_dimensions`` (then N must be one of them) or ``is_matryoshka: true``
      (then 1 <= N <= the embedding size); refused otherwise with vLLM's message, and for
      classify ("Task 'classify' only supports ['use_activation'] parameters, ...").
    - ``task``: what to compute, as vLLM's: "embed", "classify" or "token_embed". None
      follows the call (``embed``, ``classify``, ``encode(pooling_task=...)``, which refuse
      a different task); for a request queued with ``LLM.enqueue`` it is the model's own
      task ("embed" for an embedding model, "classify" for a classifier or cross-encoder).
    """

    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    task: str | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        """Refuse a field of the wrong type or value: :class:`~dfllm.errors.InvalidRequestError`
        (a ``ValueError``) naming it in ``parameter``, whatever the value (an array, a
        surrogate, a value nested past :data:`~dfllm.errors.MAX_NESTING_DEPTH`)."""
        for f in fields(self):  # the messages below show the value
            if nesting_depth(getattr(self, f.name)) > MAX_NESTING_DEPTH:
                raise invalid_field(f.name, None, f"{f.name} must be nested at most {MAX_NESTING_DEPTH} levels deep")
        if self.task is not None and not (isinstance(self.task, str) and self.task in POOLING_TASKS):
            raise invalid_field("task", self.task, f"task must be None or one of {POOLING_TASKS}, got {self.task!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise invalid_field(
                "truncate_prompt_tokens", t, f"truncate_prompt_tokens must be a positive int or -1, got {t!r}"
            )
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int)):
            raise invalid_field("dimensions", d, f"dimensions must be an int or None, got {d!r}")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise invalid_field(name, value, f"{name} must be a bool, got {value!r}")
