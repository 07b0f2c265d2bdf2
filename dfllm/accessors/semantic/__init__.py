"""Semantic operators on dataframes (``.llm.filter``, ``judge``, ``extract``, ``topk``,
``join``, ``sim_join``, ``dedup``, ``agg``): relational operations whose condition or
output is an LLM's judgment, built on the ``.llm`` tasks. User docs: docs/semantic.md."""

from dfllm.accessors.semantic.methods import SemanticFrameMethods

__all__ = ["SemanticFrameMethods", "Cascade", "CascadeStats"]


def __getattr__(name: str):
    # the cascade's classes import the accessors' modules, which import this package first
    if name in ("Cascade", "CascadeStats"):
        from dfllm.accessors.semantic import cascade

        return getattr(cascade, name)
    raise AttributeError(name)
