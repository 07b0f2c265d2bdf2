"""The ``dfllm`` command: ``dfllm run INPUT OUTPUT``, ``dfllm run-batch``, ``dfllm models`` and ``dfllm demo``.

``dfllm run`` reads parquet, CSV or JSON Lines (a file, folder or glob; any fsspec URL),
runs one ``.llm`` task over it on a Dask cluster and writes a parquet dataset with
:func:`dfllm.write_parquet` (atomic, resumable partitions). Sampling defaults to greedy
decoding (``--temperature 0``) so that a rerun, or a resumed run, gives the same text.
``--dry-run`` prints what the job would do (rows refused, tokens, an estimate of its time)
and writes nothing (:mod:`dfllm.jobs.dry_run`); ``--max-prompt-tokens`` and
``--max-generated-tokens`` stop it cleanly at a budget (:mod:`dfllm.accessors.budget`).

Exit statuses, for schedulers (Airflow, cron, CI):

- 0: the job ran and at most ``--max-error-rate`` (default 0.5) of the output's rows have
  an ``llm_error`` (an empty input is no error);
- 1: an error (bad input, unknown column or model, a failed cluster...), one
  ``dfllm: error: ...`` line on stderr; ``DFLLM_DEBUG=1`` shows the traceback;
- 2: bad options (usage);
- 3: the job ran and wrote all its output, but more than ``--max-error-rate`` of the
  rows have an ``llm_error``: the summary as usual, then one line on stderr saying so;
- 4: a token budget (``--max-prompt-tokens``, ``--max-generated-tokens``) stopped the job:
  the partitions finished are written and kept, the rest are not (``--resume`` finishes
  it); the summary as usual, then one line on stderr saying so;
- 130: interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from dfllm.engine_args import check_engine_args, cli_kwargs
from dfllm.jobs.cli_options import (
    ENGINE,
    EXIT_TOO_MANY_ERRORS,
    add_job_options,
    cache_of,
    check_job_options,
    describe_client,
    job_cluster,
    positive_int,
    say,
)
from dfllm.tasks.kinds import KINDS

if TYPE_CHECKING:
    from dfllm.accessors.writer import WriteSummary

TASKS = tuple(KINDS)
EXIT_BUDGET = 4  # a token budget stopped the job; finished parts kept, --resume finishes it
DEFAULT_INPUT = {"generate": "prompt", "chat": "messages", "embed": "text", "classify": "text", "score": "text_1"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage plus message
        self.exit(2, f"dfllm: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dfllm", description="Batch LLM inference over dataframes.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="run one task over a dataset and write parquet")
    run.add_argument("input", help="parquet, CSV or JSON Lines: a file, folder or glob (any fsspec URL)")
    run.add_argument("output", help="output folder for the parquet dataset (any fsspec URL)")
    _add_run_options(run)
    add_job_options(run)  # the options run-batch takes too, every engine argument included
    sub.add_parser(
        "models",
        help="list the bundled models, where they are cached, and the supported architectures with their tasks",
    )
    demo = sub.add_parser("demo", help="run the main job on a small built-in data set")
    demo.add_argument("--output", help="where to write the results (default: a temporary folder)")
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--scheduler", help="address of a running Dask scheduler")
    from dfllm.jobs.batch_cli import add_parser as add_run_batch

    add_run_batch(sub)  # OpenAI batch files, vllm run-batch's flags (dfllm.jobs.batch_cli)
    return parser


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """``dfllm run``'s own options (those it shares with run-batch: :func:`add_job_options`)."""
    p.add_argument("--task", choices=TASKS, default="generate")
    p.add_argument(
        "--prompt",
        help="input column, or a template with {column} placeholders "
        "(default: prompt; chat: messages; embed/classify: text; score: text_1)",
    )
    p.add_argument("--right", help="score: the second text's column or template (default: text_2)")
    p.add_argument("--system", help="chat: a system message before each conversation")
    p.add_argument(
        "--images-column",
        metavar="COLUMN",
        help="generate/chat/embed: a column of each row's image or list of images (bytes, paths or URLs) "
        "for a vision-language or image-text model (embed: instead of --prompt); see docs/images.md",
    )
    p.add_argument(
        "--lora-column",
        metavar="COLUMN",
        help="generate/chat: a column of each row's LoRA adapter (a PEFT folder, an fsspec URL, or a "
        "name under --lora-root; empty: the base model); see docs/lora.md",
    )
    p.add_argument(
        "--lora-root", metavar="PATH", help="generate/chat: the folder (or URL) of the adapters --lora-column names"
    )
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--json-schema",
        help="generate/chat: constrain output to a JSON schema (JSON text or a "
        ".json file); the output column is a struct of its fields",
    )
    p.add_argument(
        "--choice", help="generate/chat: constrain output to one of these comma-separated values (a categorical column)"
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument("--partition-size", type=int, help="rows per partition (one task and one output file each)")
    size.add_argument("--npartitions", type=int, help="number of partitions")
    p.add_argument("--format", choices=("parquet", "csv", "json"), help="input format (default: from extensions)")
    p.add_argument("--on-error", choices=("null", "raise"), default="null")
    p.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        metavar="N",
        help="generate/chat: a budget; once the partitions computed hold N prompt tokens no new "
        f"partition starts (those running finish), exit status {EXIT_BUDGET}; --resume finishes the job",
    )
    p.add_argument(
        "--max-generated-tokens",
        type=positive_int,
        metavar="N",
        help="generate/chat: a budget of generated tokens, as --max-prompt-tokens",
    )


