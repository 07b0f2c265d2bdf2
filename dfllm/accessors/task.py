"""What an accessor call asks for: a small picklable :class:`LLMTask` (columns or
template, model, sampling settings), checked at call time by :func:`make_task`.

Running it on a partition is :func:`dfllm.accessors.runners.run_task`; the task kinds and
their output columns are in :mod:`dfllm.accessors.kinds`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dfllm.accessors.kinds import KINDS, TaskKind, task_kind
from dfllm.accessors.rows import is_template, template_fields
from dfllm.inputs import check_unicode
from dfllm.sampling_params import SamplingParams
from dfllm.structured_outputs import StructuredOutputsParams

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

    @property
    def spec(self) -> TaskKind:
        """The task's kind (its columns, runner...)."""
        return task_kind(self.kind)

    @property
    def templates(self) -> list[str]:
        return [i for i in self.inputs if is_template(i)]

    def columns_needed(self) -> set[str]:
        cols = {c for i in self.inputs for c in (template_fields(i) if is_template(i) else [i])}
        return cols | ({self.sampling_column} if self.sampling_column else set())

    def output_dtypes(self) -> dict:
        """The columns the task adds, in order, with their dtypes (``llm_error`` last)."""
        return self.spec.output_dtypes(self.output_column, self.structured)

    def structured_params(self) -> StructuredOutputsParams | None:
        if not self.structured:
            return None
        kind, value = self.structured
        return StructuredOutputsParams(json=value) if kind == "json" else StructuredOutputsParams(choice=list(value))


def make_task(kind: str, inputs: tuple[str, ...], columns, *, output_column: str, model=None,
              sampling_params=None, system: str | None = None, on_error: str = "null",
              engine_kwargs: dict | None = None, json_schema=None, choice=None,
              chat_template: str | None = None, model_check: Callable[[LLMTask], None] | None = None) -> LLMTask:
    """Check an accessor call against the frame's columns and build its task (raises ``ValueError``).

    ``model_check`` checks the task's model (default: :func:`check_model`, here and now)."""
    spec = task_kind(kind)
    if len(inputs) != spec.inputs:
        raise ValueError(f"{kind} takes {spec.inputs} input column(s) or template(s), got {len(inputs)}")
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    for i in inputs:
        if not isinstance(i, str):
            raise ValueError(f"{kind}: expected a column name or a template string, got {type(i).__name__}")
        check_unicode(i, f"{kind}: the template or column name {i!r}")
    sampling, sampling_column = _sampling(sampling_params, columns, kind)
    structured = _structured(json_schema, choice, kind, sampling)
    task = LLMTask(kind, tuple(inputs), output_column, None if model is None else str(model), sampling,
                   sampling_column, system, on_error, tuple(sorted((engine_kwargs or {}).items())),
                   structured=structured, chat_template=chat_template)
    if chat_template is not None and (kind != "chat" or not isinstance(chat_template, str)):
        raise ValueError("chat_template must be a string (a Jinja template), and only chat takes one")
    missing = sorted(task.columns_needed() - set(map(str, columns)))
    if missing:
        raise ValueError(f"{kind}: column(s) {missing} not in the dataframe (columns: {list(columns)})")
    clash = sorted(set(task.output_dtypes()) & set(map(str, columns)))
    if clash:
        raise ValueError(f"{kind}: output column(s) {clash} already exist; choose another output_column")
    _check_engine_kwargs(kind, engine_kwargs or {})
    (model_check or check_model)(task)
    return task


def _check_engine_kwargs(kind: str, engine_kwargs: dict) -> None:
    """Extra keyword arguments go to ``LLM(...)``: unknown names fail now, not on a worker."""
    import inspect

    from dfllm.llm import LLM

    known = set(inspect.signature(LLM.__init__).parameters) - {"self", "model"}
    unknown = sorted(set(engine_kwargs) - known)
    if unknown:
        raise ValueError(f"{kind}: unknown argument(s) {unknown}: extra keyword arguments go to dfllm.LLM, "
                         f"which takes {sorted(known)}")


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
        raise ValueError("sampling_params must be a SamplingParams, a dict, or the name of a column of dicts")
    if not KINDS[kind].generative:
        raise ValueError(f"{kind} takes no sampling_params")
    if sampling_params.n != 1:
        raise ValueError("sampling_params.n must be 1 in a dataframe (one output per row)")
    fields = {k: v for k, v in vars(sampling_params).items() if not k.startswith("_")}
    return tuple(sorted((k, _hashable(v)) for k, v in fields.items())), None


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
        return ("choice", tuple(so.choice))
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
