"""``.llm`` on Dask DataFrames and Series: lazy, with exact ``meta``, one task per partition.

Partitions run wherever Dask schedules them; on a distributed cluster each worker process
keeps one engine per model configuration (see :mod:`dfllm.accessors.engines`). Tasks are
named ``llm-<task>`` in the dashboard's task stream. ``resources=`` keeps the engine work
on workers declaring those resources (see :mod:`dfllm.accessors.placement`).
"""

from __future__ import annotations

import dask.dataframe as dd
import pandas as pd
from dask.dataframe.extensions import register_dataframe_accessor, register_series_accessor

from dfllm.accessors.frontend import SERIES_INPUT, LLMFrameMethods, LLMSeriesMethods
from dfllm.accessors.placement import check_resources, model_check, run_placed
from dfllm.accessors.task import LLMTask
from dfllm.accessors.writer import ORIGINS


def partition_function(task: LLMTask, resources: dict | None = None):
    """``run_task`` bound to ``task`` (placed on workers declaring ``resources``), named
    ``llm-<kind>`` for the dashboard."""
    def run(df: pd.DataFrame) -> pd.DataFrame:
        return run_placed(df, task, resources)

    run.__name__ = run.__qualname__ = f"llm-{task.kind}"
    return run


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
        result = self._obj.map_partitions(partition_function(task, resources),
                                          meta=output_meta(self._obj._meta, task))
        ORIGINS[result._name] = (self._obj, task, resources)
        return result


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
