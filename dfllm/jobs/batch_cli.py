"""``dfllm run-batch``: an OpenAI batch file through a Dask cluster, with ``vllm run-batch``'s flags.

``dfllm run-batch -i requests.jsonl -o results.jsonl [--model M] [engine arguments]``
answers every line of an OpenAI batch input file (see :mod:`dfllm.jobs.batch_job` and
``docs/batch.md``). Its flags are vLLM's: ``-i/--input-file``, ``-o/--output-file``,
``--model``, ``--response-role``, ``--served-model-name`` and every engine argument of
:class:`dfllm.LLM` under vLLM's spelling (``--max-model-len``, ``--max-num-seqs``,
``--enforce-eager``, ``--no-enable-prefix-caching``...); vLLM's server flags that mean
nothing for a file (``--port``, ``--enable-metrics``, ``--output-tmp-dir``...) are accepted
and change nothing, so a ``vllm run-batch`` command line runs unchanged. dfllm's own:
``--error-file`` (OpenAI's style: failed lines in a file of their own), ``--unordered``,
``--partition-bytes``, ``--keep-parts``, and those ``dfllm run`` takes too, declared once for
both (:func:`dfllm.jobs.cli_options.add_job_options`: the engine arguments, ``--resume``,
``--max-error-rate``, ``--storage-options``, the response cache's, ``--dry-run`` with
``--calibration-seconds``, ``--no-prefix-placement`` and the cluster's). ``--reasoning-parser``
is vLLM's: chat answers carry the reasoning in ``message.reasoning_content``.

Exit statuses are ``dfllm run``'s (see :mod:`dfllm.jobs.cli`): 0 done; 1 an error (a missing
input, a bad option value, an unusable model, a failed cluster); 2 bad options; 3 the
output was written but more than ``--max-error-rate`` (default 0.5) of the lines failed;
130 interrupted.
"""

from __future__ import annotations

import argparse

from dfllm.engine_args import cli_kwargs
from dfllm.jobs.batch_job import DEFAULT_PARTITION_BYTES
from dfllm.jobs.cli_options import (
    ENGINE,
    EXIT_TOO_MANY_ERRORS,
    add_job_options,
    byte_size,
    cache_of,
    check_job_options,
    describe_client,
    job_cluster,
    say,
)

#: vLLM's run-batch and server flags that mean nothing for a file here: accepted, no effect.
VLLM_NO_OPS = {
    "--output-tmp-dir": str,
    "--enable-metrics": None,
    "--host": str,
    "--port": int,
    "--url": str,
    "--max-log-len": int,
    "--disable-log-requests": None,
    "--enable-prompt-tokens-details": None,
    "--enable-force-include-usage": None,
    "--disable-frontend-multiprocessing": None,
}


def add_parser(sub) -> argparse.ArgumentParser:
    """Add ``run-batch`` to the ``dfllm`` command's subparsers."""
    p = sub.add_parser(
        "run-batch",
        help="answer an OpenAI batch file (JSON Lines of requests) on a Dask cluster, as vllm run-batch does",
    )
    p.add_argument("-i", "--input-file", required=True, help="the batch input file (JSON Lines; any fsspec URL)")
    p.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="where to write the answers (JSON Lines; any fsspec URL); one line per non-blank input line",
    )
    p.add_argument(
        "--error-file",
        help="write failed lines here instead of to the output (OpenAI's output and error "
        "files); default: every line to the output, as vLLM does",
    )
    p.add_argument("--served-model-name", help="the model name the responses give (default: --model as given)")
    p.add_argument(
        "--response-role", default="assistant", help="the role of generated chat messages (default assistant)"
    )
    p.add_argument(
        "--unordered",
        action="store_true",
        help="write answers as partitions finish instead of in input order (join on custom_id)",
    )
    p.add_argument(
        "--partition-bytes",
        type=byte_size,
        default=DEFAULT_PARTITION_BYTES,
        metavar="SIZE",
        help="input bytes per partition: the unit of work and of resume (default 1MiB; e.g. 4MiB)",
    )
    p.add_argument("--keep-parts", action="store_true", help="keep <output>.parts/ after the output is written")
    add_job_options(p)  # the options dfllm run takes too, every engine argument included
    vllm = p.add_argument_group("vLLM server flags (accepted; no effect on a batch file)")
    for flag, kind in VLLM_NO_OPS.items():
        if kind is None:
            vllm.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
        else:
            vllm.add_argument(flag, type=kind, help=argparse.SUPPRESS)
    return p


