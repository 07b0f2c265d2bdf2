"""Semantic operators on dataframes (``.llm.filter``, ``judge``, ``extract``, ``topk``,
``join``, ``sim_join``, ``dedup``, ``agg``): relational operations whose condition or
output is an LLM's judgment, built on the ``.llm`` tasks. User docs: docs/semantic.md.

A floor above the accessors: importing it puts these methods on every library's ``.llm``
(:mod:`dfllm.namespaces` does, before it registers ``.llm``); the accessors never import it."""

from dfllm.accessors.frontend import LLMFrameMethods
from dfllm.semantic.methods import SemanticFrameMethods

__all__ = ["SemanticFrameMethods", "Cascade", "CascadeStats"]

LLMFrameMethods.add_methods(SemanticFrameMethods)


def __getattr__(name: str):
    # loaded on first use, as each operator's module is, so that .llm registers lightly
    if name in ("Cascade", "CascadeStats"):
        from dfllm.semantic import cascade

        return getattr(cascade, name)
    raise AttributeError(name)
