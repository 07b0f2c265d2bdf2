"""A dry run of a generation job: what it would read, refuse, compute and cost, without writing.

:func:`dry_run` takes the lazy result of a Dask ``.llm.generate``/``.llm.chat`` call (what
``dfllm run`` builds) and returns a :class:`DryRunReport`; ``report.format()`` is what
``dfllm run --dry-run`` prints. Nothing is written: no output folder, no part, no response
cache entry. Three passes, all on the cluster that would run the job:

1. **Every row, tokenized and checked** where the job would run it: a task per source
   partition leases the worker's engine (loading the model as the job would) and turns the
   partition's rows into requests through the task's own runner and the engine's
   :class:`~dfllm.engine.input_processor.InputProcessor` -- the code path of the real run,
   stopped where the requests would go to the engine -- so that the dry run refuses exactly
   the rows the real run gives an ``llm_error`` before generating (a null or empty prompt, a
   prompt past ``max_model_len``, a malformed conversation, bad per-row sampling params...),
   with the same messages. Each task returns its prompt lengths, ``max_tokens``, refusals,
   the hashes of its prompts' full KV-cache blocks (the prefix cache's hash chain, with the
   engine's block size) and of its deterministic requests (the engine's deduplication key),
   and, with a response cache, which requests it holds. Only these figures travel.
2. **A calibration run**: a sample of the accepted rows (default 16, spread over the job)
   goes through the real engine of one worker, timed step by step: the prompts alone
   (prefill throughput), then the rows with their own sampling params (how much of
   ``max_tokens`` they generate, and the time of a decode step as a function of its batch),
   at most ``calibration_seconds``.
3. **The estimate** (:class:`Estimate`): the job's partitions are laid out over the cluster's
   engines and threads as Dask runs them (each worker runs ``threads`` partitions at once
   into its one engine; a partition takes as many decode steps as its longest row), and the
   steps and tokens are priced with the calibration's figures; engine load and reading and
   tokenizing time are those the dry run itself measured. What it assumes is in
   ``Estimate.assumptions`` and in the printed report.

:func:`dry_run_source` is the same for any source frame and any :class:`RequestSource` (what
turns a partition's rows into engine requests): :class:`TaskRequests` for an ``.llm`` task;
``dfllm run-batch`` gives its own (:class:`dfllm.jobs.batch_job.BatchRequests`), whose
embeddings, score and rerank lines run on another engine and are counted as not estimated.
"""

from __future__ import annotations

import os
import time
import uuid

import dask

from dfllm.accessors.partitions import PartitionFunction, llm_origin
from dfllm.accessors.writer import compute_in_order, folder_filesystem, input_paths, refuse_overlap, survey_parts
from dfllm.jobs.dry_run.calibration import (
    DEFAULT_CALIBRATION_SECONDS,
    DEFAULT_SAMPLE_ROWS,
    Calibration,
    calibrate,
    spread_evenly,
)
from dfllm.jobs.dry_run.estimate import build_report
from dfllm.jobs.dry_run.report import DryRunReport, Estimate, Refusal, refusal_counts
from dfllm.jobs.dry_run.requests import RequestSource, TaskRequests, cached_requests
from dfllm.jobs.dry_run.survey import PartitionSurvey, block_digests, survey_partition

__all__ = [
    "DEFAULT_CALIBRATION_SECONDS",
    "DEFAULT_SAMPLE_ROWS",
    "Calibration",
    "DryRunReport",
    "Estimate",
    "Refusal",
    "RequestSource",
    "TaskRequests",
    "block_digests",
    "build_report",
    "cached_requests",
    "cluster_shape",
    "dry_run",
    "dry_run_source",
    "refusal_counts",
]


def dry_run(
    job,
    *,
    output: str | None = None,
    storage_options: dict | None = None,
    sample_rows: int = DEFAULT_SAMPLE_ROWS,
    calibration_seconds: float = DEFAULT_CALIBRATION_SECONDS,
    budget=None,
    progress: bool = False,
) -> DryRunReport:
    """A dry run of ``job``, the lazy result of a Dask ``.llm.generate``/``.llm.chat`` call:
    every row tokenized and checked on the cluster (the default distributed client, else
    this process), a calibration run and an estimate of the job's wall time (see the module
    docstring). Nothing is written. ``output`` (with ``storage_options``) is checked as
    :func:`dfllm.write_parquet` would check it (not the input, only dfllm's files), read only;
    ``budget`` (a :class:`~dfllm.accessors.budget.Budget`) is compared with the job's tokens;
    ``sample_rows=0`` skips the calibration (and the estimate)."""
    origin = llm_origin(job)
    if origin is None or not isinstance(origin[1], PartitionFunction):
        raise ValueError(
            "dry_run takes the direct result of a Dask .llm.generate or .llm.chat call; for other "
            "sources use dry_run_source(frame, requests)"
        )
    source, func = origin
    return dry_run_source(
        source,
        TaskRequests(func.task),
        resources=func.resources,
        output=output,
        storage_options=storage_options,
        sample_rows=sample_rows,
        calibration_seconds=calibration_seconds,
        budget=budget,
        progress=progress,
        on_error_raise=func.task.on_error == "raise",
    )


