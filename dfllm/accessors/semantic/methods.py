"""The semantic operators' methods on ``.llm`` (pandas, Dask, Polars eager and lazy).

:class:`SemanticFrameMethods` is mixed into each library's ``.llm`` frame accessor next to
:class:`~dfllm.accessors.frontend.LLMFrameMethods`, whose ``_columns``, ``_model_check`` and
``_obj`` it uses. Each method checks its arguments now (``ValueError`` naming the field)
and builds on the ``.llm`` tasks and the engine's public API only; the work is in the
operator's module (``filter.py``, ``extract.py``, ``cascade.py``...). User docs:
docs/semantic.md.
"""

from __future__ import annotations

from typing import Any

DEFAULT_LOGPROBS = 20  # top log-probabilities read per verdict token (filter, judge)


class SemanticFrameMethods:
    """``df.llm.filter``, ``judge``, ``extract``, ``topk``, ``join``, ``sim_join``, ``dedup``, ``agg``."""

    _obj: Any

    def judge(self, instruction: str, *, model=None, output_column: str = "verdict",
              probability_column: str = "verdict_probability", return_explanations: bool = False,
              explanation_column: str = "explanation", cascade=None, return_stats: bool = False,
              chat: bool = True, logprobs: int = DEFAULT_LOGPROBS, max_explanation_tokens: int = 64,
              on_error: str = "null", resources: dict | None = None, cache=None, **engine_kwargs):
        """Judge for every row whether the statement ``instruction`` holds (a template such as
        ``"{review} is about shipping delays"``) and keep every row: adds a bool ``verdict``,
        its probability (``verdict_probability``, float: the probability of the answer given,
        from the first answer token's log-probabilities over "True" and "False"),
        ``explanation`` (with ``return_explanations``) and ``llm_error``. One constrained
        decode per row (greedy, ``choice`` of "True"/"False"). A row that failed has a null
        verdict and its message in ``llm_error``.

        ``cascade`` (a :class:`dfllm.Cascade`) judges the confident rows by a cheap proxy and
        only the others with ``model``, with recall/precision targets; ``return_stats=True``
        then returns ``(frame, CascadeStats)``. ``chat=False`` prompts with ``.llm.generate``
        instead of ``.llm.chat``. ``model``, ``resources``, ``cache`` and engine arguments as in
        ``.llm.generate``. See docs/semantic.md."""
        from dfllm.accessors.semantic.filter import semantic_judge

        return semantic_judge(self, instruction, keep=True, model=model, output_column=output_column,
                              probability_column=probability_column, return_explanations=return_explanations,
                              explanation_column=explanation_column, cascade=cascade, return_stats=return_stats,
                              chat=chat, logprobs=logprobs, max_explanation_tokens=max_explanation_tokens,
                              on_error=on_error, resources=resources, cache=cache, engine_kwargs=engine_kwargs)

    def filter(self, instruction: str, *, model=None, return_explanations: bool = False,
               explanation_column: str = "explanation", cascade=None, return_stats: bool = False,
               chat: bool = True, logprobs: int = DEFAULT_LOGPROBS, max_explanation_tokens: int = 64,
               on_error: str = "null", resources: dict | None = None, cache=None, **engine_kwargs):
        """The rows for which the model judges the statement ``instruction`` true (a template
        such as ``"{review} is about shipping delays"``), with the frame's columns, the
        ``explanation`` (with ``return_explanations``) and ``llm_error``. A row whose judgment
        failed is kept, with its message in ``llm_error`` (nothing is dropped silently);
        drop them with ``df[df.llm_error.isna()]``. Arguments as in :meth:`judge`."""
        from dfllm.accessors.semantic.filter import semantic_judge

        return semantic_judge(self, instruction, keep=False, model=model, output_column="verdict",
                              probability_column="verdict_probability", return_explanations=return_explanations,
                              explanation_column=explanation_column, cascade=cascade, return_stats=return_stats,
                              chat=chat, logprobs=logprobs, max_explanation_tokens=max_explanation_tokens,
                              on_error=on_error, resources=resources, cache=cache, engine_kwargs=engine_kwargs)

    def extract(self, instruction: str, schema, *, model=None, output_column: str = "extracted",
                expand: bool = True, chat: bool = True, sampling_params=None, on_error: str = "null",
                resources: dict | None = None, cache=None, **engine_kwargs):
        """Typed fields from each row's text, through structured outputs: ``instruction`` is a
        template naming the columns to read (``"{text}"``, or ``"the complaint in {text}"``),
        ``schema`` a pydantic model, a JSON schema (an object) or a dict name -> type (``str``,
        ``int``, ``float``, ``bool``, ``list[str]``...). With ``expand`` (default) one typed
        column per field, else one Arrow struct column ``output_column``; then ``llm_error``.
        Greedy unless ``sampling_params`` say otherwise. See docs/semantic.md."""
        from dfllm.accessors.semantic.extract import semantic_extract

        return semantic_extract(self, instruction, schema, model=model, output_column=output_column, expand=expand,
                                chat=chat, sampling_params=sampling_params, on_error=on_error, resources=resources,
                                cache=cache, engine_kwargs=engine_kwargs)

    # --- semantic-2's operators (topk, join, sim_join, dedup, agg) go below, in one block ---
