"""``.llm`` on Dask, pandas and Polars: one module per library (``pandas_ext``, ``dask_ext``,
``polars_ext``), each with a ``register()`` that :mod:`dfllm` calls on the first ``.llm`` use.
This package imports none of them itself, so that a library that is not installed is not needed."""
