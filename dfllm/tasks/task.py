"""What an accessor call asks for: a small picklable :class:`LLMTask` (columns or
template, model, sampling settings), checked at call time by :func:`make_task`.

Running it on a partition is :func:`dfllm.tasks.runners.run_task`; the task kinds and
their output columns are in :mod:`dfllm.tasks.kinds`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from dfllm.beam_search import BeamSearchParams
from dfllm.engine_args import DATAFRAME_MAX_CPU_LORAS, DATAFRAME_MAX_LORAS, ENGINE_ARG_NAMES
from dfllm.errors import value_repr
from dfllm.inputs import check_nesting, check_unicode
from dfllm.pooling_params import PoolingParams
from dfllm.reasoning import reasoning_parser_of
from dfllm.sampling_params import SamplingParams
from dfllm.structured_outputs import StructuredOutputsParams
from dfllm.tasks.kinds import KINDS, TaskKind, task_kind
from dfllm.tasks.response_cache import ResponseCache, as_cache
from dfllm.tasks.schema import BEAMS, LLM_ERROR, REASONING_CONTENT, SORT_BY_PROMPT
from dfllm.tasks.templates import is_template, template_fields

ON_ERROR = ("null", "raise")


@dataclass(frozen=True)
class LLMTask:
    """One accessor call: which columns (or template) feed which task of which model."""

    kind: str
    inputs: tuple[str, ...]
    output_column: str
    model: str | None = None
    sampling: tuple = ()  # SamplingParams fields as sorted (key, value) pairs
    sampling_column: str | None = None
    system: str | None = None
    on_error: str = "null"
    engine_kwargs: tuple = field(default=())
    structured: tuple = ()  # ("json", schema text) or ("choice", values): a typed main column
    chat_template: str | None = None  # chat: a Jinja template replacing the tokenizer's
    # engine columns (dfllm.tasks.kinds.ENGINE_COLUMNS) to add besides the kind's own
    engine_columns: tuple[str, ...] = ()
    pooling: tuple = ()  # pooling kinds: PoolingParams fields as sorted (key, value) pairs
    pooling_column: str | None = None  # pooling kinds: a column of each row's PoolingParams fields
    chat_template_kwargs: tuple = ()  # chat: extra template variables as sorted (key, value) pairs
    chat_template_kwargs_column: str | None = None  # chat: a column of each row's own (merged over those)
    # chat: a conversation whose last message is not the user's is continued (the template's
    # continue_final_message, no generation prompt), as Ray Data LLM's chat template stage does
    continue_final_message: bool = False
    prompt_token_ids_column: str | None = None  # generative: a column of token id lists, used where not null
    # generative: the keys a partition's requests are sorted by before they go to the engine
    # (column names, or schema.SORT_BY_PROMPT for the rendered prompt); outputs keep row order
    sort_by: tuple[str, ...] = ()
    # generative: the response cache deterministic requests are answered from and stored in
    # (dfllm.tasks.response_cache); it decides no output, so a resumed write's key leaves it out
    cache: ResponseCache | None = None
    # generate, chat, embed: a column of each row's image(s), decoded on the worker (dfllm.tasks.images)
    images: str | None = None
    # generate, chat: LoRA adapters (dfllm.lora.resolve): one for every row, or a column of each row's
    # (null: the base model), and the root bare adapter names are looked up under
    lora: str | None = None
    lora_column: str | None = None
    lora_root: str | None = None
    # generate, chat: ``sampling_params=BeamSearchParams(...)``: its fields as sorted (key, value)
    # pairs; each row is a beam search (the best beam in the output column, all in ``beams``)
    beam_search: tuple = ()

    @property
    def spec(self) -> TaskKind:
        """The task's kind (its columns, runner...)."""
        return task_kind(self.kind)

    @property
    def templates(self) -> list[str]:
        return [i for i in self.inputs if is_template(i)]

    def columns_needed(self) -> set[str]:
        cols = {c for i in self.inputs for c in (template_fields(i) if is_template(i) else [i])}
        extra = (
            self.sampling_column,
            self.pooling_column,
            self.chat_template_kwargs_column,
            self.prompt_token_ids_column,
            self.images,
            self.lora_column,
        )
        return cols | {c for c in extra if c} | {c for c in self.sort_by if c != SORT_BY_PROMPT}

    @property
    def reasoning(self) -> bool:
        """Whether a generative task's engine has a reasoning parser (``reasoning_parser=``):
        its rows then get a ``reasoning_content`` column (see :mod:`dfllm.reasoning`)."""
        return self.spec.generative and reasoning_parser_of(dict(self.engine_kwargs)) is not None

    def output_dtypes(self) -> dict:
        """The columns the task adds, in order, with their dtypes (``llm_error`` last)."""
        return self.spec.output_dtypes(
            self.output_column, self.structured, self.engine_columns, self.reasoning, bool(self.beam_search)
        )

    def beam_params(self) -> BeamSearchParams | None:
        """The task's beam search (None: it samples), with its ``json_schema``/``choice``
        constraint as the beams' structured outputs."""
        if not self.beam_search:
            return None
        params = BeamSearchParams(**dict(self.beam_search))
        so = self.structured_params()
        return params if so is None else dataclasses.replace(params, structured_outputs=so)

    def pooling_params(self) -> PoolingParams:
        """The task's PoolingParams (a row's own replace them, with a pooling column)."""
        return PoolingParams(**dict(self.pooling))

    def structured_params(self) -> StructuredOutputsParams | None:
        if not self.structured:
            return None
        kind, value = self.structured
        return StructuredOutputsParams(json=value) if kind == "json" else StructuredOutputsParams(choice=list(value))