def dry_run_source(
    source,
    requests: RequestSource,
    *,
    resources: dict | None = None,
    output: str | None = None,
    storage_options: dict | None = None,
    sample_rows: int = DEFAULT_SAMPLE_ROWS,
    calibration_seconds: float = DEFAULT_CALIBRATION_SECONDS,
    budget=None,
    progress: bool = False,
    on_error_raise: bool = False,
    what: str | None = None,
) -> DryRunReport:
    """A dry run of the rows of ``source`` (a Dask DataFrame) as ``requests`` turns them into
    engine requests (see :func:`dry_run`); the tasks ask for ``resources``."""
    if isinstance(sample_rows, bool) or not isinstance(sample_rows, int) or sample_rows < 0:
        raise ValueError(f"dry run: sample_rows must be a non-negative integer, got {sample_rows!r}")
    if not calibration_seconds > 0:
        raise ValueError(f"dry run: calibration_seconds must be positive, got {calibration_seconds!r}")
    start = time.perf_counter()
    found = check_output(source, output, storage_options) if output is not None else None
    run = uuid.uuid4().hex[:8]
    parts = source.to_delayed()
    jobs = [
        dask.delayed(survey_partition, pure=False)(p, requests, i, dask_key_name=f"llm-dry-run-{i}-{run}")
        for i, p in enumerate(parts)
    ]
    surveys: list[PartitionSurvey] = compute_in_order(jobs, progress, resources, desc="dry run partitions")
    read_seconds = time.perf_counter() - start
    calibration = None
    accepted = [s for s in surveys if len(s.prompt_tokens)]
    if sample_rows and accepted:
        picks = spread_evenly([s.partition for s in accepted], 4)
        job = dask.delayed(calibrate, pure=False)(
            [parts[i] for i in picks],
            requests,
            sample_rows,
            calibration_seconds,
            dask_key_name=f"llm-dry-run-calibrate-{run}",
        )
        calibration = compute_in_order([job], False, resources, desc="dry run calibration")[0]
    report = build_report(
        surveys, calibration, cluster_shape(resources), read_seconds, what or _describe(requests, len(parts)), budget
    )
    report.output, report.on_error_raise = found, on_error_raise
    report.seconds = time.perf_counter() - start
    return report


def _describe(requests: RequestSource, partitions: int) -> str:
    task = getattr(requests, "task", None)
    kind = f"{task.kind} " if task is not None else ""
    return f"{kind}job of {partitions:,} partition(s)"


def check_output(source, output: str, storage_options: dict | None) -> str:
    """What ``dfllm.write_parquet`` would find at ``output`` (read only): ``ValueError`` for an
    output overlapping the input or holding files dfllm did not write, as the real run."""
    refuse_overlap(input_paths(source), output, storage_options)
    fs, root = folder_filesystem(output, storage_options)
    ours = survey_parts(fs, root, output)
    if not fs.exists(root):
        return f"{output} (does not exist yet)"
    return (
        f"{output} ({len(ours)} part(s) of an earlier dfllm write: --resume keeps those still complete)"
        if ours
        else f"{output} (no parts yet)"
    )


def cluster_shape(resources: dict | None) -> tuple[int, int]:
    """``(engines, partitions at once per engine)`` of the cluster the job would run on: the
    workers of the default distributed client able to run its tasks (those declaring
    ``resources``) and their threads (or the resources' share); without a client, this
    process with the local scheduler's threads."""
    try:
        from distributed import default_client

        client = default_client()
    except (ImportError, ValueError):
        return 1, int(dask.config.get("num_workers", None) or os.cpu_count() or 1)
    slots = []
    for w in client.scheduler_info(n_workers=-1)["workers"].values():
        n = int(w.get("nthreads", 1))
        for name, amount in (resources or {}).items():
            n = min(n, int(w.get("resources", {}).get(name, 0) // amount))
        if n > 0:
            slots.append(n)
    if not slots:
        return 1, 1
    return len(slots), max(1, round(sum(slots) / len(slots)))
