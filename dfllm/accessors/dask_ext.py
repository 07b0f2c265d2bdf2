"""``.llm`` on Dask DataFrames and Series: lazy, with exact ``meta``, one task per partition
(:class:`~dfllm.accessors.partitions.PartitionFunction`).

Partitions run wherever Dask schedules them; on a distributed cluster each worker process
keeps one engine per model configuration (see :mod:`dfllm.worker.engine_cache`). Tasks
are named ``llm-<task>`` in the dashboard's task stream. ``resources=`` keeps the engine
work on workers declaring those resources (see :mod:`dfllm.accessors.placement`). A
generative task's rows go to the engines by their prompts' shared prefixes (see
:mod:`dfllm.accessors.prefix_placement`; Dask config ``dfllm.prefix-placement``, on by default).

:func:`register` puts ``.llm`` there; ``import dfllm`` arranges for that on the first ``.llm``."""

from __future__ import annotations

import dask.dataframe as dd
from dask.dataframe.extensions import register_dataframe_accessor, register_series_accessor

from dfllm.accessors.frontend import SERIES_INPUT, LLMFrameMethods, LLMSeriesMethods
from dfllm.accessors.partitions import PartitionFunction, output_meta
from dfllm.accessors.placement import check_resources, model_check
from dfllm.accessors.prefix_placement import JobPlacement, placement_settings
from dfllm.tasks.task import LLMTask


class DaskLLMAccessor(LLMFrameMethods):
    def _model_check(self, resources: dict | None):
        return model_check(check_resources(resources))

    def _apply(self, task: LLMTask, resources: dict | None = None) -> dd.DataFrame:
        resources = check_resources(resources)
        settings = placement_settings()
        placement = JobPlacement(settings, self._obj.npartitions) if settings.enabled and task.spec.generative else None
        func = PartitionFunction(task, resources, placement)
        return self._obj.map_partitions(func, meta=output_meta(self._obj._meta, task))


class DaskSeriesLLMAccessor(LLMSeriesMethods):
    frame_methods = DaskLLMAccessor

    def _frame(self, other=None) -> dd.DataFrame:
        frame = self._obj.to_frame(name=SERIES_INPUT)
        if other is not None:
            frame[SERIES_INPUT + "2"] = other
        return frame

    def _main(self, frame: dd.DataFrame, column: str) -> dd.Series:
        return frame[column].rename(self._obj.name)


def register() -> None:
    """Registers ``.llm`` on Dask's DataFrame and Series."""
    register_dataframe_accessor("llm")(DaskLLMAccessor)
    register_series_accessor("llm")(DaskSeriesLLMAccessor)