def make_task(
    kind: str,
    inputs: tuple[str, ...],
    columns,
    *,
    output_column: str,
    model=None,
    sampling_params=None,
    system: str | None = None,
    on_error: str = "null",
    engine_kwargs: dict | None = None,
    json_schema=None,
    choice=None,
    chat_template: str | None = None,
    model_check: Callable[[LLMTask], None] | None = None,
    engine_columns: tuple[str, ...] = (),
    pooling_params=None,
    chat_template_kwargs=None,
    continue_final_message: bool = False,
    prompt_token_ids: str | None = None,
    sort_by: str | list[str] | tuple[str, ...] | None = None,
    cache=None,
    images: str | None = None,
    lora: str | None = None,
    lora_root: str | None = None,
) -> LLMTask:
    """Check an accessor call against the frame's columns and build its task (raises ``ValueError``).

    ``model_check`` checks the task's model (default: :func:`check_model`, here and now).
    ``engine_columns`` are engine columns of the kind to add (see
    :data:`dfllm.tasks.kinds.ENGINE_COLUMNS`); ``pooling_params`` (pooling kinds) and
    ``chat_template_kwargs`` (chat) are a dict (``PoolingParams`` too) for every row, or
    the name of a column of each row's own; ``continue_final_message`` (chat) continues a
    conversation whose last message is not the user's; ``prompt_token_ids`` (generative)
    names a column of token id lists generated from where not null. ``sort_by`` (generative)
    is a key or a list of keys, each a column name or ``"prompt"`` (the rendered prompt):
    each partition's requests go to the engine in that order (see :func:`check_sort_by`).
    ``cache`` (generative) is a response cache (a path or URL, a :class:`ResponseCache` or a
    dict of its fields; see :func:`dfllm.tasks.response_cache.as_cache`). ``images``
    (generate, chat, embed) names a column of each row's image or list of images (embed:
    then no text input; see :mod:`dfllm.tasks.images`). ``lora`` (generate, chat) is a
    column of each row's LoRA adapter, or one adapter for every row (see :func:`_lora`)."""
    spec = task_kind(kind)
    _check_images(kind, images, inputs, columns)
    if len(inputs) != spec.inputs and not (kind == "embed" and images is not None):
        raise ValueError(f"{kind} takes {spec.inputs} input column(s) or template(s), got {len(inputs)}")
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    for i in inputs:
        if not isinstance(i, str):
            raise ValueError(f"{kind}: expected a column name or a template string, got {type(i).__name__}")
        check_unicode(i, f"{kind}: the template or column name {i!r}")
    beam = _beam_search(sampling_params, kind, images)
    sampling, sampling_column = _sampling(None if beam else sampling_params, columns, kind)
    structured = _structured(json_schema, choice, kind, sampling if not beam else beam)
    pooling, pooling_column = _pooling(pooling_params, columns, kind)
    ctk, ctk_column = _chat_template_kwargs(chat_template_kwargs, columns, kind)
    engine_columns = _names(engine_columns, "engine_columns", kind)
    unknown = sorted(set(engine_columns) - set(spec.engine_columns))
    if unknown:
        raise ValueError(f"{kind}: unknown engine column(s) {unknown}; {kind} gives {list(spec.engine_columns)}")
    if prompt_token_ids is not None and (not spec.generative or prompt_token_ids not in columns):
        raise ValueError(f"{kind}: prompt_token_ids must name a column of the dataframe, for generate or chat")
    if continue_final_message and kind != "chat":
        raise ValueError("continue_final_message is only for chat")
    sort_keys = check_sort_by(sort_by, columns, kind)
    response_cache = as_cache(cache)
    if response_cache is not None and not spec.generative:
        raise ValueError(f"{kind} takes no cache (the response cache is for generate and chat)")
    lora_one, lora_column, engine_kwargs = _lora(lora, lora_root, columns, kind, engine_kwargs)
    task = LLMTask(
        kind,
        tuple(inputs),
        output_column,
        None if model is None else str(model),
        sampling,
        sampling_column,
        system,
        on_error,
        tuple(sorted((engine_kwargs or {}).items())),
        structured=structured,
        chat_template=chat_template,
        engine_columns=tuple(dict.fromkeys(engine_columns)),
        pooling=pooling,
        pooling_column=pooling_column,
        chat_template_kwargs=ctk,
        chat_template_kwargs_column=ctk_column,
        continue_final_message=bool(continue_final_message),
        prompt_token_ids_column=prompt_token_ids,
        sort_by=sort_keys,
        cache=response_cache,
        images=images,
        lora=lora_one,
        lora_column=lora_column,
        lora_root=lora_root,
        beam_search=beam,
    )
    if chat_template is not None and (kind != "chat" or not isinstance(chat_template, str)):
        raise ValueError("chat_template must be a string (a Jinja template), and only chat takes one")
    names = list(columns)  # as they are: a pandas column 0 is not the field {0}
    missing = sorted(task.columns_needed() - set(names))
    if missing:
        raise ValueError(f"{kind}: column(s) {missing} not in the dataframe (columns: {names})")
    twice = sorted(c for c in repeated_columns(names) if c in task.columns_needed())
    if twice:  # which of them a row's value comes from would be a guess
        raise ValueError(f"{kind}: the dataframe has more than one column named {twice}; rename them")
    try:  # an unknown reasoning parser fails now, naming the call
        reasoning = [REASONING_CONTENT] if task.reasoning else []
    except ValueError as exc:
        raise ValueError(f"{kind}: {exc}") from None
    beams = [BEAMS] if beam else []
    own = [
        output_column,
        *(name for name, _ in spec.other_columns),
        *beams,
        *task.engine_columns,
        *reasoning,
        LLM_ERROR,
    ]
    if own.count(output_column) > 1:
        raise ValueError(
            f"{kind}: output_column {output_column!r} is one of the columns {kind} itself writes "
            f"({list(dict.fromkeys(own))}); choose another output_column"
        )
    clash = sorted(set(task.output_dtypes()) & set(map(str, columns)))
    if clash:
        raise ValueError(f"{kind}: output column(s) {clash} already exist; choose another output_column")
    _check_engine_kwargs(kind, engine_kwargs or {})
    (model_check or check_model)(task)
    return task