# ---- dfllm run --------------------------------------------------------------------------------------
def sampling_from(args) -> dict | None:
    """The job's sampling params as a dict (checked by SamplingParams); None for pooling tasks."""
    if args.task not in ("generate", "chat"):
        return None
    from dfllm.sampling_params import SamplingParams

    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p}
    if (seed := getattr(args, ENGINE + "seed")) is not None:  # --seed: the engine's, and every row's
        params["seed"] = seed
    SamplingParams(**params)  # raises ValueError naming a bad value before any work
    return params


def engine_kwargs_from(args) -> dict:
    """The engine flags given, as the task's keyword arguments (run-batch's, read by
    :func:`~dfllm.engine_args.cli_kwargs`), their values checked before any work."""
    kwargs = cli_kwargs(args, ENGINE)
    check_engine_args(**kwargs)
    if kwargs.get("reasoning_parser") and not KINDS[args.task].generative:
        raise ValueError("--reasoning-parser applies to --task generate or chat")
    return kwargs


def lora_from(args) -> dict:
    """``--lora-column``/``--lora-root`` as the task's keyword arguments (generate and chat
    only); they and the engine flags ``--max-loras``/``--max-lora-rank`` apply together."""
    if args.lora_column is None:
        extra = {
            "--max-loras": ENGINE + "max_loras",
            "--max-lora-rank": ENGINE + "max_lora_rank",
            "--lora-root": "lora_root",
        }
        given = [flag for flag, dest in extra.items() if getattr(args, dest) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} apply with --lora-column")
        return {}
    if not KINDS[args.task].generative:
        raise ValueError("--lora-column applies to --task generate or chat")
    return {"lora": args.lora_column, "lora_root": args.lora_root}


def build_job(args, resources: dict | None = None):
    """The lazy result of the task over the input (checks columns, model and params now);
    ``resources`` go on its llm tasks (``--gpu``)."""
    from dfllm.jobs.sources import read_input, repartition

    sampling = sampling_from(args)
    if KINDS[args.task].model_required and not args.model:
        raise ValueError(f"--task {args.task} needs --model (a sequence-classification model; none is bundled)")
    ddf = read_input(args.input, fmt=args.format, storage_options=args.storage_options)
    if not len(ddf.columns):  # JSON Lines without a line: no row and no field
        ddf = _no_rows(args, ddf)
    ddf = repartition(ddf, partition_size=args.partition_size, npartitions=args.npartitions)
    images = getattr(args, "images_column", None)
    embed_images = args.task == "embed" and images and not args.prompt  # embed the images, not a text
    first = None if embed_images else args.prompt or _default_input(args.task, ddf.columns)
    common = {"model": args.model, "on_error": args.on_error, "resources": resources, **engine_kwargs_from(args)}
    if images:
        common["images"] = images
    constraint = structured_from(args)
    constraint.update(lora_from(args))
    cache = cache_from(args)
    if cache is not None:
        constraint["cache"] = cache
    if args.task == "score":
        return ddf.llm.score(first, args.right or "text_2", **common)
    if args.task in ("embed", "classify"):
        return getattr(ddf.llm, args.task)(first, **common)
    if args.task == "chat":
        return ddf.llm.chat(first, system=args.system, sampling_params=sampling, **constraint, **common)
    if args.system:
        raise ValueError("--system applies to --task chat")
    return ddf.llm.generate(first, sampling_params=sampling, **constraint, **common)


