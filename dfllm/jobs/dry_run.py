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

import dataclasses
import hashlib
import heapq
import math
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import dask
import numpy as np
import pandas as pd

from dfllm.tasks.schema import LLM_ERROR

if TYPE_CHECKING:
    from dfllm.config import EngineConfig
    from dfllm.engine.input_processor import EngineRequest, InputProcessor
    from dfllm.engine.llm_engine import LLMEngine
    from dfllm.tasks.task import LLMTask

DEFAULT_SAMPLE_ROWS = 16
DEFAULT_CALIBRATION_SECONDS = 30.0
EXAMPLES = 3  # refused rows shown per reason
TOO_LONG = "longer than max_model_len="  # the input processor's detail for a prompt with no room left


# ---- what turns rows into requests -----------------------------------------------------------------------
class RequestSource(Protocol):
    """What a dry run asks of a job's rows: the engine they run on (``model``,
    ``engine_kwargs`` as sorted ``(name, value)`` pairs), the checked requests a partition
    becomes, and which of them a response cache answers. Picklable (it travels to the workers)."""

    @property
    def model(self) -> str | None:
        """The model (a directory or bundled alias; None: the default)."""
        ...

    @property
    def engine_kwargs(self) -> tuple:
        """``LLM(...)``'s keyword arguments as sorted ``(name, value)`` pairs."""
        ...

    def requests(
        self, df: pd.DataFrame, processor: InputProcessor, lock: threading.Lock
    ) -> tuple[list[EngineRequest], dict[int, str]] | tuple[list[EngineRequest], dict[int, str], dict[int, str]]:
        """The requests the real run would hand to the engine for ``df``'s rows, one per row
        not refused, in row order; and the refused rows: row position -> the message its
        ``llm_error`` would hold. Call ``processor`` holding ``lock``. A source whose rows do
        not all run on this engine adds a third item, the rows the dry run does not estimate:
        row position -> why (rows neither run here nor refused). A source whose ``requests``
        takes ``check_lora=`` gets the engine's check of a LoRA adapter (see
        :func:`source_requests`)."""
        ...

    def cache_hits(self, requests: list[EngineRequest], config: EngineConfig) -> list[bool] | None:
        """For each request, whether the job's response cache holds its answer (None: no cache)."""
        ...


class _Captured(Exception):  # noqa: N818 (not an error: how the runner hands its requests back)
    def __init__(self, requests: list[EngineRequest]):
        super().__init__("requests captured")
        self.requests = requests


def _capture(requests: list[EngineRequest]) -> list:
    raise _Captured(list(requests))


@dataclasses.dataclass(frozen=True)
class TaskRequests:
    """The requests of a generate or chat :class:`~dfllm.tasks.task.LLMTask`: its own
    runner (:mod:`dfllm.tasks.runners`) builds them, so rows are read, rendered, checked
    exactly as in the real run; the runner stops where it would generate. Requests stay in
    row order (a task's ``sort_by`` changes the engine's order, not what it computes), and
    bad rows are collected whatever the task's ``on_error`` (the dry run lists them all)."""

    task: LLMTask

    def __post_init__(self) -> None:
        if not self.task.spec.generative:
            raise ValueError(
                f"dry run: the task is {self.task.kind}; a dry run checks generate and chat jobs "
                "(their prompts, tokens and time)"
            )

    @property
    def model(self) -> str | None:
        return self.task.model

    @property
    def engine_kwargs(self) -> tuple:
        return self.task.engine_kwargs

    def requests(
        self,
        df: pd.DataFrame,
        processor: InputProcessor,
        lock: threading.Lock,
        check_lora: Callable[[Any], None] | None = None,
    ) -> tuple[list[EngineRequest], dict[int, str]]:
        """As :meth:`RequestSource.requests`; ``check_lora`` is the engine's check of a LoRA
        adapter (:meth:`~dfllm.engine.llm_engine.LLMEngine.check_lora`), the one the real run
        calls on each row's adapter, so that a row whose adapter cannot run is refused here too."""
        from dfllm.tasks.runners import RUNNERS, Generation

        fields: dict[str, Any] = {"on_error": "null", "sort_by": ()}
        if getattr(self.task, "cache", None) is not None:
            fields["cache"] = None  # every accepted request reaches the capture; hits are counted apart
        task = dataclasses.replace(self.task, **fields)
        out: dict[str, list] = {c: [None] * len(df) for c in task.output_dtypes()}
        try:
            RUNNERS[task.spec.runner](df, task, out, Generation(processor, lock, _capture, check_lora=check_lora))
            requests: list[EngineRequest] = []  # no row got through
        except _Captured as captured:
            requests = captured.requests
        return requests, {i: e for i, e in enumerate(out[LLM_ERROR]) if e is not None}

    def cache_hits(self, requests: list[EngineRequest], config: EngineConfig) -> list[bool] | None:
        cache = getattr(self.task, "cache", None)
        if cache is None:
            return None
        return cached_requests(cache, config, self.task.engine_kwargs, requests)