def _lora(lora, root, columns, kind: str, engine_kwargs: dict | None) -> tuple[str | None, str | None, dict]:
    """``lora=``: None, a column of the dataframe (each row's adapter), or an adapter for every
    row (a path or URL, checked on the workers); ``(adapter, column, engine_kwargs)`` with
    ``enable_lora`` (and the dataframe jobs' ``max_loras``, see the field) added unless given."""
    kwargs = dict(engine_kwargs or {})
    if lora is None:
        if root is not None:
            raise ValueError(f"{kind}: lora_root is the folder of the adapters lora= names; pass lora= too")
        return None, None, kwargs
    if kind not in ("generate", "chat"):
        raise ValueError(f"{kind} takes no LoRA adapters (lora= is for generate and chat)")
    if not isinstance(lora, str) or not lora:
        raise ValueError(f"{kind}: lora must be a column name or an adapter's path or URL, got {value_repr(lora)}")
    if root is not None and not isinstance(root, str):
        raise ValueError(f"{kind}: lora_root must be a folder path or URL, got {root!r}")
    kwargs.setdefault("enable_lora", True)
    kwargs.setdefault("max_loras", DATAFRAME_MAX_LORAS)
    if isinstance(kwargs["max_loras"], int):  # every adapter of a partition stays read
        kwargs.setdefault("max_cpu_loras", max(DATAFRAME_MAX_CPU_LORAS, kwargs["max_loras"]))
    if lora in list(map(str, columns)):
        return None, lora, kwargs
    return lora, None, kwargs