def structured_from(args) -> dict:
    """``json_schema=``/``choice=`` for the accessor from ``--json-schema``/``--choice``."""
    if (args.json_schema or args.choice) and not KINDS[args.task].generative:
        raise ValueError("--json-schema and --choice apply to --task generate or chat")
    if args.json_schema and args.choice:
        raise ValueError("give either --json-schema or --choice, not both")
    if args.choice:
        return {"choice": [c.strip() for c in args.choice.split(",") if c.strip()]}
    if args.json_schema:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            path = Path(text)
            if not path.is_file():
                raise ValueError(f"--json-schema: {text!r} is neither JSON text nor a file")
            text = path.read_text()
        try:
            return {"json_schema": json.loads(text)}
        except json.JSONDecodeError as exc:
            raise ValueError(f"--json-schema: not valid JSON ({exc})") from None
    return {}


def cache_from(args):
    """The job's response cache (``--cache``, ``--cache-max-bytes``,
    ``--cache-storage-options``), or None."""
    if args.cache is not None and not KINDS[args.task].generative:
        raise ValueError("--cache applies to --task generate or chat")
    return cache_of(args)


def _no_rows(args, ddf):
    """An input with no row and no field (JSON Lines without a line) as an empty frame of the
    text columns the job reads, so that it is the success an empty input is (a CSV with only
    its header is one already)."""
    import dask.dataframe as dd
    import pandas as pd

    from dfllm.tasks.schema import STRING
    from dfllm.tasks.templates import is_template, template_fields

    spec = args.prompt or DEFAULT_INPUT[args.task]
    reads = template_fields(spec) if is_template(spec) else [spec]
    reads += [
        c
        for c in (args.right if args.task == "score" else None, getattr(args, "images_column", None), args.lora_column)
        if c
    ]
    empty = pd.DataFrame({c: pd.Series([], dtype=STRING) for c in dict.fromkeys(reads)})
    return dd.from_pandas(empty, npartitions=max(1, ddf.npartitions))


def _default_input(task: str, columns) -> str:
    name = DEFAULT_INPUT[task]
    if name not in columns:
        raise ValueError(f"--prompt not given and the input has no {name!r} column (columns: {list(columns)})")
    return name


def run(args) -> int:
    from dfllm.accessors.writer import refuse_cache_overlap, refuse_overlap, write_parquet
    from dfllm.dashboard import page_link

    refuse_overlap([args.input], args.output, args.storage_options)  # before the input is even read
    refuse_cache_overlap(cache_of(args), [args.input], args.output, args.storage_options)
    budget = budget_from(args)
    check_job_options(args)
    if not args.scheduler:  # bad options and inputs fail before a local cluster starts
        build_job(args)
    with job_cluster(args, cli_kwargs(args, ENGINE)) as (client, resources):
        # built with the client current, so that a model directory only the workers have is
        # checked on a worker, and with --gpu's resources on the llm tasks themselves
        job = build_job(args, resources)
        page = page_link(client)
        say(
            f"dfllm: {args.task} on {describe_client(client)}; dashboard {client.dashboard_link}"
            + (f"; dfllm page {page}" if page else "")
        )
        if args.dry_run:
            return print_dry_run(args, job, budget)
        before, cache_before = deduplicated_requests(client), cache_counts(client)
        summary = write_parquet(
            job,
            args.output,
            resume=args.resume,
            storage_options=args.storage_options,
            progress=not args.no_progress,
            budget=budget,
        )
        deduplicated = deduplicated_requests(client) - before
        cache = {k: v - cache_before.get(k, 0) for k, v in cache_counts(client).items()} if args.cache else None
    print(format_summary(summary, deduplicated, cache), flush=True)
    if summary.stopped:
        say(
            f"dfllm: stopped: {summary.stopped}; {summary.missing} of {summary.partitions} partition(s) not "
            f"written; run again with --resume to finish the job in {summary.path}"
        )
        return EXIT_BUDGET
    failed = too_many_errors(summary, args.max_error_rate)
    if failed:
        say(f"dfllm: error: {failed}")
        return EXIT_TOO_MANY_ERRORS
    return 0