def cached_requests(cache, config: EngineConfig, engine_kwargs: tuple, requests: list[EngineRequest]) -> list[bool]:
    """For each request, whether ``cache`` (a response cache) holds an entry for it, looked up
    by name only (nothing is read, refreshed or written)."""
    from concurrent.futures import ThreadPoolExecutor

    import fsspec

    from dfllm.tasks.response_cache import engine_identity, request_key

    engine = engine_identity(config, engine_kwargs)
    keys = [None if engine is None else request_key(engine, r) for r in requests]
    fs = fsspec.core.url_to_fs(cache.url, **dict(cache.storage_options or {}))[0]

    def present(key: str | None) -> bool:
        if key is None:
            return False
        try:
            return bool(fs.exists(cache.path_of(key)))
        except OSError:
            return False

    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(present, keys))


# ---- one partition, on a worker ----------------------------------------------------------------------------
@dataclasses.dataclass
class EngineFacts:
    """The engine settings a dry run's figures depend on, as the worker loaded them."""

    model: str
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prefix_caching: bool
    deduplicate: bool


@dataclasses.dataclass
class PartitionSurvey:
    """What one partition's rows would be: the figures a worker sends back for a dry run."""

    partition: int
    rows: int
    prompt_tokens: np.ndarray  # per accepted request, in the order the engine would get them
    max_tokens: np.ndarray  # per accepted request: the most it may generate (max_tokens, within the context)
    runs: np.ndarray  # per accepted request: whether the engine computes it (not a duplicate, not a cache hit)
    refused: int
    reasons: dict[str, list]  # reason -> [rows, [(row label, message)...] examples]
    longest: tuple[int, Any]  # (prompt tokens, row label) of the longest accepted prompt
    duplicates: int  # requests identical to an earlier one of the partition (the engine computes them once)
    duplicate_tokens: int  # their prompt tokens
    request_digests: np.ndarray  # uint64 per distinct deterministic request (job-wide duplicates)
    block_digests: np.ndarray  # uint64 per distinct full block looked up in the prefix cache
    looked_up_blocks: int  # full blocks the prefix cache would look up (over requests computed)
    cache_hits: int | None
    engine: EngineFacts
    load_seconds: float  # loading the engine, if this task did
    seconds: float
    not_estimated: dict[str, int] = dataclasses.field(default_factory=dict)  # why -> rows run elsewhere


def survey_partition(df: pd.DataFrame, source: RequestSource, partition: int) -> PartitionSurvey:
    """Turn one partition's rows into requests on this worker's engine (loaded if need be)
    and summarize them (see the module docstring)."""
    from dfllm.worker.engine_cache import lease, load_count

    start = time.perf_counter()
    loads = load_count()
    with lease(source.model, dict(source.engine_kwargs)) as entry:
        load = time.perf_counter() - start if load_count() > loads else 0.0
        engine = _generative(entry.llm)
        got = source_requests(source, df, engine, entry.lock) if len(df) else ([], {})
        requests, refused = got[0], got[1]
        skipped: dict[int, str] = got[2] if len(got) > 2 else {}
        hits = source.cache_hits(requests, entry.llm.config) if requests else None
        facts = engine_facts(entry.llm)
    survey = _summarize(partition, df, requests, refused, hits, facts, load, time.perf_counter() - start, skipped)
    survey.not_estimated = dict(Counter(skipped.values()))
    return survey


def source_requests(source: RequestSource, df: pd.DataFrame, engine: LLMEngine, lock: threading.Lock) -> tuple:
    """``source.requests`` of ``df`` on ``engine``, with the engine's LoRA check
    (``check_lora=``, the one the real run calls on each row's adapter) where the source
    takes it."""
    import inspect

    try:
        takes = "check_lora" in inspect.signature(source.requests).parameters
    except (TypeError, ValueError):
        takes = False
    lora = {"check_lora": engine.check_lora} if takes else {}
    return source.requests(df, engine.input_processor, lock, **lora)


