"""How a row-wise semantic operator runs on every dataframe library.

A row-wise operator is one ``.llm`` task (an :class:`~dfllm.tasks.task.LLMTask`:
``generate``/``chat`` with ``choice=``, ``json_schema=`` or logprobs) followed by a pandas
step that turns its output columns into the operator's (a verdict, typed fields, fewer
rows...). :class:`SemanticFunction` is the two together: picklable, mapped over a Dask
frame's partitions in one task each (lazy, with ``meta`` from running the step on the
task's empty output), and a :class:`~dfllm.accessors.partitions.WritableFunction`, so that
:func:`dfllm.write_parquet` writes it resumably as it writes any ``.llm`` task.
:func:`run_step` runs one on a pandas, Dask or Polars (eager or lazy) frame (a
:class:`~dfllm.accessors.adapter.FrameAdapter`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pandas as pd

from dfllm.accessors.adapter import FrameAdapter
from dfllm.accessors.arrow_schema import join_errors
from dfllm.accessors.partitions import WritableFunction, output_meta
from dfllm.accessors.placement import run_placed
from dfllm.tasks.schema import LLM_ERROR, STRING, error_text
from dfllm.tasks.task import LLMTask, make_task
from dfllm.tasks.write_key import canonical

#: An input column the task writes too is renamed to this prefix + its name while the task runs.
SHADOW = "__dfllm_in__"


class SemanticFunction(WritableFunction):
    """``post(run_task(partition, task))``: one semantic operator on one pandas partition.

    ``post`` is a picklable callable (a frozen dataclass, so that it enters the write key
    field by field) taking the partition with the task's output columns and returning the
    operator's output; it must accept an empty frame (that is how ``meta`` is made).

    ``shadow`` names input columns that the task writes as well (an ``llm_error`` from an
    earlier operator, a ``num_input_tokens`` from an earlier ``.llm`` call): they are renamed
    while the task runs and restored after ``post``, except ``llm_error``, whose earlier
    message is kept in front of the new one (``"<earlier>; <new>"``), so that chained
    operators lose no row's error."""

    def __init__(
        self,
        name: str,
        task: LLMTask,
        post: Callable[[pd.DataFrame], pd.DataFrame],
        resources: dict | None = None,
        shadow: tuple[str, ...] = (),
    ):
        if not name.isalpha() or not name.islower():
            raise ValueError(f"a semantic operator's name is lower-case letters, got {name!r}")
        self.name, self.task, self.post, self.resources = name, task, post, resources
        self.shadow = tuple(shadow)
        self.kind = f"sem{name}"
        self.__name__ = f"llm-sem-{name}"

    @property
    def write_key(self) -> str:
        # the task but its response cache (which decides no output) and the step after it
        return canonical({"task": dataclasses.replace(self.task, cache=None), "post": self.post, "shadow": self.shadow})

    def model_sources(self) -> tuple:
        return (self.task.model,)

    def meta(self, meta: pd.DataFrame) -> pd.DataFrame:
        """The output's (empty) frame for an input whose empty frame is ``meta``."""
        return self.apply(meta, lambda df, task: output_meta(df, task))

    def apply(self, df: pd.DataFrame, run: Callable[[pd.DataFrame, LLMTask], pd.DataFrame]) -> pd.DataFrame:
        """The operator on ``df``, the task run by ``run(frame, task)``."""
        if self.shadow:
            df = df.rename(columns={c: SHADOW + c for c in self.shadow})
        out = self.post(run(df, self.task))
        if not self.shadow:
            return out
        if LLM_ERROR in self.shadow:
            earlier = out.pop(SHADOW + LLM_ERROR)
            out[LLM_ERROR] = merge_errors(earlier, out[LLM_ERROR]) if LLM_ERROR in out else earlier
        return out.rename(columns={SHADOW + c: c for c in self.shadow})

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        return self.apply(df, lambda frame, task: run_placed(frame, task, self.resources))

    def __dask_tokenize__(self):
        return (
            type(self).__name__,
            self.name,
            self.task,
            canonical(self.post),
            self.shadow,
            sorted((self.resources or {}).items()),
        )

    def __repr__(self) -> str:
        return f"SemanticFunction({self.name!r}, {self.task!r}, {self.post!r}, resources={self.resources!r})"


def check_output_names(what: str, names) -> None:
    """``ValueError`` where an operator would add a column named as the error column
    (``llm_error``), which every result holds: the error column would overwrite it."""
    if LLM_ERROR in names:
        raise ValueError(f"{what}: an output column cannot be named {LLM_ERROR!r} (every result's error column)")


