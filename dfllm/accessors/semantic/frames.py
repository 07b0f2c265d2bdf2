"""How a row-wise semantic operator runs on every dataframe library.

A row-wise operator is one ``.llm`` task (an :class:`~dfllm.accessors.task.LLMTask`:
``generate``/``chat`` with ``choice=``, ``json_schema=`` or logprobs) followed by a pandas
step that turns its output columns into the operator's (a verdict, typed fields, fewer
rows...). :class:`SemanticFunction` is the two together: picklable, mapped over a Dask
frame's partitions in one task each (lazy, with ``meta`` from running the step on the
task's empty output), and a :class:`~dfllm.accessors.dask_ext.WritableFunction`, so that
:func:`dfllm.write_parquet` writes it resumably as it writes any ``.llm`` task.
:func:`run_step` runs one on a pandas, Dask or Polars (eager or lazy) frame.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pandas as pd

from dfllm.accessors.dask_ext import WritableFunction, output_meta
from dfllm.accessors.placement import run_placed
from dfllm.accessors.task import LLMTask, make_task
from dfllm.accessors.write_key import canonical


class SemanticFunction(WritableFunction):
    """``post(run_task(partition, task))``: one semantic operator on one pandas partition.

    ``post`` is a picklable callable (a frozen dataclass, so that it enters the write key
    field by field) taking the partition with the task's output columns and returning the
    operator's output; it must accept an empty frame (that is how ``meta`` is made)."""

    def __init__(self, name: str, task: LLMTask, post: Callable[[pd.DataFrame], pd.DataFrame],
                 resources: dict | None = None):
        if not name.isalpha() or not name.islower():
            raise ValueError(f"a semantic operator's name is lower-case letters, got {name!r}")
        self.name, self.task, self.post, self.resources = name, task, post, resources
        self.kind = f"sem{name}"
        self.__name__ = f"llm-sem-{name}"

    @property
    def write_key(self) -> str:
        # the task but its response cache (which decides no output) and the step after it
        return canonical({"task": dataclasses.replace(self.task, cache=None), "post": self.post})

    def model_sources(self) -> tuple:
        return (self.task.model,)

    def meta(self, meta: pd.DataFrame) -> pd.DataFrame:
        """The output's (empty) frame for an input whose empty frame is ``meta``."""
        return self.post(output_meta(meta, self.task))

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        return self.post(run_placed(df, self.task, self.resources))

    def __dask_tokenize__(self):
        return (type(self).__name__, self.name, self.task, canonical(self.post),
                sorted((self.resources or {}).items()))

    def __repr__(self) -> str:
        return f"SemanticFunction({self.name!r}, {self.task!r}, {self.post!r}, resources={self.resources!r})"


def make_llm_task(accessor, kind: str, inputs: tuple[str, ...], resources: dict | None, *, model=None,
                  **kwargs) -> LLMTask:
    """An ``.llm`` task of ``kind`` checked against the accessor's frame, as the accessor's
    own methods check theirs (its columns, its model check), without running it."""
    from dfllm.accessors.kinds import KINDS

    spec = KINDS[kind]
    if not model and spec.default_model:
        model = spec.default_model
    return make_task(kind, inputs, accessor._columns(), model=model, model_check=accessor._model_check(resources),
                     **kwargs)


def run_step(obj, step: SemanticFunction):
    """``step`` on a pandas, Dask or Polars frame: eager for pandas and a Polars DataFrame,
    lazy for Dask (one task per partition, exact ``meta``) and a Polars LazyFrame."""
    if isinstance(obj, pd.DataFrame):
        return _pandas(obj, step)
    import dask.dataframe as dd

    if isinstance(obj, dd.DataFrame):
        if step.resources is not None:
            from dfllm.accessors.placement import check_resources

            check_resources(step.resources)
        return obj.map_partitions(step, meta=step.meta(obj._meta))
    import polars as pl

    if isinstance(obj, pl.DataFrame):
        return _polars(obj, step)
    if isinstance(obj, pl.LazyFrame):
        empty = pl.DataFrame(schema=obj.collect_schema()).to_pandas(use_pyarrow_extension_array=True)
        schema = to_polars(step.meta(empty)).schema
        return obj.map_batches(lambda df: _polars(df, step), schema=schema)
    raise TypeError(f"semantic operators run on pandas, Dask and Polars frames, not {type(obj).__name__}")


def _pandas(df: pd.DataFrame, step: SemanticFunction) -> pd.DataFrame:
    from dfllm.accessors.runners import run_task

    return step.post(run_task(df, step.task, progress=True))


def _polars(df, step: SemanticFunction):
    return to_polars(_pandas(df.to_pandas(use_pyarrow_extension_array=True), step))


def to_polars(df: pd.DataFrame):
    """A pandas frame (Arrow-backed where the operators make it so) as a Polars frame."""
    import polars as pl

    return pl.from_pandas(df.reset_index(drop=True))