def _generative(llm) -> LLMEngine:
    if llm.engine is None:
        raise ValueError(
            f"dry run: {llm.config.model_path.name} is loaded as a pooling model; a dry run checks "
            "generate and chat jobs"
        )
    return llm.engine


def engine_facts(llm) -> EngineFacts:
    """The settings of ``llm``'s engine that a dry run's figures depend on."""
    cfg = llm.config
    return EngineFacts(
        cfg.model_path.name,
        cfg.max_model_len,
        cfg.block_size,
        cfg.max_num_seqs,
        cfg.max_num_batched_tokens,
        bool(cfg.enable_prefix_caching),
        bool(cfg.deduplicate_requests),
    )


def _summarize(
    partition: int,
    df: pd.DataFrame,
    requests: list[EngineRequest],
    refused: dict[int, str],
    hits: list[bool] | None,
    facts: EngineFacts,
    load: float,
    seconds: float,
    skipped: dict[int, str] | None = None,
) -> PartitionSurvey:
    lengths = np.array([len(r.prompt_token_ids) for r in requests], dtype=np.int64)
    limits = np.array([generation_limit(r, facts.max_model_len) for r in requests], dtype=np.int64)
    reasons: dict[str, list] = {}
    for i, message in refused.items():
        entry = reasons.setdefault(refusal_reason(message), [0, []])
        entry[0] += 1
        if len(entry[1]) < EXAMPLES:
            entry[1].append((_label(df.index[i]), message))
    # identical deterministic requests of a partition meet in the engine at once: computed once
    digests, seen, runs = [], set(), np.ones(len(requests), dtype=bool)
    for k, r in enumerate(requests):
        key = dedupe_digest(r) if facts.deduplicate else None
        if key is None:
            continue
        if key in seen:
            runs[k] = False
        else:
            seen.add(key)
            digests.append(key)
    duplicates = int((~runs).sum())
    duplicate_tokens = int(lengths[~runs].sum()) if len(requests) else 0
    if hits is not None:
        runs &= ~np.array(hits, dtype=bool)
    blocks: set[int] = set()
    looked_up = 0
    if facts.prefix_caching:
        for k, r in enumerate(requests):
            if runs[k]:
                chain = block_digests(r.prompt_token_ids, facts.block_size)
                looked_up += len(chain)
                blocks.update(chain)
    longest: tuple[int, Any] = (0, None)
    if len(requests):
        k = int(lengths.argmax())
        positions = sorted(set(range(len(df))) - set(refused) - set(skipped or {}))  # the accepted rows, in order
        longest = (int(lengths[k]), _label(df.index[positions[k]]) if len(positions) == len(requests) else None)
    return PartitionSurvey(
        partition,
        len(df),
        lengths,
        limits,
        runs,
        len(refused),
        reasons,
        longest,
        duplicates,
        duplicate_tokens,
        np.array(digests, dtype=np.uint64),
        np.array(sorted(blocks), dtype=np.uint64),
        looked_up,
        None if hits is None else int(sum(hits)),
        facts,
        load,
        seconds,
    )


def _label(value) -> Any:
    """A row's index label as a plain Python value."""
    return value.item() if hasattr(value, "item") else value


def generation_limit(request: EngineRequest, max_model_len: int) -> int:
    """The most tokens ``request`` may generate: its ``max_tokens`` (None: up to the context),
    within ``max_model_len``."""
    room = max(0, max_model_len - len(request.prompt_token_ids))
    cap = request.params.max_tokens
    return room if cap is None else min(int(cap), room)


def refusal_reason(message: str) -> str:
    """A refused row's message as a reason shared by rows failing the same way (its numbers
    left out)."""
    if TOO_LONG in message:
        return "prompt longer than max_model_len"
    text = re.sub(r"\d+", "N", message)
    return text if len(text) <= 100 else text[:97] + "..."


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def dedupe_digest(request: EngineRequest) -> int | None:
    """A digest of what identical deterministic requests share in the engine's deduplication
    (prompt tokens, every sampling parameter, banned words); None for a request that is
    never merged (sampled without a seed)."""
    params = request.params
    if not (params.is_greedy or params.seed is not None):
        return None
    ids = np.asarray(request.prompt_token_ids, dtype=np.int64).tobytes()
    return _digest(ids + b"\0" + repr(params).encode() + b"\0" + repr(request.bad_words_ids).encode())