def earlier_errors(column: pd.Series) -> list[str | None]:
    """An earlier step's ``llm_error`` column as each row's message (None where null).

    The column is whatever that step left, of any type (all null, as a Polars ``Null``
    column or a parquet column of nulls reads; numbers; bytes; text holding a lone
    surrogate): each value is taken as text (:func:`~dfllm.tasks.schema.error_text`)."""
    return [error_text(v) for v in column.to_numpy(dtype=object, na_value=None)]


def merge_errors(earlier: pd.Series, new: pd.Series) -> pd.Series:
    """Each row's ``llm_error``: its earlier one (:func:`earlier_errors`), its new one, or both
    (``"<earlier>; <new>"``)."""
    news = new.to_numpy(dtype=object, na_value=None)
    return pd.Series([join_errors(a, b) for a, b in zip(earlier_errors(earlier), news)], index=new.index, dtype=STRING)


def task_columns(kind: str, output_column: str, engine_columns: tuple[str, ...] = ()) -> list[str]:
    """Every column a generative task of ``kind`` may write (a reasoning parser's included)."""
    from dfllm.tasks.kinds import KINDS

    return list(KINDS[kind].output_dtypes(output_column, (), engine_columns, reasoning=True))


def shadowed(
    columns,
    kind: str,
    output_column: str,
    engine_columns: tuple[str, ...] = (),
    fields: list[str] | tuple[str, ...] = (),
) -> tuple[tuple[str, ...], list[str]]:
    """``(shadow, columns)``: the input columns the task writes too, and the frame's columns
    as the task sees them (those renamed). ``ValueError`` if the instruction reads one of
    them (``fields``)."""
    written = set(task_columns(kind, output_column, engine_columns))
    shadow = tuple(c for c in map(str, columns) if c in written)
    read = sorted(set(shadow) & set(fields))
    if read:
        raise ValueError(f"the instruction reads column(s) {read}, which the operator writes itself; rename them")
    return shadow, [SHADOW + c if c in shadow else c for c in map(str, columns)]


def make_llm_task(
    frame: FrameAdapter,
    kind: str,
    inputs: tuple[str, ...],
    resources: dict | None,
    *,
    model=None,
    columns=None,
    **kwargs,
) -> LLMTask:
    """An ``.llm`` task of ``kind`` checked against the accessor's frame (or ``columns``), as
    the accessor's own methods check theirs (its model check), without running it."""
    from dfllm.tasks.kinds import KINDS

    spec = KINDS[kind]
    if not model and spec.default_model:
        model = spec.default_model
    return make_task(
        kind,
        inputs,
        frame.columns if columns is None else columns,
        model=model,
        model_check=frame.model_check(resources),
        **kwargs,
    )


def prompted_task(
    frame: FrameAdapter,
    preamble: str,
    instruction: str,
    fields: list[str],
    columns: list[str],
    *,
    answer: str,
    chat: bool,
    resources: dict | None,
    output_column: str,
    engine_columns: tuple[str, ...] = (),
    **kwargs,
) -> tuple[LLMTask, tuple[str, ...]]:
    """``(task, shadow)``: the ``.llm.chat`` (without ``chat``, ``.llm.generate``) task asking
    ``instruction`` (which reads ``fields``) of each row of a frame with ``columns``, in the
    prompt :func:`~dfllm.semantic.prompts.semantic_prompt` makes of ``preamble`` and
    ``answer``; ``shadow`` as :func:`shadowed` returns it, ``kwargs`` as :func:`make_llm_task`
    takes them."""
    from dfllm.semantic.prompts import semantic_prompt

    kind = "chat" if chat else "generate"
    shadow, seen = shadowed(columns, kind, output_column, engine_columns, fields)
    prompt = semantic_prompt(preamble, instruction, fields, answer=answer, chat=chat)
    if chat:
        kwargs["system"] = prompt.system
    task = make_llm_task(
        frame,
        kind,
        (prompt.template,),
        resources,
        columns=seen,
        output_column=output_column,
        engine_columns=engine_columns,
        **kwargs,
    )
    return task, shadow


def run_step(frame: FrameAdapter, step: SemanticFunction):
    """``step`` on the frame: eager for pandas and a Polars DataFrame, lazy for Dask (one task
    per partition, exact ``meta``) and a Polars LazyFrame."""
    from dfllm.tasks.runners import run_task

    return frame.map_pandas(
        lambda df: step.apply(df, lambda f, task: run_task(f, task, progress=True)), step, step.meta
    )
