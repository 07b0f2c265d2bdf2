"""What the ``dfllm`` commands (:mod:`dfllm.jobs.cli`, :mod:`dfllm.jobs.batch_cli`) share:
option value types, the response cache's flags, the exit status and stderr lines."""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_MAX_ERROR_RATE = 0.5
EXIT_TOO_MANY_ERRORS = 3


def add_cache_options(p: argparse.ArgumentParser, what: str) -> None:
    """``--cache`` (helped as ``what``), ``--cache-max-bytes`` and ``--cache-storage-options``
    (read back by :func:`cache_of`), for ``dfllm run`` and ``dfllm run-batch``."""
    p.add_argument("--cache", metavar="URL", help=what)
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