def _check_images(kind: str, images, inputs: tuple, columns) -> None:
    """``images=``: None, or the name of a column, for generate, chat or embed (embed reads
    text or images, not both); ``ValueError`` otherwise. Its values are read on the workers."""
    if images is None:
        if kind == "embed" and not inputs:
            raise ValueError("embed needs a text column or template, or images=... (a column of images)")
        return
    if kind not in ("generate", "chat", "embed"):
        raise ValueError(f"{kind} takes no images (images= is for generate, chat and embed)")
    if not isinstance(images, str) or images not in list(map(str, columns)):
        raise ValueError(
            f"{kind}: images must name a column of the dataframe (of image bytes, paths or URLs, or "
            f"PIL images), got {images!r}; columns: {list(columns)}"
        )
    if kind == "embed" and inputs:
        raise ValueError(
            "embed takes text or images=, not both: an embedding is of a text or of an image "
            "(embed the two columns in two calls; they share one space)"
        )


def _names(value, what: str, kind: str) -> tuple[str, ...]:
    """A name or a list of names (None: none) as a tuple of strings, in order, once each."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{kind}: {what} must be a name or a list of names, got {value!r}")
    return tuple(dict.fromkeys(value))


def check_sort_by(sort_by, columns, kind: str) -> tuple[str, ...]:
    """``sort_by=`` as the task's sort keys; ``ValueError`` naming a key that is not a column.

    A key is a column name, or ``"prompt"``: the row's prompt as the engine gets it (after
    the template and the chat template: its token ids), so that rows sharing a prefix are
    adjacent. ``"prompt"`` means that even where the frame has a column called ``prompt``
    (the same thing when that column is generate's input). Only generate and chat sort."""
    keys = _names(sort_by, "sort_by", kind)
    if keys and not KINDS[kind].generative:
        raise ValueError(f"{kind} takes no sort_by (it orders the requests of generate and chat)")
    names = list(map(str, columns))
    for key in keys:
        if key != SORT_BY_PROMPT and key not in names:
            raise ValueError(
                f"{kind}: sort_by column {key!r} not in the dataframe (columns: {names}); sort_by "
                f"takes column names, or {SORT_BY_PROMPT!r} for the rendered prompt"
            )
    return keys


def _check_engine_kwargs(kind: str, engine_kwargs: dict) -> None:
    """Extra keyword arguments go to ``LLM(...)``: unknown names fail now, not on a worker."""
    known = set(ENGINE_ARG_NAMES)
    unknown = sorted(set(engine_kwargs) - known)
    if unknown:
        raise ValueError(
            f"{kind}: unknown argument(s) {unknown}: extra keyword arguments go to dfllm.LLM, "
            f"which takes {sorted(known)}"
        )


def _sampling(sampling_params, columns, kind: str) -> tuple[tuple, str | None]:
    if sampling_params is None:
        return (), None
    if isinstance(sampling_params, str):
        if sampling_params not in columns:
            raise ValueError(f"{kind}: sampling_params column {sampling_params!r} not in the dataframe")
        return (), sampling_params
    if isinstance(sampling_params, dict):
        sampling_params = SamplingParams.from_dict(sampling_params)
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(
            "sampling_params must be a SamplingParams, a BeamSearchParams, a dict, or the name of a column of dicts"
        )
    if not KINDS[kind].generative:
        raise ValueError(f"{kind} takes no sampling_params")
    if sampling_params.n != 1:
        raise ValueError("sampling_params.n must be 1 in a dataframe (one output per row)")
    fields = {k: v for k, v in vars(sampling_params).items() if not k.startswith("_")}
    return tuple(sorted((k, _hashable(v)) for k, v in fields.items())), None


def _beam_search(sampling_params, kind: str, images) -> tuple:
    """``sampling_params=BeamSearchParams(...)`` as the task's hashable beam search fields (empty
    for anything else); only generate and chat search, and not with images."""
    if not isinstance(sampling_params, BeamSearchParams):
        return ()
    if not KINDS[kind].generative:
        raise ValueError(f"{kind} takes no sampling_params")
    if images is not None:
        raise ValueError(f"{kind}: beam search (BeamSearchParams) does not take images")
    return tuple(sorted(vars(sampling_params).items()))


def _pooling(pooling_params, columns, kind: str) -> tuple[tuple, str | None]:
    """``pooling_params=`` as the task's hashable fields, or the name of a column."""
    if pooling_params is None:
        return (), None
    if KINDS[kind].generative:
        raise ValueError(f"{kind} takes no pooling_params (they are for embed, classify and score)")
    if isinstance(pooling_params, str):
        if pooling_params not in columns:
            raise ValueError(f"{kind}: pooling_params column {pooling_params!r} not in the dataframe")
        return (), pooling_params
    if isinstance(pooling_params, dict):
        pooling_params = pooling_params_from(pooling_params)
    if not isinstance(pooling_params, PoolingParams):
        raise ValueError("pooling_params must be a PoolingParams, a dict, or the name of a column of dicts")
    return tuple(sorted(vars(pooling_params).items())), None


def pooling_params_from(fields) -> PoolingParams:
    """A dict of PoolingParams fields (null ones unset) as PoolingParams; ``ValueError``
    naming an unknown field or a bad value."""
    known = set(PoolingParams.__dataclass_fields__)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown PoolingParams field(s) {unknown}; it has {sorted(known)}")
    return PoolingParams(**{k: v for k, v in fields.items() if v is not None})


def _chat_template_kwargs(value, columns, kind: str) -> tuple[tuple, str | None]:
    """``chat_template_kwargs=`` as hashable pairs, or the name of a column."""
    if value is None:
        return (), None
    if kind != "chat":
        raise ValueError("chat_template_kwargs are only for chat")
    if isinstance(value, str):
        if value not in columns:
            raise ValueError(f"{kind}: chat_template_kwargs column {value!r} not in the dataframe")
        return (), value
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError("chat_template_kwargs must be a dict of template variables (or a column name)")
    check_nesting(value, "chat_template_kwargs", "variable")  # _frozen recurses
    return tuple(sorted((k, _frozen(v)) for k, v in value.items())), None


def _frozen(v):
    """A template variable's value, hashable (lists as tuples, dicts as sorted pairs tagged
    so that :func:`thawed` gives them back)."""
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    if isinstance(v, dict):
        return ("__dict__", tuple(sorted((k, _frozen(x)) for k, x in v.items())))
    return v


def thawed(v):
    """The value :func:`_frozen` froze."""
    if isinstance(v, tuple) and len(v) == 2 and v[0] == "__dict__":
        return {k: thawed(x) for k, x in v[1]}
    if isinstance(v, tuple):
        return [thawed(x) for x in v]
    return v


def _structured(json_schema, choice, kind: str, sampling: tuple) -> tuple:
    """``json_schema=`` / ``choice=`` as the task's hashable constraint (checked now)."""
    if json_schema is None and choice is None:
        return ()
    if not KINDS[kind].generative:
        raise ValueError(f"{kind} takes no json_schema or choice")
    if json_schema is not None and choice is not None:
        raise ValueError(f"{kind}: pass json_schema or choice, not both")
    if dict(sampling).get("structured_outputs") is not None:
        raise ValueError(f"{kind}: sampling_params already has structured_outputs; pass the constraint once")
    if choice is not None:
        so = StructuredOutputsParams(choice=choice)
        return ("choice", tuple(so.choice or ()))
    so = StructuredOutputsParams(json=json_schema)
    structured = ("json", so.key[1])
    try:
        KINDS[kind].output_dtypes("x", structured)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{kind}: json_schema has no Arrow type: {exc!r}") from None
    return structured


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


def check_model(task: LLMTask) -> None:
    """Unknown names and unusable directories raise now, not in every partition at compute time."""
    from dfllm.models.bundled import resolve_model
    from dfllm.models.loader import check_model_dir

    check_model_dir(resolve_model(task.model))


def repeated_columns(columns) -> list:
    """The names a frame's columns hold more than once, in order (which of those columns a
    row's value would come from is a guess: every caller refuses them by name)."""
    names = list(columns)
    return list(dict.fromkeys(c for c in names if names.count(c) > 1))
