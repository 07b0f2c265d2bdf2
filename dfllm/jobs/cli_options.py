"""What the ``dfllm`` commands (:mod:`dfllm.jobs.cli`, :mod:`dfllm.jobs.batch_cli`) share:
their common options, each declared once (:func:`add_job_options`: the model, every engine
argument, the cluster's, resume, the error threshold, storage, the response cache, the dry
run, prefix placement), option value types, the job's cluster, the exit status and stderr lines."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from dfllm.engine_args import add_cli_args
from dfllm.reasoning import reasoning_parser_names

DEFAULT_MAX_ERROR_RATE = 0.5
EXIT_TOO_MANY_ERRORS = 3
ENGINE = "engine_"  # where the engine flags are stored: args.engine_max_model_len...


def add_job_options(p: argparse.ArgumentParser) -> None:
    """The options of ``dfllm run`` and ``dfllm run-batch``, declared here once for both: ``--model``,
    the cluster's, ``--resume``, ``--max-error-rate``, ``--storage-options``, the response cache's
    (read back by :func:`cache_of`), ``--dry-run`` with ``--calibration-seconds``
    (:func:`check_job_options`), ``--no-prefix-placement`` (:func:`job_cluster`) and every engine
    argument of :class:`dfllm.LLM`, one flag per field of :class:`~dfllm.engine_args.EngineArgs` in
    vLLM's spelling, stored under :data:`ENGINE` (read back by :func:`~dfllm.engine_args.cli_kwargs`)."""
    p.add_argument(
        "--model",
        help="model directory or bundled alias (default: SmolLM2 for generation, MiniLM for embeddings and "
        "scores, see `dfllm models`); run-batch answers every line with it (body.model is not read)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep what an earlier, killed run of the same job finished (run: the output's complete "
        "partitions; run-batch: <output>.parts/); the output stays exact, every row or line answered once",
    )
    p.add_argument(
        "--max-error-rate",
        type=unit_rate,
        default=DEFAULT_MAX_ERROR_RATE,
        metavar="RATE",
        help="exit with status 3 (after writing the output) if more than this share of the rows (an "
        f"llm_error) or lines (an error) failed (0 to 1; default {DEFAULT_MAX_ERROR_RATE}; 1 never fails)",
    )
    p.add_argument("--storage-options", type=json_object, default=None, help="fsspec options as JSON")
    p.add_argument(
        "--cache",
        metavar="URL",
        help="a response cache (local folder or fsspec URL) shared across jobs: deterministic generate/chat "
        "rows and chat/completions lines (greedy, or seeded) asked before with the same model, engine "
        "arguments, prompt and sampling params are answered from it without the engine (docs/cache.md)",
    )
    p.add_argument(
        "--cache-max-bytes",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="bound on the cache's size, e.g. 500MB or 2GiB (default 1GiB); least recently used entries go",
    )
    p.add_argument(
        "--cache-storage-options",
        type=json_object,
        default=None,
        help="fsspec options of the cache as JSON (default: --storage-options for a URL with a protocol)",
    )
    p.add_argument("--scheduler", help="address of a running Dask scheduler (default: start a local cluster)")
    p.add_argument("--workers", type=int, help="local CPU worker processes (default 1)")
    p.add_argument("--threads", type=int, help="partitions each worker runs at once, sharing its engine (default 4)")
    p.add_argument("--gpu", action="store_true", help="one worker per GPU (or per --tensor-parallel-size GPUs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="read and check the input and options, tokenize every row or line on the cluster and print what "
        "the job would do (those refused and why, prompt tokens, an estimate of its time from a short "
        "calibration run); nothing is written (docs/dry_run.md)",
    )
    p.add_argument(
        "--calibration-seconds",
        type=positive_float,
        default=None,
        metavar="S",
        help="--dry-run: the most the calibration run may take (default 30)",
    )
    p.add_argument(
        "--no-prefix-placement",
        action="store_true",
        help="leave rows and lines where Dask puts their partitions, rather than sending those that share "
        "a prompt prefix to one engine (Dask config dfllm.prefix-placement; docs/prefix_cache.md)",
    )
    add_cli_args(
        p.add_argument_group("engine arguments (dfllm.LLM's, vLLM's spelling)"),
        prefix=ENGINE,
        seed="the engine's random seed; run also gives every row this sampling seed (reproducible sampled text)",
        reasoning_parser=f"a thinking model's parser ({', '.join(reasoning_parser_names())}): the reasoning "
        "(<think>...</think>) goes to a reasoning_content column (run: generate/chat) or to each chat "
        "answer's message.reasoning_content (run-batch; completions text stays whole, as in vLLM), the "
        "answer alone to the output",
    )


