"""``.llm`` on Dask DataFrames and Series: lazy, with exact ``meta``, one task per partition.

Partitions run wherever Dask schedules them; on a distributed cluster each worker process
keeps one engine per model configuration (see :mod:`dfllm.worker.engine_cache`). Tasks
are named ``llm-<task>`` in the dashboard's task stream. ``resources=`` keeps the engine
work on workers declaring those resources (see :mod:`dfllm.accessors.placement`). The
result carries its task: its expression maps its source frame with a
:class:`PartitionFunction`, a :class:`WritableFunction`, which is how
:func:`dfllm.write_parquet` finds them (a processor's result maps its source with one too,
see :mod:`dfllm.jobs.processor`).
"""

from __future__ import annotations

import dataclasses

import dask.dataframe as dd
import pandas as pd
from dask.dataframe.extensions import register_dataframe_accessor, register_series_accessor

from dfllm.accessors.frontend import SERIES_INPUT, LLMFrameMethods, LLMSeriesMethods
from dfllm.accessors.placement import check_resources, model_check, run_placed
from dfllm.accessors.semantic.methods import SemanticFrameMethods
from dfllm.tasks.kinds import ENGINE_ARROW_TYPES
from dfllm.tasks.schema import LLM_ERROR
from dfllm.tasks.task import LLMTask
from dfllm.tasks.write_key import AdapterSource, canonical


class WritableFunction:
    """A function a result maps over its source frame's partitions that
    :func:`dfllm.write_parquet` can write resumably. Called on one pandas partition, it
    returns that partition's output (placed as its work needs). The writer reads:

    - ``write_key``: text naming everything but the partition's rows that decides the
      output (equal keys on equal rows give equal outputs; a changed key recomputes);
    - ``error_column``: the output column holding failed rows' messages (None: none);
    - ``kind``: lower-case letters naming the write's tasks (``llm-write-<kind>-<i>-<run>``);
    - ``resources``: the worker resources the write's tasks ask for (None: any worker);
    - ``model_sources()``: the models whose files' identity enters each partition's key
      (computed on the worker that writes it; see :func:`dfllm.tasks.write_key.model_key`);
    - ``arrow_types()``: the Arrow types of output columns that ``meta`` holds as ``object``.
    """

    kind: str
    resources: dict | None = None
    error_column: str | None = LLM_ERROR

    @property
    def write_key(self) -> str:
        raise NotImplementedError

    def model_sources(self) -> tuple:
        return ()

    def arrow_types(self) -> dict:
        return {}

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        raise NotImplementedError


class PartitionFunction(WritableFunction):
    """What a Dask ``.llm`` call maps over the partitions: ``run_task`` of ``task``, placed
    on workers declaring ``resources``. Picklable, and named ``llm-<kind>`` for the dashboard."""

    def __init__(self, task: LLMTask, resources: dict | None = None):
        self.task, self.resources = task, resources
        self.kind = task.kind
        self.__name__ = f"llm-{task.kind}"

    @property
    def write_key(self) -> str:
        # every field (the model's name, sampling and engine settings) but the response cache,
        # which decides no output: a resumed write may add, move or drop it
        return canonical(dataclasses.replace(self.task, cache=None))

    def model_sources(self) -> tuple:
        # an adapter for every row by its files (a per-row column's adapters are in the rows' data)
        if self.task.lora is not None:
            return (self.task.model, AdapterSource(self.task.lora, self.task.lora_root))
        return (self.task.model,)

    def arrow_types(self) -> dict:
        return {c: ENGINE_ARROW_TYPES[c] for c in self.task.engine_columns if c in ENGINE_ARROW_TYPES}

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        return run_placed(df, self.task, self.resources)

    def __dask_tokenize__(self):
        return (type(self).__name__, self.task, sorted((self.resources or {}).items()))

    def __repr__(self) -> str:
        return f"PartitionFunction({self.task!r}, resources={self.resources!r})"


def llm_origin(result) -> tuple | None:
    """``(source frame, function)`` of a result that maps its source frame's partitions with
    a :class:`WritableFunction` (the direct result of a Dask ``.llm`` call or of a
    processor), else None."""
    from dask.dataframe.dask_expr import new_collection
    from dask.dataframe.dask_expr._expr import MapPartitions

    expr = getattr(result, "expr", None)
    if not isinstance(expr, MapPartitions) or not isinstance(expr.func, WritableFunction):
        return None
    if len(expr.args) > 1 or expr.kwargs:  # more than the frame: not one partition in, one out
        return None
    return new_collection(expr.frame), expr.func


def output_meta(meta: pd.DataFrame, task: LLMTask) -> pd.DataFrame:
    """The input's meta plus the task's typed output columns (no model is run)."""
    cols = pd.DataFrame({c: pd.Series([], dtype=d) for c, d in task.output_dtypes().items()}, index=meta.index)
    return pd.concat([meta, cols], axis=1)


@register_dataframe_accessor("llm")
class DaskLLMAccessor(SemanticFrameMethods, LLMFrameMethods):
    def _model_check(self, resources: dict | None):
        return model_check(check_resources(resources))

    def _apply(self, task: LLMTask, resources: dict | None = None) -> dd.DataFrame:
        resources = check_resources(resources)
        return self._obj.map_partitions(PartitionFunction(task, resources), meta=output_meta(self._obj._meta, task))


@register_series_accessor("llm")
class DaskSeriesLLMAccessor(LLMSeriesMethods):
    frame_methods = DaskLLMAccessor

    def _frame(self, other=None) -> dd.DataFrame:
        frame = self._obj.to_frame(name=SERIES_INPUT)
        if other is not None:
            frame[SERIES_INPUT + "2"] = other
        return frame

    def _main(self, frame: dd.DataFrame, column: str) -> dd.Series:
        return frame[column].rename(self._obj.name)
