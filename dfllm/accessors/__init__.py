"""``.llm`` accessors on Dask, pandas and Polars, registered when ``dfllm`` is imported."""

from dfllm.accessors import arrow_dtypes, dask_ext, pandas_ext, polars_ext  # noqa: F401  (registration)
