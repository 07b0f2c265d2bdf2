"""Where a Dask ``.llm`` task runs: on workers declaring the resources it asks for.

Dask's query planner drops ``dask.annotate`` (and so any annotation of a collection's
tasks), so placement cannot ride on the graph. Instead it travels with the task itself:
an ``llm-*`` task that Dask started on a worker lacking the resources (a CPU worker of a
mixed cluster) does not build an engine there; it hands its partition to a worker that
has them, as a task holding those resources, and waits without holding a thread
(``worker_client`` secedes). So ``result.to_parquet(...)``, ``.compute()``,
``dfllm.write_parquet`` or any other Dask write honours ``resources=``, and only
resourced workers ever load the model.

The model is checked where its files are: a path that exists only on the workers (the
usual cluster layout) is checked on a worker with the task's resources.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from dfllm.dashboard import ensure_installed
from dfllm.tasks.runners import run_task
from dfllm.tasks.task import LLMTask, check_model

MODEL_CHECK_TIMEOUT_S = 120.0


def check_resources(resources) -> dict | None:
    """``resources`` as a dict of resource name -> positive amount, or None; else ``ValueError``."""
    if resources is None:
        return None
    if not isinstance(resources, dict) or not resources:
        raise ValueError(f"resources must be a non-empty dict like {{'GPU': 0.25}}, got {resources!r}")
    for name, amount in resources.items():
        if (
            not isinstance(name, str)
            or isinstance(amount, bool)
            or not isinstance(amount, (int, float))
            or not amount > 0
        ):
            raise ValueError(f"resources: {name!r} must map to a positive number, got {amount!r}")
    return dict(resources)


def _worker():
    try:
        from distributed import get_worker

        return get_worker()
    except (ImportError, ValueError):
        return None


def worker_has(resources: dict) -> bool:
    """Whether this process is a Dask worker declaring at least ``resources``."""
    worker = _worker()
    if worker is None:
        return False
    total = worker.state.total_resources
    return all(total.get(name, 0) >= amount for name, amount in resources.items())


def run_placed(df: pd.DataFrame, task: LLMTask, resources: dict | None) -> pd.DataFrame:
    """``run_task(df, task)`` on a worker declaring ``resources``: here if this worker does
    (or if this is no Dask worker at all: a local scheduler has nowhere else to go),
    otherwise as a task of its own on one that does, waited for without holding a thread."""
    if _worker() is not None and len(df):
        ensure_installed()  # the first partition on a worker brings the dashboard page
    if resources is None or _worker() is None or worker_has(resources):
        return run_task(df, task)
    from distributed import worker_client

    with worker_client() as client:
        future = client.submit(
            run_task, df, task, resources=resources, pure=False, key=f"llm-{task.kind}-placed-{uuid.uuid4().hex[:12]}"
        )
        return future.result()


def _default_client():
    try:
        from distributed import default_client

        return default_client()
    except (ImportError, ValueError):
        return None


def _here(model: str | None) -> bool:
    """Whether the model's files can be checked in this process (a bundled alias, or an
    existing directory)."""
    from dfllm.models.bundled import BUNDLED_MODELS

    return model is None or model.strip().lower() in BUNDLED_MODELS or Path(model).expanduser().is_dir()


def model_check(resources: dict | None) -> Callable[[LLMTask], None]:
    """The model check of a Dask call: here when the files are here, else (with a
    distributed client) on a worker that would run the task, else the local check's error."""

    def check(task: LLMTask) -> None:
        client = _default_client()
        if _here(task.model) or client is None:
            check_model(task)
            return
        future = client.submit(
            check_model, task, resources=resources, pure=False, key=f"llm-check-model-{uuid.uuid4().hex[:12]}"
        )
        try:
            future.result(timeout=MODEL_CHECK_TIMEOUT_S)
        except TimeoutError:
            future.cancel()
            raise ValueError(
                f"model {task.model!r} is not a directory here, and no worker"
                f"{' declaring ' + repr(resources) if resources else ''} checked it within "
                f"{MODEL_CHECK_TIMEOUT_S:.0f} s"
            ) from None

    return check