def budget_from(args):
    """The job's token budget (``--max-prompt-tokens``, ``--max-generated-tokens``) as a
    :class:`~dfllm.accessors.budget.Budget`, or None."""
    if args.max_prompt_tokens is None and args.max_generated_tokens is None:
        return None
    if not KINDS[args.task].generative:
        raise ValueError("--max-prompt-tokens and --max-generated-tokens apply to --task generate or chat")
    from dfllm.accessors.budget import Budget

    return Budget(args.max_prompt_tokens, args.max_generated_tokens)


def print_dry_run(args, job, budget=None) -> int:
    """``dfllm run --dry-run``: the report of :func:`dfllm.jobs.dry_run.dry_run` on stdout."""
    from dfllm.jobs.dry_run import DEFAULT_CALIBRATION_SECONDS, dry_run

    report = dry_run(
        job,
        output=args.output,
        storage_options=args.storage_options,
        budget=budget,
        calibration_seconds=args.calibration_seconds or DEFAULT_CALIBRATION_SECONDS,
        progress=not args.no_progress,
    )
    print(report.format(), flush=True)
    return 0


def too_many_errors(summary: WriteSummary, max_error_rate: float) -> str | None:
    """Why the job counts as failed (more than ``max_error_rate`` of its rows have an
    ``llm_error``; resumed partitions included), or None. No rows is no failure."""
    if summary.rows == 0 or summary.errors / summary.rows <= max_error_rate:
        return None
    return (
        f"{summary.errors} of {summary.rows} rows ({100 * summary.errors / summary.rows:.1f}%) have llm_error, "
        f"above --max-error-rate {max_error_rate:g}; the output was written to {summary.path}"
    )


def deduplicated_requests(client) -> int:
    """The requests the cluster's engines answered with an identical request's output
    (``dfllm_deduplicated_requests``, summed over the workers' engines). A worker that died
    meanwhile (the scheduler may still list it) is left out, never failing a finished job."""
    return sum(client.run(_engine_deduplicated, on_error="ignore").values())


def cache_counts(client) -> dict[str, int]:
    """The response cache counts of every worker (:func:`dfllm.tasks.response_cache.counts`), summed."""
    from dfllm.jobs import batch_job

    return batch_job.cache_counts(client)


def _engine_deduplicated() -> int:
    from dfllm.worker.engine_cache import engines_now

    return sum(
        int(m.value)
        for llm in engines_now()
        if llm.engine is not None
        for m in llm.get_metrics()
        if m.name == "dfllm_deduplicated_requests"
    )


def format_summary(s, deduplicated: int = 0, cache: dict[str, int] | None = None) -> str:
    """The end-of-job summary: rows, errors, rows computed once for identical rows, rows
    answered from the response cache (``cache``: the job's cache counts, with ``--cache``),
    tokens, throughput, time and where the output is."""
    tokens = s.input_tokens + s.output_tokens
    lines = [
        f"rows:        {s.rows} ({s.errors} with llm_error"
        + (f", {deduplicated} answered from an identical row" if deduplicated else "")
        + ")",
        f"partitions:  {s.partitions} ({s.written} written, {s.skipped} already complete"
        + (f", {s.missing} not written" if getattr(s, "missing", 0) else "")
        + ")",
    ]
    if getattr(s, "stopped", None):
        lines.append(f"stopped:     {s.stopped}; --resume finishes the job")
    if cache is not None:
        lines.append(
            f"cache:       {cache.get('hits', 0)} rows answered from the response cache, "
            f"{cache.get('misses', 0)} missed ({cache.get('stored', 0)} stored), "
            f"{cache.get('bypassed', 0)} not cacheable (sampled without a seed)"
        )
    if tokens:
        lines += [
            f"tokens:      {s.input_tokens} in, {s.output_tokens} out",
            f"throughput:  {s.output_tokens / max(s.seconds, 1e-9):.1f} generated tokens/s, "
            f"{s.rows / max(s.seconds, 1e-9):.2f} rows/s",
        ]
    else:
        lines.append(f"throughput:  {s.rows / max(s.seconds, 1e-9):.2f} rows/s")
    lines += [f"wall time:   {s.seconds:.1f} s", f"output:      {s.path}"]
    return "\n".join(lines)


