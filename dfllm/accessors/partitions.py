"""What a Dask ``.llm`` result maps over its source frame's partitions, and how
:func:`dfllm.write_parquet` finds it: the result carries its task, as a
:class:`PartitionFunction` (a :class:`WritableFunction`) in its expression (a processor's
result maps its source with one too, see :mod:`dfllm.jobs.processor`).
"""

from __future__ import annotations

import dataclasses

import pandas as pd

from dfllm.accessors.placement import run_placed
from dfllm.accessors.prefix_placement import JobPlacement, run_routed
from dfllm.tasks.kinds import ENGINE_ARROW_TYPES
from dfllm.tasks.prefix_keys import RowKeys, prefix_keys
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
    - ``arrow_types()``: the Arrow types of output columns that ``meta`` holds as ``object``;
    - ``response_cache()``: the response cache its partitions write to (None: none), which
      must not be in the output folder or in an input folder.

    With a ``placement`` (:mod:`dfllm.accessors.prefix_placement`), each partition's rows
    run on their prefix groups' engines: ``prefix_keys(df)`` keys them (on a worker), and
    ``without_placement()`` runs each engine's share.
    """

    kind: str
    resources: dict | None = None
    error_column: str | None = LLM_ERROR
    placement: JobPlacement | None = None

    @property
    def write_key(self) -> str:
        raise NotImplementedError

    def model_sources(self) -> tuple:
        return ()

    def arrow_types(self) -> dict:
        return {}

    def response_cache(self):
        """The :class:`~dfllm.tasks.response_cache.ResponseCache` the partitions store
        answers in, or None."""
        return None

    def without_placement(self) -> WritableFunction:
        """The same function running each partition's rows where the partition runs (no
        prefix-aware placement; a budgeted write uses it). The same outputs."""
        return self

    def prefix_keys(self, df: pd.DataFrame) -> list[RowKeys | None]:
        """Per row of ``df``, its prefix keys (:mod:`dfllm.tasks.prefix_keys`), or None."""
        return [None] * len(df)

    @property
    def engine_kwargs(self) -> dict:
        """The engine arguments the partitions run with."""
        return {}

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        if self.placement is not None:  # the rows on their prefix groups' engines (placement decides no output)
            out = run_routed(df, self)
            if out is not None:
                return out
        return self.run(df)

    def run(self, df: pd.DataFrame) -> pd.DataFrame:
        """One partition's output, computed here (or where its resources are)."""
        raise NotImplementedError


class PartitionFunction(WritableFunction):
    """What a Dask ``.llm`` call maps over the partitions: ``run_task`` of ``task``, placed
    on workers declaring ``resources``; with ``placement`` (a generative task's prefix-aware
    placement, :mod:`dfllm.accessors.prefix_placement`) each partition's rows run on their
    prefix groups' engines. Picklable, and named ``llm-<kind>`` for the dashboard."""

    def __init__(self, task: LLMTask, resources: dict | None = None, placement: JobPlacement | None = None):
        self.task, self.resources, self.placement = task, resources, placement
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

    def response_cache(self):
        return self.task.cache

    def without_placement(self) -> PartitionFunction:
        return self if self.placement is None else PartitionFunction(self.task, self.resources)

    def prefix_keys(self, df: pd.DataFrame) -> list[RowKeys | None]:
        return prefix_keys(df, self.task)

    @property
    def engine_kwargs(self) -> dict:
        return dict(self.task.engine_kwargs)

    def run(self, df: pd.DataFrame) -> pd.DataFrame:
        return run_placed(df, self.task, self.resources)

    def __dask_tokenize__(self):
        placement = None if self.placement is None else self.placement.settings
        return (type(self).__name__, self.task, sorted((self.resources or {}).items()), placement)

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