def run_batch_command(args: argparse.Namespace) -> int:
    """``dfllm run-batch``: the job on its cluster, then the summary; the exit status."""
    from dfllm.jobs.batch_job import check_options, check_paths, dry_run_batch, run_batch

    engine_kwargs = cli_kwargs(args, ENGINE)
    cache = cache_of(args)
    check_job_options(args)
    check_options(args.model, engine_kwargs, args.response_role, args.served_model_name)  # before a cluster starts
    check_paths(args.input_file, args.output_file, args.error_file, args.storage_options)
    with job_cluster(args, engine_kwargs) as (client, resources):  # --no-prefix-placement's config set
        say(
            f"dfllm: run-batch{' --dry-run' if args.dry_run else ''} on {describe_client(client)}; dashboard "
            f"{getattr(client, 'dashboard_link', None)}"
        )
        job = dict(  # the arguments run_batch and dry_run_batch share
            model=args.model,
            error_file=args.error_file,
            response_role=args.response_role,
            served_model_name=args.served_model_name,
            partition_bytes=args.partition_bytes,
            storage_options=args.storage_options,
            resources=resources,
            progress=not args.no_progress,
            cache=cache,
            **engine_kwargs,
        )
        if args.dry_run:
            report = dry_run_batch(
                args.input_file, output_file=args.output_file, calibration_seconds=args.calibration_seconds, **job
            )
            print(report.format(), flush=True)
            return 0
        summary = run_batch(
            args.input_file,
            args.output_file,
            resume=args.resume,
            unordered=args.unordered,
            keep_parts=args.keep_parts,
            **job,
        )
    print(format_batch_summary(summary), flush=True)
    if summary.lines and summary.failed / summary.lines > args.max_error_rate:
        say(
            f"dfllm: error: {summary.failed} of {summary.lines} lines ({100 * summary.failed / summary.lines:.1f}%) "
            f"failed, above --max-error-rate {args.max_error_rate:g}; the answers were written to "
            f"{summary.output_file}" + (f" and {summary.error_file}" if summary.error_file else "")
        )
        return EXIT_TOO_MANY_ERRORS
    return 0


def format_batch_summary(s) -> str:
    """The end-of-job summary: lines answered and failed, partitions, response cache counts,
    tokens, time, files."""
    lines = [
        f"lines:       {s.lines} ({s.failed} failed)",
        f"partitions:  {s.partitions} ({s.written} computed, {s.skipped} already complete)",
    ]
    cache = getattr(s, "cache", None)
    if cache is not None:
        lines.append(
            f"cache:       {cache.get('hits', 0)} requests answered from the response cache, "
            f"{cache.get('misses', 0)} missed ({cache.get('stored', 0)} stored), "
            f"{cache.get('bypassed', 0)} not cacheable (sampled without a seed)"
        )
    if s.input_tokens + s.output_tokens:
        lines += [
            f"tokens:      {s.input_tokens} in, {s.output_tokens} out",
            f"throughput:  {s.output_tokens / max(s.seconds, 1e-9):.1f} generated tokens/s, "
            f"{s.lines / max(s.seconds, 1e-9):.2f} lines/s",
        ]
    lines += [f"wall time:   {s.seconds:.1f} s", f"output:      {s.output_file}"]
    if s.error_file:
        lines.append(f"errors:      {s.error_file}")
    return "\n".join(lines)