# ---- dfllm models ------------------------------------------------------------------------------------
def models(args) -> int:
    from dfllm.models.bundled import BUNDLED_MODELS, DEFAULT_CHAT_MODEL, bundled_model_dir, package_file

    print(f"{'alias':24} {'package':22} {'status':14} location")
    for alias, m in BUNDLED_MODELS.items():
        source = package_file(m)
        where: object = bundled_model_dir(alias) if m.format == "gguf" else source
        if source is None:
            status, where = "not installed", m.install_hint
        elif m.format == "gguf" and not (bundled_model_dir(alias) / "config.json").exists():
            status = "not converted"
        else:
            status = "ready"
        default = {
            DEFAULT_CHAT_MODEL: " (default: generate, chat)",
            "all-minilm-l6-v2": " (default: embed, score)",
        }.get(alias, "")
        print(f"{alias:24} {m.package:22} {status:14} {where}")
        print(f"    {m.description}{default}")
    print_architectures()
    return 0


def print_architectures() -> None:
    """The architectures dfllm runs (a model directory's config.json ``architectures``) and
    their tasks; decoders pool with ``runner="pooling"``."""
    from dfllm.models.families import supported_architectures

    print(f"\n{'architecture':40} tasks")
    for arch, tasks in supported_architectures().items():
        print(f"{arch:40} {', '.join(tasks)}")


# ---- dfllm demo --------------------------------------------------------------------------------------
DEMO_HAIKUS = [
    "Autumn moonlight / a worm digs silently",
    "An old silent pond / a frog jumps into the pond",
    "Over the wintry / forest, winds howl in rage",
    "The light of a candle / is transferred to another",
    "In the twilight rain / these brilliant-hued hibiscus",
    "A summer river being crossed / how pleasing",
    "First autumn morning / the mirror I stare into",
    "Winter seclusion / listening, that evening",
]


def demo(args) -> int:
    import pandas as pd

    with tempfile.TemporaryDirectory(prefix="dfllm-demo-") as tmp:
        source = Path(tmp) / "haikus.parquet"
        pd.DataFrame({"id": range(len(DEMO_HAIKUS)), "haiku": DEMO_HAIKUS}).to_parquet(source)
        output = args.output or str(Path(tmp) / "out")
        run_args = build_parser().parse_args(
            [
                "run",
                str(source),
                output,
                "--task",
                "chat",
                "--prompt",
                "Complete this haiku: {haiku}",
                "--system",
                "You are a poet who completes unfinished haikus. Reply with the full haiku only.",
                "--max-tokens",
                str(args.max_tokens),
                "--npartitions",
                "2",
            ]
            + (["--scheduler", args.scheduler] if args.scheduler else [])
        )
        status = run(run_args)
        results = pd.read_parquet(output).sort_values("id")
        for row in results.head(4).itertuples():
            print(f"\n> {row.haiku}\n{str(getattr(row, KINDS['chat'].output_column)).strip()}")
        if args.output:
            print(f"\nall {len(results)} results in {args.output}")
    return status


def run_batch(args) -> int:
    """``dfllm run-batch``: see :mod:`dfllm.jobs.batch_cli`."""
    from dfllm.jobs.batch_cli import run_batch_command

    return run_batch_command(args)


COMMANDS = {"run": run, "run-batch": run_batch, "models": models, "demo": demo}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dfllm`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        say("dfllm: interrupted")
        return 130
    except Exception as exc:  # one line for the user; DFLLM_DEBUG=1 for the traceback
        if os.environ.get("DFLLM_DEBUG"):
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        say(f"dfllm: error: {type(exc).__name__}: {message}" if message else f"dfllm: error: {type(exc).__name__}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
