"""The methods of ``.llm``, shared by every dataframe library: one signature per method.

Each method checks its arguments against the frame's columns (raising ``ValueError`` at
call time) and hands an :class:`~dfllm.tasks.task.LLMTask` to the library's
``_apply``. Defaults (from :data:`~dfllm.tasks.kinds.KINDS`): ``generate``/``chat``
use the bundled chat model, ``embed``/``score`` the bundled all-MiniLM-L6-v2; ``classify``
needs a ``model``.
"""

from __future__ import annotations

from dfllm.accessors.adapter import FrameAdapter
from dfllm.tasks.kinds import KINDS
from dfllm.tasks.task import LLMTask, make_task

_COLUMN = {name: kind.output_column for name, kind in KINDS.items()}  # each method's main output column
_NOT_TASK_ARGUMENTS = ("self", "prompt", "messages", "text", "left", "right")  # the methods' inputs


class LLMFrameMethods:
    """``df.llm``: methods that add result columns to a dataframe."""

    def __init__(self, obj):
        self._obj = obj

    @classmethod
    def add_methods(cls, methods: type) -> None:
        """Puts ``methods``' public functions on every library's ``df.llm``: how a floor above
        the accessors (the semantic operators, ``dfllm.semantic``) adds its methods without an
        import from here. They reach the frame through :class:`~dfllm.accessors.adapter.FrameAdapter`."""
        for name, value in vars(methods).items():
            if not name.startswith("_"):
                setattr(cls, name, value)

    def _columns(self) -> list[str]:
        return FrameAdapter(self._obj).columns

    def _apply(self, task: LLMTask, resources: dict | None = None):
        raise NotImplementedError

    def _model_check(self, resources: dict | None):
        """How the call checks its model (None: here, now). Dask overrides it: a model
        directory that only the workers have is checked on a worker."""
        if resources is not None:
            raise ValueError(
                f"resources= places Dask tasks on workers that declare them; a "
                f"{type(self._obj).__module__.split('.')[0]} frame runs in this process"
            )
        return None

    def _call(self, kind: str, inputs: tuple, resources: dict | None, *, model=None, **kwargs):
        spec = KINDS[kind]
        if model is None and spec.model_required:
            raise ValueError(f"{kind} needs {spec.model_required}: pass model=...")
        if not model and spec.default_model:
            model = spec.default_model
        check = self._model_check(resources)
        return self._apply(
            make_task(kind, inputs, self._columns(), model=model, model_check=check, **kwargs), resources
        )

    def _forward(self, kind: str, inputs: tuple, args: dict):
        """:meth:`_call` from a method's arguments ``args`` (its ``locals()``): ``resources``,
        and each other one but the inputs the :func:`make_task` keyword of the same name."""
        kwargs = {k: v for k, v in args.items() if k not in _NOT_TASK_ARGUMENTS}
        return self._call(kind, inputs, kwargs.pop("resources"), **kwargs)

    def generate(
        self,
        prompt: str,
        *,
        model=None,
        sampling_params=None,
        output_column: str = _COLUMN["generate"],
        on_error: str = "null",
        json_schema=None,
        choice=None,
        engine_columns=(),
        sort_by=None,
        resources: dict | None = None,
        cache=None,
        images: str | None = None,
        lora: str | None = None,
        lora_root: str | None = None,
        **engine_kwargs,
    ):
        """Complete ``prompt`` (a column, or a template such as ``"Q: {question}"``) for every row.

        Adds ``generated_text``, ``num_input_tokens``, ``num_generated_tokens``,
        ``finish_reason`` and ``llm_error``. ``sampling_params`` is a SamplingParams, a dict,
        or the name of a column of dicts (one per row).

        ``engine_columns`` (a name or a list of names) adds what the engine reports per row,
        before ``llm_error`` (see :data:`dfllm.tasks.kinds.ENGINE_COLUMNS`):
        ``"num_cached_tokens"`` (int64: prompt tokens served from the prefix cache, or by
        computing an identical request once), ``"rendered_prompt"``, ``"prompt_token_ids"``,
        ``"generated_tokens"``, ``"logprobs"``, ``"prompt_logprobs"``, ``"time_taken_llm"``,
        ``"from_cache"`` (bool: answered from the response cache).

        ``cache`` (a local path or fsspec URL, a :class:`dfllm.ResponseCache`, or a dict of its
        fields) answers deterministic rows (greedy, or seeded) asked before with the same
        model, prompt tokens and sampling params from that store, without the engine, and
        stores the others' outputs (docs/cache.md).

        ``sort_by`` (a key or a list of keys) sorts each partition's rows by a column (say
        ``"doc_id"``) or by ``"prompt"`` (the rendered prompt, so that rows sharing a prefix
        run one after another while it is in the prefix cache) before they go to the engine;
        the result keeps the rows' order and each row its own output (docs/prefix_cache.md).

        ``json_schema`` (a pydantic model class or a JSON schema dict) constrains every row's
        output to the schema and makes the output column an Arrow struct built from it;
        ``choice`` (a list of strings) makes it a categorical of those values. A row whose
        output did not complete within ``max_tokens`` gets null and an ``llm_error``.

        ``reasoning_parser="qwen3"`` (or ``"deepseek_r1"``; an engine argument, see
        :mod:`dfllm.reasoning`) splits a thinking model's output: the reasoning goes to a
        string column ``reasoning_content`` (before ``llm_error``), the output column keeps
        the answer, and ``json_schema``/``choice`` constrain the answer only.

        ``resources`` (Dask only), e.g. ``{"GPU": 0.25}``, makes the ``llm-*`` tasks run on
        workers declaring those resources (see :func:`dfllm.jobs.cluster.task_resources`),
        whatever computes or writes the result.

        ``images`` names a column of each row's image or list of images (PNG/JPEG bytes, a path
        or URL, a PIL image; null: none) for a vision-language model, given with the row's prompt
        as its ``multi_modal_data``; they are decoded on the workers, and a row whose image
        cannot be read gets its ``llm_error`` (docs/images.md).

        ``lora`` runs LoRA adapters (docs/lora.md): the name of a column of each row's adapter
        (a local folder, an fsspec URL, or with ``lora_root`` a folder name under it; null: the
        base model), or one adapter for every row. Adapters are read on the workers; rows of
        different adapters share batches; a row whose adapter cannot be read or does not fit
        the model gets its ``llm_error``. It turns on ``enable_lora`` (with ``max_loras=4``
        unless given).
        """
        return self._forward("generate", (prompt,), locals())

    def chat(
        self,
        messages: str,
        *,
        system: str | None = None,
        model=None,
        sampling_params=None,
        output_column: str = _COLUMN["chat"],
        on_error: str = "null",
        json_schema=None,
        choice=None,
        chat_template: str | None = None,
        engine_columns=(),
        sort_by=None,
        resources: dict | None = None,
        cache=None,
        images: str | None = None,
        lora: str | None = None,
        lora_root: str | None = None,
        **engine_kwargs,
    ):
        """Reply to ``messages`` (a column of conversations, or a template for one user turn);
        ``json_schema``, ``choice``, ``engine_columns``, ``sort_by``, ``resources`` and ``cache`` as in
        ``generate`` (``sort_by="prompt"`` sorts by the conversation as the chat template
        renders it); ``chat_template`` (Jinja text) replaces the tokenizer's template; ``images``
        as in ``generate``, each row's images going first into its last user turn; ``lora`` and
        ``lora_root`` as in ``generate``."""
        return self._forward("chat", (messages,), locals())

    def embed(
        self,
        text: str | None = None,
        *,
        model=None,
        output_column: str = _COLUMN["embed"],
        on_error: str = "null",
        resources: dict | None = None,
        images: str | None = None,
        **engine_kwargs,
    ):
        """Embed ``text`` (a column or template), or with ``images`` (instead of text) each row's
        image (a column as in ``generate``; an image-text model such as CLIP or SigLIP):
        a ``list<float32>`` column."""
        return self._forward("embed", () if text is None else (text,), locals())

    def score(
        self,
        left: str,
        right: str,
        *,
        model=None,
        output_column: str = _COLUMN["score"],
        on_error: str = "null",
        resources: dict | None = None,
        **engine_kwargs,
    ):
        """Score each row's ``left`` text against its ``right`` text: one float per row."""
        return self._forward("score", (left, right), locals())

    def classify(
        self,
        text: str,
        *,
        model=None,
        output_column: str = _COLUMN["classify"],
        on_error: str = "null",
        resources: dict | None = None,
        **engine_kwargs,
    ):
        """Classify ``text``: the top label's name and a ``probs`` column."""
        return self._forward("classify", (text,), locals())


