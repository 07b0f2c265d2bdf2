"""The accessors' public face for the floors above them (the semantic operators,
:mod:`dfllm.semantic`): :class:`FrameAdapter`, all they know of a ``.llm`` accessor's frame,
and the one place that tells pandas, Dask and Polars (eager or lazy) frames apart."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pandas as pd
import pyarrow as pa

from dfllm.errors import clipped, value_text
from dfllm.tasks.schema import LLM_ERROR

#: What :func:`frame_kind` answers: a Polars LazyFrame is ``"lazy"``.
FRAME_KINDS = ("pandas", "dask", "polars", "lazy")


def frame_kind(obj: Any) -> str:
    """One of :data:`FRAME_KINDS`, or ``TypeError``. It imports no library: a frame of one
    that is not imported cannot exist."""
    dd, pl = sys.modules.get("dask.dataframe"), sys.modules.get("polars")
    if isinstance(obj, pd.DataFrame):
        return "pandas"
    if dd is not None and isinstance(obj, dd.DataFrame):
        return "dask"
    if pl is not None and isinstance(obj, (pl.DataFrame, pl.LazyFrame)):
        return "polars" if isinstance(obj, pl.DataFrame) else "lazy"
    raise TypeError(f"semantic operators run on pandas, Dask and Polars frames, not {type(obj).__name__}")


class FrameAdapter:
    """A pandas, Dask or Polars frame: ``obj`` (the frame itself), ``kind`` (:func:`frame_kind`),
    ``columns``, the frame as pandas and back (:meth:`to_pandas`, :meth:`back`, :meth:`empty`),
    a pandas function mapped over it (:meth:`map_pandas`) and, for a ``.llm`` accessor's
    frame (:meth:`of`), the accessor's model check (:meth:`model_check`)."""

    def __init__(self, obj: Any, accessor: Any = None):
        self.obj, self.kind, self._accessor = obj, frame_kind(obj), accessor

    @classmethod
    def of(cls, accessor: Any) -> FrameAdapter:
        """The frame of a ``.llm`` frame accessor (``df.llm``)."""
        return cls(accessor._obj, accessor)

    @property
    def columns(self) -> list:
        """The column names, as ``.llm``'s methods check them (a LazyFrame's from its schema)."""
        return list(self.obj.collect_schema().names() if self.kind == "lazy" else self.obj.columns)

    def model_check(self, resources: dict | None) -> Callable | None:
        """A task's ``model_check`` (:func:`~dfllm.tasks.task.make_task`), as the accessor's own
        methods check theirs: None (here, now) for an eager frame, which refuses ``resources``;
        on Dask, on a worker declaring ``resources`` when only the workers have the model."""
        return self._accessor._model_check(resources)

    def to_pandas(self) -> pd.DataFrame:
        """An eager frame as pandas: itself, or Polars through Arrow (a LazyFrame collected)."""
        if self.kind == "dask":
            raise TypeError("expected an eager frame")
        obj = self.obj.collect() if self.kind == "lazy" else self.obj
        return obj if self.kind == "pandas" else polars_to_pandas(obj)

    def empty(self) -> pd.DataFrame:
        """An empty pandas frame with the frame's columns and dtypes (a Dask frame's ``meta``)."""
        if self.kind in ("pandas", "dask"):
            return self.obj._meta if self.kind == "dask" else self.obj.iloc[:0]
        import polars as pl

        return polars_to_pandas(pl.DataFrame(schema=self.obj.collect_schema()))

    def polars_schema(self) -> dict:
        """A Polars frame's (eager or lazy) column name -> dtype; ``{}`` for pandas and Dask."""
        return dict(self.obj.collect_schema()) if self.kind in ("polars", "lazy") else {}

    def back(self, df: pd.DataFrame, dtypes: dict | None = None) -> Any:
        """``df`` (pandas) as the frame's kind: as it is but for Polars, where the frame's columns
        get their own dtypes back where the trip through pandas changed them (an ``Enum`` comes
        back as ``Categorical``; not ``llm_error``, which the operators write), and a LazyFrame's
        lazy again. ``dtypes`` (result column -> Polars dtype) does the same for columns that
        came from another frame (a join's columns of ``other``, by their names in ``df``)."""
        if self.kind not in ("polars", "lazy"):
            return df

        out = _polars_from_pandas(df.reset_index(drop=True))
        schema = {**(dtypes or {}), **self.obj.collect_schema()}
        differ = {c: t for c, t in schema.items() if c in out.columns and c != LLM_ERROR and out.schema[c] != t}
        out = out.cast(differ) if differ else out
        return out.lazy() if self.kind == "lazy" else out

    def map_pandas(
        self,
        here: Callable[[pd.DataFrame], pd.DataFrame],
        partition: Callable[[pd.DataFrame], pd.DataFrame],
        meta: Callable[[pd.DataFrame], pd.DataFrame],
    ) -> Any:
        """``here`` (a pandas frame to a pandas frame) over the frame: now on pandas and on a
        Polars DataFrame (through :meth:`to_pandas` and :meth:`back`), on a LazyFrame batch by
        batch when it is collected, and on Dask ``partition`` (picklable) lazily, one task per
        partition. ``meta(empty)`` is the output for an empty input: the lazy results' schema."""
        if self.kind == "dask":
            return self.obj.map_partitions(partition, meta=meta(self.obj._meta))
        if self.kind == "lazy":
            schema = self.back(meta(self.empty())).collect_schema()
            return self.obj.map_batches(lambda df: FrameAdapter(df).map_pandas(here, partition, meta), schema=schema)
        return self.back(here(self.to_pandas()))


def polars_to_pandas(frame: Any) -> pd.DataFrame:
    """A Polars DataFrame as pandas through Arrow; ``ValueError`` naming the columns whose
    type Arrow cannot hold (``Int128``, ``UInt128``, a ``List`` nested past Arrow's 64 levels),
    instead of Arrow's message naming none."""
    try:
        return frame.to_pandas(use_pyarrow_extension_array=True)
    except (ValueError, TypeError, NotImplementedError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        bad = []
        for name, dtype in frame.schema.items():
            try:
                frame.select(name).head(0).to_pandas(use_pyarrow_extension_array=True)
            except (ValueError, TypeError, NotImplementedError):
                bad.append(f"{name!r} ({clipped(value_text(dtype))})")  # a deep List's text: thousands of characters
        if not bad:
            raise
        raise ValueError(
            f"column(s) {', '.join(bad)} cannot go through Arrow to pandas ({exc}); cast them, "
            "for example pl.col(name).cast(pl.String) or pl.Decimal(38, 0)"
        ) from None


def _polars_from_pandas(df: pd.DataFrame) -> Any:
    """A pandas result as a Polars frame; a column of Python objects that Arrow cannot type
    together (a pandas ``other`` joined to a Polars frame, holding ``1``, ``"a"`` and bytes)
    comes over as a Polars ``Object`` column, its values as they are, rather than failing the
    whole result."""
    import polars as pl

    try:
        return pl.from_pandas(df)
    except (ValueError, TypeError, pa.ArrowException):
        columns = []
        for name in df.columns:
            try:
                columns.append(pl.from_pandas(df[[name]]).to_series())
            except (ValueError, TypeError, pa.ArrowException):
                columns.append(pl.Series(str(name), df[name].tolist(), dtype=pl.Object))
        return pl.DataFrame(columns)
