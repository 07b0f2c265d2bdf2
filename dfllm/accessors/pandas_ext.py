"""``.llm`` on pandas DataFrames and Series (pandas' accessor API); runs in this process.

:func:`register` puts it there; ``import dfllm`` arranges for that on the first ``.llm``."""

from __future__ import annotations

import pandas as pd

from dfllm.accessors.frontend import SERIES_INPUT, LLMFrameMethods, LLMSeriesMethods
from dfllm.tasks.runners import run_task
from dfllm.tasks.task import LLMTask


class PandasLLMAccessor(LLMFrameMethods):
    def _apply(self, task: LLMTask, resources: dict | None = None) -> pd.DataFrame:
        return run_task(self._obj, task, progress=True)


class PandasSeriesLLMAccessor(LLMSeriesMethods):
    frame_methods = PandasLLMAccessor

    def _frame(self, other=None) -> pd.DataFrame:
        frame = self._obj.to_frame(SERIES_INPUT)
        if other is not None:
            frame[SERIES_INPUT + "2"] = other
        return frame

    def _main(self, frame: pd.DataFrame, column: str) -> pd.Series:
        return frame[column].rename(self._obj.name)


def register() -> None:
    """Registers ``.llm`` on pandas' DataFrame and Series."""
    pd.api.extensions.register_dataframe_accessor("llm")(PandasLLMAccessor)
    pd.api.extensions.register_series_accessor("llm")(PandasSeriesLLMAccessor)