SERIES_INPUT = "__dfllm_input__"


class LLMSeriesMethods:
    """``series.llm``: the same methods on a series of inputs, returning the main output series."""

    frame_methods: type

    def __init__(self, obj):
        self._obj = obj

    def _frame(self, other=None):
        raise NotImplementedError

    def _main(self, frame, column: str):
        raise NotImplementedError

    def _run(self, kind: str, kwargs: dict, other=None):
        frame = self.frame_methods(self._frame(other))
        inputs = (SERIES_INPUT, SERIES_INPUT + "2")[: KINDS[kind].inputs]
        return self._main(getattr(frame, kind)(*inputs, **kwargs), kwargs.get("output_column", _COLUMN[kind]))

    def generate(self, **kwargs):
        """Completions of the series' prompts (a series of text)."""
        return self._run("generate", kwargs)

    def chat(self, **kwargs):
        """Replies to the series' conversations (or to its texts as single user turns)."""
        return self._run("chat", kwargs)

    def embed(self, **kwargs):
        """Embeddings of the series' texts."""
        return self._run("embed", kwargs)

    def classify(self, **kwargs):
        """Top labels of the series' texts."""
        return self._run("classify", kwargs)

    def score(self, other, **kwargs):
        """Scores of the series' texts against ``other`` (a series aligned with it)."""
        return self._run("score", kwargs, other)
