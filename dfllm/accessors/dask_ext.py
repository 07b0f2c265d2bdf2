"""``.llm`` on Dask DataFrames and Series: lazy, with exact ``meta``, one task per partition.

Partitions run wherever Dask schedules them; on a distributed cluster each worker process
keeps one engine per model configuration (see :mod:`dfllm.accessors.engine_cache`). Tasks
are named ``llm-<task>`` in the dashboard's task stream. ``resources=`` keeps the engine
work on workers declaring those resources (see :mod:`dfllm.accessors.placement`). The
result carries its task: its expression maps its source frame with a
:class:`PartitionFunction`, which is how :func:`dfllm.write_parquet` finds them.
"""

from __future__ import annotations

import dask.dataframe as dd
import pandas as pd
from dask.dataframe.extensions import register_dataframe_accessor, register_series_accessor

from dfllm.accessors.frontend import SERIES_INPUT, LLMFrameMethods, LLMSeriesMethods
from dfllm.accessors.placement import check_resources, model_check, run_placed
from dfllm.accessors.task import LLMTask


class PartitionFunction:
    """What a Dask ``.llm`` call maps over the partitions: ``run_task`` of ``task``, placed
    on workers declaring ``resources``. Picklable, and named ``llm-<kind>`` for the dashboard."""

    def __init__(self, task: LLMTask, resources: dict | None = None):
        self.task, self.resources = task, resources
        self.__name__ = f"llm-{task.kind}"

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        return run_placed(df, self.task, self.resources)

    def __dask_tokenize__(self):
        return (type(self).__name__, self.task, sorted((self.resources or {}).items()))

    def __repr__(self) -> str:
        return f"PartitionFunction({self.task!r}, resources={self.resources!r})"


def llm_origin(result) -> tuple | None:
    """``(source frame, task, resources)`` of the direct result of a Dask ``.llm`` call, else None."""
    from dask.dataframe.dask_expr import new_collection
    from dask.dataframe.dask_expr._expr import MapPartitions

    expr = getattr(result, "expr", None)
    if not isinstance(expr, MapPartitions) or not isinstance(expr.func, PartitionFunction):
        return None
    return new_collection(expr.frame), expr.func.task, expr.func.resources


def output_meta(meta: pd.DataFrame, task: LLMTask) -> pd.DataFrame:
    """The input's meta plus the task's typed output columns (no model is run)."""
    cols = pd.DataFrame({c: pd.Series([], dtype=d) for c, d in task.output_dtypes().items()}, index=meta.index)
    return pd.concat([meta, cols], axis=1)


@register_dataframe_accessor("llm")
class DaskLLMAccessor(LLMFrameMethods):
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