def check_job_options(args: argparse.Namespace) -> None:
    """``ValueError`` for shared options given together wrongly (before any work)."""
    if args.calibration_seconds is not None and not args.dry_run:
        raise ValueError("--calibration-seconds applies to --dry-run")


@contextmanager
def job_cluster(args: argparse.Namespace, engine_kwargs: dict) -> Iterator[tuple]:
    """The job's ``(client, resources)`` (:func:`dfllm.jobs.cluster.connect`: ``--scheduler``, or a
    local cluster of ``--workers``, ``--threads``, ``--gpu`` with one worker per engine's tensor x
    pipeline parallel GPUs), with Dask's ``dfllm.prefix-placement`` off for ``--no-prefix-placement``
    (else as Dask's config has it: ``DASK_DFLLM__PREFIX_PLACEMENT=false`` turns it off too)."""
    import dask

    from dfllm.jobs.cluster import connect

    gpus = engine_kwargs.get("tensor_parallel_size", 1) * engine_kwargs.get("pipeline_parallel_size", 1)
    with (
        dask.config.set({"dfllm.prefix-placement": False} if args.no_prefix_placement else {}),
        connect(args.scheduler, workers=args.workers, threads=args.threads, gpu=args.gpu, gpus_per_engine=gpus) as got,
    ):
        yield got


def _checked(text: str, convert, ok, what: str):
    """``convert(text)`` if it converts and passes ``ok``, else argparse's error saying ``what`` it must be."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not ok(value):  # a nan fails every comparison
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 1, "a positive integer")


def positive_float(text: str) -> float:
    return _checked(text, float, lambda v: 0 < v < float("inf"), "a positive number")


def unit_rate(text: str) -> float:
    return _checked(text, float, lambda v: 0.0 <= v <= 1.0, "a number from 0 to 1")


def byte_size(text: str) -> int:
    """A byte count as Dask reads one (``1048576``, ``500MB``, ``2GiB``)."""
    from dask.utils import parse_bytes

    try:
        value = parse_bytes(text)
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"must be a size like 1048576, 500MB or 2GiB, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte, got {text!r}")
    return value


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, like '{\"anon\": false}'")
    return value


def cache_of(args):
    """The response cache that ``--cache``, ``--cache-max-bytes`` and ``--cache-storage-options``
    name (``dfllm run`` and ``dfllm run-batch``), or None; the cache's storage options default
    to ``--storage-options`` for a URL with a protocol."""
    if args.cache is None:
        if args.cache_max_bytes is not None or args.cache_storage_options is not None:
            raise ValueError("--cache-max-bytes and --cache-storage-options need --cache")
        return None
    from dfllm.tasks.response_cache import DEFAULT_MAX_BYTES, ResponseCache, as_cache

    options = args.cache_storage_options
    if options is None and "://" in args.cache and not args.cache.startswith("file://"):
        options = args.storage_options
    return as_cache(ResponseCache(args.cache, options, args.cache_max_bytes or DEFAULT_MAX_BYTES), "--cache")


def describe_client(client) -> str:
    workers = client.scheduler_info(n_workers=-1)["workers"].values()
    return f"{len(workers)} worker(s), {sum(w['nthreads'] for w in workers)} thread(s)"


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