def block_digests(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hash chain of the full blocks the prefix cache looks up for a prompt (as the block
    manager does: every full block but one that would leave no token to compute)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    chain, parent = [], b""
    for i in range((len(ids) - 1) // block_size):
        h = hashlib.blake2b(parent + ids[i * block_size : (i + 1) * block_size].tobytes(), digest_size=8).digest()
        chain.append(int.from_bytes(h, "little"))
        parent = h
    return chain


# ---- calibration, on a worker -----------------------------------------------------------------------------
@dataclasses.dataclass
class Calibration:
    """The calibration run's measurements, on one worker's engine.

    ``step_seconds`` and ``row_step_seconds``: a decode step takes ``step_seconds +
    row_step_seconds x rows in its batch`` (fitted over the run's steps);
    ``prefill_token_seconds``: each prompt token computed adds that; ``generated_share``:
    the sample's generated tokens over its ``max_tokens`` (a row still running when the time
    ran out counts as generating halfway from what it had to its ``max_tokens``),
    ``longest_share`` the largest of a row's (1 if any was stopped); ``censored``: rows
    stopped by the time limit."""

    rows: int
    prompt_tokens: int
    computed_prompt_tokens: int
    generated_tokens: int
    max_tokens: int
    seconds: float
    prefill_seconds: float
    step_seconds: float
    row_step_seconds: float
    prefill_token_seconds: float
    generated_share: float
    longest_share: float
    censored: int
    worker: str = ""


def calibrate(frames: list[pd.DataFrame], source: RequestSource, sample_rows: int, seconds: float) -> Calibration:
    """Run up to ``sample_rows`` distinct accepted requests of ``frames`` (spread over them)
    through this worker's engine, timed (see :class:`Calibration`)."""
    from dfllm.worker.driver import driver
    from dfllm.worker.engine_cache import lease

    with lease(source.model, dict(source.engine_kwargs)) as entry:
        engine = _generative(entry.llm)
        requests: list[EngineRequest] = []
        for df in frames:
            requests += source_requests(source, df, engine, entry.lock)[0] if len(df) else []
        sample = _spread(_distinct(requests), sample_rows)
        cfg = entry.llm.config
        cal = driver().call(
            lambda: measure(engine, entry.lock, sample, seconds, cfg.max_model_len, cfg.max_num_batched_tokens)
        )
    cal.worker = _worker_address()
    return cal


def _worker_address() -> str:
    try:
        from distributed import get_worker

        return str(get_worker().address)
    except (ImportError, ValueError):
        return "this process"


def _distinct(requests: list[EngineRequest]) -> list[EngineRequest]:
    seen: set = set()
    out = []
    for r in requests:
        key = (tuple(r.prompt_token_ids), repr(r.params))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _spread(items: list, n: int) -> list:
    """``n`` of ``items`` evenly spaced (all if there are no more)."""
    if len(items) <= n:
        return list(items)
    return [items[int(k * len(items) / n)] for k in range(n)]


def _run(
    engine: LLMEngine,
    lock: threading.Lock,
    requests: list[EngineRequest],
    deadline: float | None,
    steps: list[tuple[float, int]] | None = None,
) -> tuple[dict[int, int], list[int]]:
    """Add ``requests`` and step the engine until they finish (or ``deadline``, then abort
    the rest). Returns each finished request's generated token count by its position in
    ``requests``, and the positions of those aborted; ``steps`` gets ``(seconds, batch)`` of
    every pure decode step (no prompt waiting, not the first step)."""
    run = uuid.uuid4().hex[:12]
    ids = [f"dfllm-dry-run-{run}-{k}" for k in range(len(requests))]
    with lock:
        for rid, r in zip(ids, requests):
            engine.add_request(rid, r)
    done: dict[int, int] = {}
    first = True
    while True:
        with lock:
            if not engine.has_unfinished_requests():
                break
            if deadline is not None and time.perf_counter() > deadline:
                engine.abort_request([rid for k, rid in enumerate(ids) if k not in done])
                break
            before = engine.stats()
            t = time.perf_counter()
            outputs = engine.step()
            dt = time.perf_counter() - t
        if steps is not None and not first and before.num_waiting == 0 and before.num_running:
            steps.append((dt, before.num_running))
        first = False
        for out in outputs:
            done[int(out.request_id.rsplit("-", 1)[1])] = len(out.outputs[0].token_ids)
    return done, [k for k in range(len(requests)) if k not in done]


def measure(
    engine: LLMEngine,
    lock: threading.Lock,
    sample: list[EngineRequest],
    seconds: float,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> Calibration:
    """Time ``sample`` on ``engine`` (on the thread that steps it): its prompts alone, then
    the rows as the job would run them, then one row alone if the batch sizes seen do not
    tell a decode step's fixed cost from its cost per row; all in about ``seconds`` (rows
    still running then are stopped)."""
    if not sample:
        return Calibration(0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0)
    start = time.perf_counter()
    with lock:
        engine.reset_prefix_cache()
        hits = engine.stats().prefix_cache_hits
    prompt_tokens = sum(len(r.prompt_token_ids) for r in sample)
    one = [dataclasses.replace(r, params=dataclasses.replace(r.params, max_tokens=1, min_tokens=0)) for r in sample]
    t = time.perf_counter()
    _run(engine, lock, one, None)
    prefill = time.perf_counter() - t
    with lock:
        computed = max(1, prompt_tokens - (engine.stats().prefix_cache_hits - hits))
    steps: list[tuple[float, int]] = []
    done, aborted = _run(engine, lock, sample, start + 0.85 * seconds, steps)
    reached = len(steps) + 1  # tokens a row still running at the time limit had generated, at least
    batches = {b for _, b in steps}
    if len(batches) < 2 or max(batches) < 2 * min(batches):  # one row alone: the fixed cost of a step
        short = min(sample, key=lambda r: len(r.prompt_token_ids))
        alone = dataclasses.replace(
            short, params=dataclasses.replace(short.params, max_tokens=6, min_tokens=6, ignore_eos=True)
        )
        typical = float(np.median([t for t, _ in steps])) if steps else 0.0
        _run(
            engine, lock, [alone], time.perf_counter() + max(start + seconds - time.perf_counter(), 3 * typical), steps
        )
    fixed, per_row = fit_steps(steps)
    prefill_steps = max(1, math.ceil(computed / max(1, max_num_batched_tokens)))
    per_token = max(0.0, prefill - prefill_steps * (fixed + per_row * len(sample))) / computed
    limits = [generation_limit(r, max_model_len) for r in sample]
    # a row stopped by the time limit: halfway between what it had generated and its max_tokens
    expected = sum(done.values()) + sum((min(reached, limits[k]) + limits[k]) / 2 for k in aborted)
    share = min(1.0, expected / sum(limits)) if sum(limits) else 1.0
    by_row = [n / limits[k] for k, n in done.items() if limits[k]]
    longest = 1.0 if aborted or not by_row else min(1.0, max(by_row))
    return Calibration(
        len(sample),
        prompt_tokens,
        computed,
        sum(done.values()),
        sum(limits),
        time.perf_counter() - start,
        prefill,
        fixed,
        per_row,
        per_token,
        share,
        longest,
        len(aborted),
    )


def fit_steps(steps: list[tuple[float, int]]) -> tuple[float, float]:
    """``(fixed, per_row)`` seconds of a decode step of ``rows``: a least-squares line through
    the steps' ``(seconds, rows)``, neither part negative."""
    if not steps:
        return 0.0, 0.0
    t = np.array([s for s, _ in steps], dtype=float)
    n = np.array([b for _, b in steps], dtype=float)
    if len(set(n.tolist())) < 2:
        return float(np.median(t)), 0.0
    per_row, fixed = np.polyfit(n, t, 1)
    if per_row < 0:
        return float(np.median(t)), 0.0
    if fixed < 0:
        return 0.0, float(np.median(t / n))
    return float(fixed), float(per_row)


# ---- the report ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Estimate:
    """The job's estimated wall time on this cluster (``seconds``) and its parts; what it
    assumes, in words."""

    seconds: float
    load_seconds: float
    read_seconds: float
    generation_seconds: float
    engines: int
    slots: int
    decode_steps: float
    generated_tokens: int
    computed_prompt_tokens: int
    assumptions: list[str]


@dataclasses.dataclass
class Refusal:
    """Rows refused for one reason: how many, and a few (row label, message) examples."""

    reason: str
    rows: int
    examples: list[tuple[Any, str]]


@dataclasses.dataclass
class DryRunReport:
    """What a job would do (see the module docstring); :meth:`format` is the printed report."""

    what: str  # the job in a few words
    rows: int
    partitions: int
    accepted: int
    refused: int
    refusals: list[Refusal]
    prompt_tokens: int
    prompt_p50: int
    prompt_p99: int
    prompt_longest: int
    longest_row: Any
    max_generated_tokens: int  # the sum of the accepted rows' max_tokens (within the context)
    duplicates: int  # rows identical to an earlier row of their partition: computed once
    duplicate_prompt_tokens: int
    job_duplicates: int  # rows identical to an earlier row anywhere in the job (deterministic ones)
    prefix_cached_tokens: int  # prompt tokens in full blocks another request computes first (one shared cache)
    looked_up_tokens: int  # prompt tokens in full blocks the prefix cache looks up
    cache_hits: int | None  # rows the response cache answers (None: no cache)
    engine: EngineFacts | None
    calibration: Calibration | None
    estimate: Estimate | None
    on_error_raise: bool = False
    output: str | None = None  # what the output folder holds now
    budget: str | None = None  # when a token budget would stop the job
    seconds: float = 0.0
    not_estimated: dict[str, int] = dataclasses.field(default_factory=dict)  # why -> rows neither run nor refused

    @property
    def skipped(self) -> int:
        """Rows the dry run does not estimate (run by another engine)."""
        return sum(self.not_estimated.values())

    def format(self) -> str:
        """The report as ``dfllm run --dry-run`` prints it."""
        lines = [f"dry run:          {self.what}; nothing was written"]
        lines.append(
            f"rows:             {self.rows:,} in {self.partitions:,} partition(s); {self.accepted:,} would "
            f"run, {self.refused:,} refused" + (f", {self.skipped:,} not estimated" if self.skipped else "")
        )
        for why, n in sorted(self.not_estimated.items(), key=lambda kv: -kv[1]):
            lines.append(f"  not estimated:  {n:,} x {why}")
        for r in self.refusals:
            row, message = r.examples[0] if r.examples else (None, "")
            example = f"row {row!r}" + ("" if message == r.reason else f": {_short(message)}")
            lines.append(f"  refused:        {r.rows:,} x {_short(r.reason)} (e.g. {example})")
        if self.refused and self.on_error_raise:
            lines.append("  (with --on-error raise the job would fail at the first of them)")
        if self.accepted:
            lines.append(
                f"prompt tokens:    {self.prompt_tokens:,} (p50 {self.prompt_p50:,}, p99 {self.prompt_p99:,}, "
                f"longest {self.prompt_longest:,}"
                + (f", row {self.longest_row!r}" if self.longest_row is not None else "")
                + ")"
            )
            lines.append(
                f"max tokens:       {self.max_generated_tokens:,} generated at most (max_tokens, within the context)"
            )
            share = 100 * self.prefix_cached_tokens / max(1, self.prompt_tokens)
            bs = self.engine.block_size if self.engine else 0
            lines.append(
                f"prefix sharing:   {self.prefix_cached_tokens:,} prompt tokens ({share:.0f}%) in full "
                f"{bs}-token blocks shared with an earlier prompt: the prefix cache computes them once "
                "(at most: one cache for the job)"
            )
            lines.append(
                f"identical rows:   {self.duplicates:,} identical to an earlier row of their partition "
                f"(computed once: {self.duplicate_prompt_tokens:,} prompt tokens and their generation); "
                f"{self.job_duplicates:,} in the whole job"
            )
        if self.cache_hits is not None:
            lines.append(
                f"response cache:   {self.cache_hits:,} of {self.accepted:,} rows found (answered without the engine)"
            )
        if self.output:
            lines.append(f"output:           {self.output}")
        c = self.calibration
        if c is not None and c.rows:
            lines.append(
                f"calibration:      {c.rows} rows on {c.worker or 'one worker'} in {c.seconds:.1f} s: "
                f"prefill {c.computed_prompt_tokens / max(c.prefill_seconds, 1e-9):,.0f} tokens/s; a decode "
                f"step {1000 * c.step_seconds:.1f} ms + {1000 * c.row_step_seconds:.2f} ms per row; rows "
                f"generated {100 * c.generated_share:.0f}% of max_tokens"
                + (f" ({c.censored} still running at the time limit)" if c.censored else "")
            )
        e = self.estimate
        if e is not None:
            lines.append(
                f"estimate:         {_duration(e.seconds)} (engine load {_duration(e.load_seconds)}, "
                f"read and tokenize {_duration(e.read_seconds)}, generation "
                f"{_duration(e.generation_seconds)}: ~{e.generated_tokens:,} tokens generated in "
                f"~{e.decode_steps:,.0f} steps on {e.engines} engine(s) x {e.slots} partitions at once)"
            )
            lines += [f"  assumes:        {a}" for a in e.assumptions]
        if self.budget:
            lines.append(f"budget:           {self.budget}")
        lines.append(f"dry run took:     {_duration(self.seconds)}")
        return "\n".join(lines)


def _short(text: str, n: int = 110) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


def nearest_rank(values: np.ndarray, q: float) -> int:
    """The ``q``-th percentile by nearest rank (a value of ``values``; 0 for none)."""
    if not len(values):
        return 0
    return int(np.percentile(values, q, method="inverted_cdf"))


# ---- the dry run ----------------------------------------------------------------------------------------------
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
    from dfllm.accessors.partitions import PartitionFunction, llm_origin

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
    from dfllm.accessors.writer import _compute

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
    surveys: list[PartitionSurvey] = _compute(jobs, progress, resources, desc="dry run partitions")
    read_seconds = time.perf_counter() - start
    calibration = None
    accepted = [s for s in surveys if len(s.prompt_tokens)]
    if sample_rows and accepted:
        picks = _spread([s.partition for s in accepted], 4)
        job = dask.delayed(calibrate, pure=False)(
            [parts[i] for i in picks],
            requests,
            sample_rows,
            calibration_seconds,
            dask_key_name=f"llm-dry-run-calibrate-{run}",
        )
        calibration = _compute([job], False, resources, desc="dry run calibration")[0]
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
    from dfllm.accessors.writer import _filesystem, _survey, input_paths, refuse_overlap

    refuse_overlap(input_paths(source), output, storage_options)
    fs, root = _filesystem(output, storage_options)
    ours = _survey(fs, root, output)
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
        import os

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


def build_report(
    surveys: list[PartitionSurvey],
    calibration: Calibration | None,
    shape: tuple[int, int],
    read_seconds: float,
    what: str,
    budget=None,
) -> DryRunReport:
    """The report from the partitions' surveys and the calibration (see :class:`DryRunReport`)."""
    lengths = np.concatenate([s.prompt_tokens for s in surveys]) if surveys else np.zeros(0, dtype=np.int64)
    limits = np.concatenate([s.max_tokens for s in surveys]) if surveys else np.zeros(0, dtype=np.int64)
    reasons: dict[str, Refusal] = {}
    for s in surveys:
        for reason, (n, examples) in s.reasons.items():
            r = reasons.setdefault(reason, Refusal(reason, 0, []))
            r.rows += n
            r.examples += examples[: max(0, EXAMPLES - len(r.examples))]
    facts = next((s.engine for s in surveys), None)
    longest = max((s.longest for s in surveys if s.longest[0]), default=(0, None), key=lambda x: x[0])
    digests = [s.request_digests for s in surveys if len(s.request_digests)]
    distinct_requests = len(np.unique(np.concatenate(digests))) if digests else 0
    job_duplicates = sum(s.duplicates for s in surveys) + sum(len(d) for d in digests) - distinct_requests
    blocks = [s.block_digests for s in surveys if len(s.block_digests)]
    distinct_blocks = len(np.unique(np.concatenate(blocks))) if blocks else 0
    looked_up = sum(s.looked_up_blocks for s in surveys)
    bs = facts.block_size if facts else 0
    hits = [s.cache_hits for s in surveys if s.cache_hits is not None]
    report = DryRunReport(
        what=what,
        rows=sum(s.rows for s in surveys),
        partitions=len(surveys),
        accepted=len(lengths),
        refused=sum(s.refused for s in surveys),
        refusals=sorted(reasons.values(), key=lambda r: -r.rows),
        prompt_tokens=int(lengths.sum()),
        prompt_p50=nearest_rank(lengths, 50),
        prompt_p99=nearest_rank(lengths, 99),
        prompt_longest=longest[0],
        longest_row=longest[1],
        max_generated_tokens=int(limits.sum()),
        duplicates=sum(s.duplicates for s in surveys),
        duplicate_prompt_tokens=sum(s.duplicate_tokens for s in surveys),
        job_duplicates=job_duplicates,
        prefix_cached_tokens=(looked_up - distinct_blocks) * bs,
        looked_up_tokens=looked_up * bs,
        cache_hits=sum(hits) if hits else None,
        engine=facts,
        calibration=calibration,
        estimate=None,
    )
    for s in surveys:
        for why, n in s.not_estimated.items():
            report.not_estimated[why] = report.not_estimated.get(why, 0) + n
    if calibration is not None and calibration.rows and facts is not None:
        report.estimate = estimate(surveys, calibration, shape, read_seconds, report.prefix_cached_tokens, facts)
    if budget:
        report.budget = _budget_note(surveys, budget, calibration)
    return report


def estimate(
    surveys: list[PartitionSurvey],
    cal: Calibration,
    shape: tuple[int, int],
    read_seconds: float,
    prefix_cached: int,
    facts: EngineFacts,
) -> Estimate:
    """The job's wall time: engine load, reading and tokenizing (as measured by the dry run),
    and generation, from the partitions' rows and the calibration (see the module docstring)."""
    engines, slots = shape
    durations, generated, prompt = [], 0.0, 0
    for s in surveys:
        runs = s.runs if len(s.runs) else np.zeros(0, dtype=bool)
        limits, lengths = s.max_tokens[runs], s.prompt_tokens[runs]
        if not len(limits):
            continue
        generated += cal.generated_share * float(limits.sum())
        prompt += int(lengths.sum())
        prefill_steps = math.ceil(int(lengths.sum()) / max(1, facts.max_num_batched_tokens))
        durations.append(cal.longest_share * float(limits.max()) + prefill_steps)
    lanes = [0.0] * (engines * slots)  # Dask starts partitions in order on the first free thread
    for d in durations:
        heapq.heappush(lanes, heapq.heappop(lanes) + d)
    steps = max(max(lanes), generated / (engines * facts.max_num_seqs))
    computed = max(0, prompt - prefix_cached)
    gen_seconds = (
        steps * cal.step_seconds + (cal.row_step_seconds * generated + cal.prefill_token_seconds * computed) / engines
    )
    load = max((s.load_seconds for s in surveys), default=0.0)
    read = max(0.0, read_seconds - load)
    assumptions = [
        f"each row generates {100 * cal.generated_share:.0f}% of its max_tokens, as the {cal.rows} calibration "
        "rows did"
        + (
            f" ({cal.censored} stopped by the time limit counted halfway to their max_tokens; a longer "
            "calibration is more exact)"
            if cal.censored
            else ""
        ),
        f"{engines} engine(s) as fast as the calibration's, each running {slots} partition(s) at once; a partition "
        "takes as many decode steps as its longest row",
        "prompt blocks shared with an earlier prompt are computed once (one prefix cache for the job); identical "
        "rows of a partition once",
        "engine load, reading and tokenizing take what they took in this dry run; writing the parts, nothing",
    ]
    return Estimate(
        load + read + gen_seconds,
        load,
        read,
        gen_seconds,
        engines,
        slots,
        steps,
        round(generated),
        computed,
        assumptions,
    )


def _budget_note(surveys: list[PartitionSurvey], budget, cal: Calibration | None) -> str:
    """When ``budget`` would stop the job: the partitions (in order) whose tokens reach it."""
    prompt = generated = 0.0
    share = cal.generated_share if cal is not None and cal.rows else 1.0
    for k, s in enumerate(surveys, 1):
        runs = s.runs if len(s.runs) else np.zeros(0, dtype=bool)
        prompt += float(s.prompt_tokens[runs].sum())
        generated += share * float(s.max_tokens[runs].sum())
        if budget.reached(int(prompt), int(generated)):
            return (
                f"would stop the job after about {k:,} of {len(surveys):,} partitions "
                f"(~{int(prompt):,} prompt and ~{int(generated):,} generated tokens by then; partitions "
                "running at that moment finish too)"
            )
    return f"the job fits (~{int(prompt):,} prompt and ~{int(generated):,} generated tokens in all)"


def refusal_counts(report: DryRunReport) -> Counter:
    """Refused rows by reason (for tests and scripts)."""
    return Counter({r.reason: r.rows for r in report.refusals})
