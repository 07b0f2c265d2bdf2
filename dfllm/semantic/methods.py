"""The semantic operators' methods on ``.llm`` (pandas, Dask, Polars eager and lazy).

:class:`SemanticFrameMethods` holds them; :mod:`dfllm.semantic` adds them to every library's
``.llm`` frame accessor (:meth:`~dfllm.accessors.frontend.LLMFrameMethods.add_methods`), and
they see the accessor's frame through :class:`~dfllm.accessors.adapter.FrameAdapter` only.
Each method checks its arguments now (``ValueError`` naming the field) and builds on the
``.llm`` tasks and the engine's public API only; the work is in the operator's module
(``filter.py``, ``extract.py``, ``cascade.py``...). User docs: docs/semantic.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dfllm.accessors.adapter import FrameAdapter

if TYPE_CHECKING:
    from dfllm.semantic.filter import Judgment

DEFAULT_LOGPROBS = 20  # top log-probabilities read per verdict token (filter, judge)


class SemanticFrameMethods:
    """``df.llm.filter``, ``judge``, ``extract``, ``topk``, ``join``, ``sim_join``, ``dedup``, ``agg``."""

    def judge(
        self,
        instruction: str,
        *,
        model=None,
        output_column: str = "verdict",
        probability_column: str = "verdict_probability",
        return_explanations: bool = False,
        explanation_column: str = "explanation",
        cascade=None,
        return_stats: bool = False,
        chat: bool = True,
        logprobs: int = DEFAULT_LOGPROBS,
        max_explanation_tokens: int = 64,
        on_error: str = "null",
        resources: dict | None = None,
        cache=None,
        **engine_kwargs,
    ):
        """Judge for every row whether the statement ``instruction`` holds (a template such as
        ``"{review} is about shipping delays"``) and keep every row: adds a bool ``verdict``,
        its probability (``verdict_probability``, float: the probability of the answer given,
        from the first answer token's log-probabilities over "True" and "False"),
        ``explanation`` (with ``return_explanations``) and ``llm_error``. One constrained
        decode per row (greedy, ``choice`` of "True"/"False"). A row that failed has a null
        verdict and its message in ``llm_error``. ``logprobs`` (default 20) top log-probabilities
        of the answer's first token give the probability (a lower bound when the other answer's
        tokens are not among them); ``-1`` reads the whole vocabulary and makes it exact.

        ``cascade`` (a :class:`dfllm.Cascade`) judges the confident rows by a cheap proxy and
        only the others with ``model``, with recall/precision targets; ``return_stats=True``
        then returns ``(frame, CascadeStats)``. ``chat=False`` prompts with ``.llm.generate``
        instead of ``.llm.chat``. ``model``, ``resources``, ``cache`` and engine arguments as in
        ``.llm.generate``. See docs/semantic.md."""
        return _judge(locals(), keep=True, what="judge")

    def filter(
        self,
        instruction: str,
        *,
        model=None,
        return_explanations: bool = False,
        explanation_column: str = "explanation",
        cascade=None,
        return_stats: bool = False,
        chat: bool = True,
        logprobs: int = DEFAULT_LOGPROBS,
        max_explanation_tokens: int = 64,
        on_error: str = "null",
        resources: dict | None = None,
        cache=None,
        **engine_kwargs,
    ):
        """The rows for which the model judges the statement ``instruction`` true (a template
        such as ``"{review} is about shipping delays"``), with the frame's columns, the
        ``explanation`` (with ``return_explanations``) and ``llm_error``. A row whose judgment
        failed is kept, with its message in ``llm_error`` (nothing is dropped silently);
        drop them with ``df[df.llm_error.isna()]``. Arguments as in :meth:`judge`."""
        return _judge(
            locals(),
            keep=False,
            what="filter",
            # private: filter drops them, so that a frame's own `verdict` columns pass through untouched
            output_column="__dfllm_sem_verdict__",
            probability_column="__dfllm_sem_verdict_probability__",
        )

    def extract(
        self,
        instruction: str,
        schema,
        *,
        model=None,
        output_column: str = "extracted",
        expand: bool = True,
        chat: bool = True,
        sampling_params=None,
        on_error: str = "null",
        resources: dict | None = None,
        cache=None,
        **engine_kwargs,
    ):
        """Typed fields from each row's text, through structured outputs: ``instruction`` is a
        template naming the columns to read (``"{text}"``, or ``"the complaint in {text}"``),
        ``schema`` a pydantic model, a JSON schema (an object) or a dict name -> type (``str``,
        ``int``, ``float``, ``bool``, ``list[str]``...). With ``expand`` (default) one typed
        column per field, else one Arrow struct column ``output_column``; then ``llm_error``.
        Greedy unless ``sampling_params`` say otherwise. See docs/semantic.md."""
        from dfllm.semantic.extract import semantic_extract

        return semantic_extract(
            FrameAdapter.of(self),
            instruction,
            schema,
            model=model,
            output_column=output_column,
            expand=expand,
            chat=chat,
            sampling_params=sampling_params,
            on_error=on_error,
            resources=resources,
            cache=cache,
            engine_kwargs=engine_kwargs,
        )

    # --- semantic-2's operators (topk, join, sim_join, dedup, agg) go below, in one block ---

    def topk(
        self,
        instruction: str,
        k: int,
        *,
        method: str = "quick",
        model=None,
        rank_column: str = "rank",
        seed_embeddings: bool = False,
        embed_model=None,
        both_orders: bool = False,
        logprobs: int = DEFAULT_LOGPROBS,
        chat: bool = True,
        on_error: str = "null",
        resources: dict | None = None,
        cache=None,
        return_stats: bool = False,
        **engine_kwargs,
    ):
        """The ``k`` rows that best satisfy the criterion ``instruction`` (a template such as
        ``"{review} is the most enthusiastic"``), best first, by LLM pairwise comparisons: a
        ``rank`` column (1 = best) and ``llm_error``. Rows that could not be ranked (a null
        field, a failed comparison) follow with a null rank and their message.

        Each comparison is one greedy decode constrained to "A"/"B", the pair's earlier row (in
        the frame's order) shown as A, each pair asked at most once. ``method="quick"``
        (default): batched quickselect, one engine call per round; ``"heap"``: a k-heap, one
        comparison per engine call. ``seed_embeddings`` picks the first pivot by the rows'
        embedding similarity to the criterion (``embed_model``, default the bundled MiniLM).
        ``both_orders=True`` asks each pair both ways (two decodes) and lets the row win whose
        probability of being chosen as A, read from the answer token's ``logprobs`` top
        log-probabilities, is the higher: a model's bias for one position cancels.
        On Dask: each partition's top k, then one merge task (one partition out).
        ``return_stats=True`` (pandas, Polars) returns ``(frame, SemanticCost)`` with
        ``counts["comparisons"]``. See docs/semantic.md."""
        from dfllm.semantic.join import LLMArgs
        from dfllm.semantic.topk import semantic_topk

        return semantic_topk(
            FrameAdapter.of(self),
            instruction,
            k,
            LLMArgs(model, chat, on_error, resources, cache, engine_kwargs),
            method=method,
            rank_column=rank_column,
            seed_embeddings=seed_embeddings,
            embed_model=embed_model,
            return_stats=return_stats,
            both_orders=both_orders,
            logprobs=logprobs,
        )

    def join(
        self,
        other,
        instruction: str,
        *,
        block_k: int | None = None,
        min_similarity: float | None = None,
        model=None,
        embed_model=None,
        suffix: str = "_right",
        similarity_column: str = "similarity",
        chat: bool = True,
        sampling_params=None,
        on_error: str = "null",
        resources: dict | None = None,
        cache=None,
        return_stats: bool = False,
        cascade=None,
        **engine_kwargs,
    ):
        """The pairs of this frame's rows and ``other``'s for which the model judges the
        statement ``instruction`` true (``"{abstract} cites {title}"``; a column both frames have
        is ``{title:left}`` or ``{title:right}``): this frame's columns, ``other``'s (with
        ``suffix`` where the names clash) and ``llm_error``.

        Without ``block_k``/``min_similarity`` every pair of the cross product is judged. With
        them, pairs are blocked by embedding similarity of the two rows' fields (``embed_model``,
        default the bundled MiniLM): for each left row only its ``block_k`` most similar right
        rows, and/or only pairs with cosine similarity ``>= min_similarity``, are judged, and a
        ``similarity`` column is added. A pair whose judgment failed is kept with its
        ``llm_error`` (never dropped as false), and so is a row that could not be embedded (the
        other side null). On Dask the right side is embedded once and each left partition is
        one task. ``return_stats=True`` (pandas, Polars) returns ``(frame, SemanticCost)`` with
        ``counts["pairs_judged"]`` and ``counts["cross_product"]``. ``sampling_params`` (a
        :class:`dfllm.SamplingParams`, or a dict of the fields to change) replaces the greedy
        decode's settings.

        ``cascade`` (a :class:`dfllm.Cascade`; pandas and Polars) judges the (blocked) pairs with
        ``.llm.judge(..., cascade=)``: a proxy decides the pairs it is sure about, ``model`` the
        rest; the result adds ``decided_by`` and the cost carries ``cascade`` (its
        ``CascadeStats``) and ``counts["large_model_pairs"]``. See docs/semantic.md."""
        from dfllm.semantic.join import LLMArgs, semantic_join

        return semantic_join(
            FrameAdapter.of(self),
            other,
            instruction,
            LLMArgs(model, chat, on_error, resources, cache, engine_kwargs, sampling_params),
            block_k=block_k,
            min_similarity=min_similarity,
            embed_model=embed_model,
            suffix=suffix,
            similarity_column=similarity_column,
            return_stats=return_stats,
            cascade=cascade,
        )

    def sim_join(
        self,
        other,
        left_on: str,
        right_on: str,
        k: int,
        *,
        left_images: bool = False,
        right_images: bool = False,
        embed_model=None,
        suffix: str = "_right",
        similarity_column: str = "similarity",
        min_similarity: float | None = None,
        resources: dict | None = None,
        return_stats: bool = False,
        **engine_kwargs,
    ):
        """For every row, the ``k`` rows of ``other`` whose ``right_on`` text is most similar to
        its ``left_on`` text (cosine of ``embed_model``'s embeddings, default the bundled MiniLM;
        ``min_similarity`` drops weaker ones): this frame's columns, ``other``'s (``suffix`` on
        clashes), ``similarity`` (highest first per left row) and ``llm_error``. A row that could
        not be embedded comes once, the other side null, with its error.

        ``left_images=True`` (``right_images=True``) embeds ``left_on`` (``right_on``) as a
        column of images instead (one a row: bytes, paths, URLs or PIL images, as
        ``.llm.embed(images=)`` takes them; decoded on the workers), through an image-text
        ``embed_model`` (CLIP, SigLIP) that puts texts and images in one space: text-to-image
        search with ``right_images=True``, image-to-image with both. A text-only model is
        refused at call time (on Dask, when only the workers have it: each row's error); an
        unreadable image is its row's error. See docs/semantic.md."""
        from dfllm.semantic.join import semantic_sim_join

        return semantic_sim_join(
            FrameAdapter.of(self),
            other,
            left_on,
            right_on,
            k,
            embed_model=embed_model,
            suffix=suffix,
            similarity_column=similarity_column,
            min_similarity=min_similarity,
            resources=resources,
            return_stats=return_stats,
            engine_kwargs=engine_kwargs,
            left_images=left_images,
            right_images=right_images,
        )

    def dedup(
        self,
        column: str,
        *,
        images: bool = False,
        threshold: float = 0.9,
        confirm=False,
        model=None,
        embed_model=None,
        cluster_column: str = "cluster_id",
        representative_column: str = "is_representative",
        chat: bool = True,
        on_error: str = "null",
        resources: dict | None = None,
        cache=None,
        return_stats: bool = False,
        **engine_kwargs,
    ):
        """Near-duplicate clusters of the texts in ``column``: rows whose embeddings
        (``embed_model``, default the bundled MiniLM) have cosine similarity ``>= threshold``
        are linked, and clusters are the connected components. ``confirm=True`` (or a statement
        about records A and B) has ``model`` judge each linked pair first (one True/False decode
        per pair); only confirmed pairs link. Every row is kept, with ``cluster_id`` (int: the
        row number, 0-based in the frame's order, of the cluster's first row),
        ``is_representative`` (that first row) and ``llm_error`` (a row that could not be
        embedded has null labels; a pair that could not be judged is reported on both rows).
        Drop duplicates with ``df[df.is_representative]``.

        ``images=True``: ``column`` holds images (one a row, as ``.llm.embed(images=)`` takes
        them; decoded on the workers), clustered by their embeddings under an image-text
        ``embed_model`` (CLIP, SigLIP; a text-only model is refused); ``confirm`` is refused
        with it. An unreadable image is its row's error (null labels). See docs/semantic.md."""
        from dfllm.semantic.dedup import semantic_dedup
        from dfllm.semantic.join import LLMArgs

        return semantic_dedup(
            FrameAdapter.of(self),
            column,
            LLMArgs(model, chat, on_error, resources, cache, engine_kwargs),
            threshold=threshold,
            confirm=confirm,
            embed_model=embed_model,
            cluster_column=cluster_column,
            representative_column=representative_column,
            return_stats=return_stats,
            images=images,
        )

    def agg(
        self,
        instruction: str,
        *,
        by=None,
        model=None,
        output_column: str = "summary",
        max_tokens: int = 128,
        chat: bool = True,
        split_every: int = 8,
        on_error: str = "null",
        resources: dict | None = None,
        cache=None,
        return_stats: bool = False,
        **engine_kwargs,
    ):
        """Summarise all rows (or each group of ``by``, a column or a list) into one text, as
        ``instruction`` asks (``"Summarise the complaints in {review}"``): one row per group with
        its keys, ``summary`` and ``llm_error``. Rows are packed into chunks whose prompts fit
        ``max_model_len`` (an engine argument; default the model's), each chunk summarised
        (greedy, ``max_tokens``), and the summaries folded the same way until one is left. On
        Dask a tree reduction: one summary per partition and group, folded ``split_every`` at a
        time. A row with a null field is left out and named in its group's ``llm_error``.
        See docs/semantic.md."""
        from dfllm.semantic.agg import semantic_agg
        from dfllm.semantic.join import LLMArgs

        return semantic_agg(
            FrameAdapter.of(self),
            instruction,
            LLMArgs(model, chat, on_error, resources, cache, engine_kwargs),
            by=by,
            output_column=output_column,
            max_tokens=max_tokens,
            split_every=split_every,
            return_stats=return_stats,
        )


def _judge(args: dict, **fields):
    """``.llm.judge`` or ``.llm.filter`` from the method's arguments ``args`` (its ``locals()``:
    but the frame, the instruction, ``cascade`` and ``return_stats``, each the
    :class:`~dfllm.semantic.filter.Judgment` field of its name) and the judgment's other ``fields``."""
    from dfllm.semantic.filter import Judgment

    args = dict(args)
    frame, instruction = FrameAdapter.of(args.pop("self")), args.pop("instruction")
    cascade, return_stats = args.pop("cascade"), args.pop("return_stats")
    return semantic_judge(frame, instruction, Judgment(**args, **fields), cascade, return_stats)


def semantic_judge(frame: FrameAdapter, instruction: str, j: Judgment, cascade, return_stats: bool):
    """``.llm.judge`` (``j.keep``) and ``.llm.filter``: see their docstrings."""
    from dfllm.semantic.cascade import cascade_judge
    from dfllm.semantic.filter import judge_step
    from dfllm.semantic.frames import check_output_names, run_step

    new = j.output_columns
    check_output_names(j.what, new)
    if len(set(new)) != len(new):
        raise ValueError(f"{j.what}: the output columns {new} must differ")
    clash = sorted(set(new) & set(frame.columns)) if j.keep else []
    if j.return_explanations and not j.keep and j.explanation_column in frame.columns:
        clash = [j.explanation_column]
    if clash:
        raise ValueError(f"{j.what}: output column(s) {clash} already exist; choose other names")
    if cascade is not None:
        return cascade_judge(frame, instruction, cascade, j, return_stats)
    if return_stats:
        raise ValueError(f"{j.what}: return_stats reports a cascade's figures; pass cascade= as well")
    return run_step(frame, judge_step(frame, instruction, j))
