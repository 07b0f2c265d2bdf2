"""OpenAI batch files through a Dask cluster: :func:`run_batch`, behind ``dfllm run-batch``.

The input (any fsspec URL: a local path, ``s3://``...) is never read whole into the client.
It is split into partitions of about ``partition_bytes`` at line ends
(:func:`dask.bytes.read_bytes`), each keeping its lines' places; each partition is answered
on a worker by :func:`dfllm.jobs.batch.answer` (the worker's one engine per model, its
batches shared by the partitions running there) and its answers written as one parquet part
into a staging folder beside the output, ``<output>.parts/``, by
:func:`dfllm.write_parquet`: atomically, keyed by the partition's lines and the job's
settings. As parts come in, the client streams them into the output JSON Lines file, one
answer per non-blank input line:

- in input order (default): part ``i`` is written once parts ``0..i-1`` are;
- with ``unordered=True`` (``--unordered``), a part's answers are written as soon as it is
  done (join on ``custom_id``); an error line, which names its line number, waits until
  every earlier part is done and its number known.

With ``error_file`` (OpenAI's style), answered lines go to the output and failed ones to
the error file; without it (vLLM's), every line goes to the output. A local output is
written under a temporary name and moved into place at the end; on object storage the
object appears when its upload completes. Either way the output appears only complete.

Resume: a job that was killed leaves its finished parts in the staging folder; run it
again with ``resume=True`` (``--resume``) and only the missing partitions are computed,
then the whole output is written again from the parts, so every line is answered exactly
once. Once the output is written, the files the job wrote in the staging folder are removed,
then the folder if it is empty (``keep_parts=True`` keeps them, so that a later resumed run
recomputes nothing). The staging folder is the job's own: a job refuses to start if it
holds a file no batch job wrote, or the input or error file (:func:`check_paths`), or the
response cache.

Hostile lines (a chat template that raises, lone surrogates, integers of more digits than
Python reads, values of any type in any field) are each that line's error answer; a UTF-8
byte-order mark at the start of the file is dropped, and a file that starts with a UTF-16
or UTF-32 one is refused before any work.

``reasoning_parser=`` (``--reasoning-parser``) splits a thinking model's chat answers into
``reasoning_content`` and ``content`` (see :mod:`dfllm.jobs.batch`); ``cache=`` (``--cache``)
answers the deterministic lines asked before from a response cache
(:mod:`dfllm.tasks.response_cache`). :func:`dry_run_batch` (``--dry-run``) reads and
checks every line and tokenizes the chat and completions ones on the cluster, writing nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from dataclasses import dataclass

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dfllm.accessors import writer
from dfllm.accessors.partitions import WritableFunction
from dfllm.accessors.prefix_placement import JobPlacement, placement_settings
from dfllm.errors import printable
from dfllm.jobs.batch import GENERATIVE, BatchOptions, Engines, answer, engine_requests
from dfllm.jobs.dry_run import (
    DEFAULT_CALIBRATION_SECONDS,
    DEFAULT_SAMPLE_ROWS,
    DryRunReport,
    build_report,
    cached_requests,
    cluster_shape,
    dry_run_source,
)
from dfllm.jobs.openai_batch import BatchError, LineError, answer_line, custom_id_of, parse_line, strict_json
from dfllm.tasks.prefix_keys import RowKeys, request_keys
from dfllm.tasks.response_cache import ResponseCache, as_cache
from dfllm.tasks.schema import NUM_GENERATED_TOKENS, NUM_INPUT_TOKENS
from dfllm.tasks.write_key import canonical

DEFAULT_PARTITION_BYTES = 1 << 20  # ~2,000 chat requests: the unit of work, of resume and of progress
STAGING_SUFFIX = ".parts"
UTF8_BOM = b"\xef\xbb\xbf"
#: byte-order marks of the encodings a batch file is not in, longest first (UTF-32 LE's starts as UTF-16 LE's)
OTHER_BOMS = {
    b"\xff\xfe\x00\x00": "UTF-32 LE",
    b"\x00\x00\xfe\xff": "UTF-32 BE",
    b"\xff\xfe": "UTF-16 LE",
    b"\xfe\xff": "UTF-16 BE",
}
_STR, _INT = pd.ArrowDtype(pa.string()), pd.ArrowDtype(pa.int64())
#: The columns of a staged part, one row per input line (blank lines included, with no status).
PART_COLUMNS = {
    "line": _INT,
    "key": _STR,
    "custom_id": _STR,
    "status_code": _INT,
    "body": _STR,
    "error_code": _STR,
    "error_message": _STR,
    "error_param": _STR,
    NUM_INPUT_TOKENS: _INT,
    NUM_GENERATED_TOKENS: _INT,
}


@dataclass
class BatchSummary:
    """What a batch job did: its files, the non-blank lines it answered and how many of
    them failed, the partitions computed and kept from an earlier run, tokens and seconds."""

    output_file: str
    error_file: str | None
    lines: int
    failed: int
    partitions: int
    written: int
    skipped: int
    input_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    cache: dict[str, int] | None = None  # with a response cache: its counts over the job (hits, misses, stored...)


# ---- one partition ------------------------------------------------------------------------------------------
class BatchFunction(WritableFunction):
    """What a batch job maps over the input's partitions: their lines' answers (one row per
    line, see :data:`PART_COLUMNS`), computed with the job's :class:`~dfllm.jobs.batch.BatchOptions`
    and response cache (not part of the write key: a cached answer is the answer)."""

    kind = "batch"
    error_column = "error_code"

    def __init__(
        self,
        options: BatchOptions,
        resources: dict | None = None,
        cache: ResponseCache | None = None,
        placement: JobPlacement | None = None,
    ):
        self.options, self.resources, self.cache, self.placement = options, resources, cache, placement
        self.__name__ = "llm-batch"

    @property
    def write_key(self) -> str:
        return canonical(self.options)

    def model_sources(self) -> tuple:
        return tuple(dict.fromkeys([self.options.model_for("chat"), self.options.model_for("embeddings")]))

    def arrow_types(self) -> dict:
        return {c: d.pyarrow_dtype for c, d in PART_COLUMNS.items()}

    def response_cache(self) -> ResponseCache | None:
        return self.cache

    def run(self, df: pd.DataFrame) -> pd.DataFrame:
        return answer_partition(df, self.options, self.cache)

    def without_placement(self) -> BatchFunction:
        return self if self.placement is None else BatchFunction(self.options, self.resources, self.cache)

    @property
    def engine_kwargs(self) -> dict:
        return dict(self.options.engine_kwargs)

    def prefix_keys(self, df: pd.DataFrame) -> list[RowKeys | None]:
        """Each chat or completions line's prefix keys (its first prompt's, rendered and
        tokenized as :func:`answer_partition` does), None for other lines and for lines
        that fail (their error comes from their run)."""
        keys: list[RowKeys | None] = [None] * len(df)
        with Engines(self.options) as engines:
            for pos, (text, ok) in enumerate(zip(df["text"].tolist(), df["utf8"].tolist())):
                try:
                    line = parse_row(text, ok) if text.strip() else None
                    if line is not None and line.endpoint in GENERATIVE:
                        gen = engines.generation(line.endpoint)
                        keys[pos] = request_keys(engine_requests(line.request, gen)[0], gen.block_size)
                except Exception:  # noqa: BLE001  (keyed nowhere: the line's own run answers its error)
                    continue
        return keys

    def __dask_tokenize__(self):
        return (
            type(self).__name__,
            canonical(self.options),
            sorted((self.resources or {}).items()),
            None if self.cache is None else (self.cache.url, self.cache.max_bytes),
            None if self.placement is None else self.placement.settings,
        )


def line_key(base: bytes, block: int, line: int, text: str) -> str:
    """The key of input line ``line`` of block ``block`` (its ids in the answers): the job's
    options (``base``, their digest), its place and its text."""
    return hashlib.sha256(base + f"\0{block}\0{line}\0".encode() + text.encode("utf-8", "replace")).hexdigest()[:32]


def parse_row(text: str, ok: bool, key: str = ""):
    """One input line as the job reads it: the parsed request, or the :class:`LineError` of a
    line that is not one (not valid UTF-8, not JSON, a bad field...)."""
    if not ok:
        raise LineError("the line is not valid UTF-8", code="invalid_json")
    return parse_line(text, key)


def answer_partition(df: pd.DataFrame, options: BatchOptions, cache: ResponseCache | None = None) -> pd.DataFrame:
    """The answers of one partition's lines (columns ``block``, ``line``, ``text``,
    ``utf8``), one row each, blank lines with a null status."""
    base = hashlib.sha256(canonical(options).encode()).digest()
    n = len(df)
    cols: dict[str, list] = {c: [None] * n for c in PART_COLUMNS}
    cols["line"] = df["line"].tolist()
    parsed, where = [], []
    for pos, (block, line, text, ok) in enumerate(
        zip(df["block"].tolist(), cols["line"], df["text"].tolist(), df["utf8"].tolist())
    ):
        key = line_key(base, block, line, text)
        cols["key"][pos] = key
        if not text.strip():
            continue  # a blank line: skipped, as vLLM does
        try:
            request = parse_row(text, ok, key)
        except LineError as exc:
            cols["custom_id"][pos] = custom_id_of(text) if ok else None
            _fill_error(cols, pos, exc)
            continue
        cols["custom_id"][pos] = printable(request.custom_id)
        parsed.append(request)
        where.append(pos)
    if parsed:
        with Engines(options, cache) as engines:
            results = answer(parsed, engines)
        for pos, r in zip(where, results):
            if r.error is not None:
                _fill_error(cols, pos, r.error)
                continue
            cols["status_code"][pos] = r.status_code
            cols["body"][pos] = printable(strict_json(r.body))  # a surrogate: its JSON escape
            cols[NUM_INPUT_TOKENS][pos], cols[NUM_GENERATED_TOKENS][pos] = r.input_tokens, r.output_tokens
    return pd.DataFrame({c: pd.Series(v, dtype=PART_COLUMNS[c], index=df.index) for c, v in cols.items()})


def _fill_error(cols: dict, pos: int, exc: LineError) -> None:
    cols["status_code"][pos] = exc.status
    param = None if exc.param is None else printable(exc.param)
    cols["error_code"][pos], cols["error_message"][pos], cols["error_param"][pos] = exc.code, printable(str(exc)), param


# ---- the input --------------------------------------------------------------------------------------------
def _block_lines(data: bytes, block: int) -> pd.DataFrame:
    """One block of the input (whole lines) as rows: its number, each line's place in it,
    the line's text (``\\r\\n`` ends read as ``\\n``) and whether it was valid UTF-8. A UTF-8
    byte-order mark at the start of the file (block 0) is dropped, as Python's ``utf-8-sig``
    and pandas drop it (PowerShell 5 and Excel write one); anywhere else it stays, and that
    line is not JSON."""
    if block == 0 and data.startswith(UTF8_BOM):
        data = data[len(UTF8_BOM) :]
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()
    texts, ok = [], []
    for line in raw:
        line = line[:-1] if line.endswith(b"\r") else line
        try:
            texts.append(line.decode("utf-8"))
            ok.append(True)
        except UnicodeDecodeError:
            texts.append(line.decode("utf-8", "replace"))
            ok.append(False)
    return pd.DataFrame(
        {
            "block": pd.Series([block] * len(texts), dtype="int64"),
            "line": pd.Series(range(len(texts)), dtype="int64"),
            "text": pd.Series(texts, dtype=_STR),
            "utf8": pd.Series(ok, dtype="bool"),
        }
    )


_INPUT_META = _block_lines(b"", 0)  # the input's columns, no line


def read_lines(path: str, partition_bytes: int = DEFAULT_PARTITION_BYTES, storage_options: dict | None = None):
    """The input file as a lazy Dask frame of its lines, one partition per block of about
    ``partition_bytes`` (a compressed file is one partition); None for an empty file."""
    import dask
    import dask.dataframe as dd
    from dask.bytes import read_bytes
    from fsspec.utils import infer_compression

    compression = infer_compression(path)
    if compression:
        _check_compressed(path, compression, storage_options)
    _check_utf8(path, compression, storage_options)
    _, files = read_bytes(
        path,
        delimiter=b"\n",
        blocksize=None if compression else partition_bytes,
        sample=False,
        compression=compression,
        **(storage_options or {}),
    )
    blocks = [b for f in files for b in f]
    if not blocks:
        return None
    frames = [dask.delayed(_block_lines, pure=True)(b, i) for i, b in enumerate(blocks)]
    return dd.from_delayed(frames, meta=_INPUT_META, verify_meta=False)


def _check_utf8(path: str, compression: str | None, storage_options: dict | None) -> None:
    """``ValueError`` naming the input file if it starts with a UTF-16 or UTF-32 byte-order
    mark (PowerShell 5's ``>`` writes UTF-16): split at its ``\\n`` bytes its lines would be
    neither UTF-8 nor JSON, and not even the file's lines, so it is refused before any work."""
    fs, where = fsspec.core.url_to_fs(path, **(storage_options or {}))
    with fs.open(where, "rb", compression=compression) as f:
        head = f.read(4)
    found = next((name for bom, name in OTHER_BOMS.items() if head.startswith(bom)), None)
    if found is not None:
        raise ValueError(
            f"the input file {path} is {found} text (it starts with that byte-order mark); a batch file is "
            "UTF-8 JSON Lines: save it as UTF-8 (in PowerShell: Out-File -Encoding utf8)"
        )


def _check_compressed(path: str, compression: str, storage_options: dict | None) -> None:
    """``ValueError`` naming the input file and what is wrong unless it decompresses whole as
    ``compression`` (its extension's): a file that is not in that format, or is cut short, is
    refused before the job writes anything, not found by the job's one partition halfway. It
    is read through once here, a buffer at a time, never whole. A ``.zip`` must hold one file
    (only it would be read: the lines of any other would have no answer)."""
    import zipfile

    fs, where = fsspec.core.url_to_fs(path, **(storage_options or {}))
    names: list[str] = []
    try:
        if compression == "zip":
            with fs.open(where, "rb") as raw, zipfile.ZipFile(raw) as z:
                names = z.namelist()
                if len(names) == 1:
                    with z.open(names[0]) as f:
                        while f.read(1 << 20):
                            pass
        else:
            with fs.open(where, "rb", compression=compression) as f:
                while f.read(1 << 20):
                    pass
    except Exception as exc:  # noqa: BLE001  (BadGzipFile, EOFError, OSError, BadZipFile, LZMAError...)
        raise ValueError(
            f"cannot read the input file {path} as {compression} (from its extension): {type(exc).__name__}: "
            f"{exc}; give a file in that format, or name it without that extension"
        ) from None
    if compression == "zip" and len(names) != 1:
        listed = ", ".join(map(repr, names[:3])) + (", ..." if len(names) > 3 else "")
        raise ValueError(
            f"the input file {path} is a .zip of {len(names)} files{f' ({listed})' if names else ''}; "
            "it must hold one (the batch file)"
        )


# ---- the output ---------------------------------------------------------------------------------------------
class _Sink:
    """A JSON Lines file being written: under a temporary name then moved into place on a
    local disk, straight to its place elsewhere (an object appears when its upload completes)."""

    def __init__(self, path: str, storage_options: dict | None):
        from fsspec.implementations.local import LocalFileSystem

        self.path = path
        self.fs, self.target = fsspec.core.url_to_fs(path, **(storage_options or {}))
        self.local = isinstance(self.fs, LocalFileSystem)
        if self.local:
            folder, name = os.path.split(self.target)
            os.makedirs(folder or ".", exist_ok=True)
            _remove_stale_temporaries(folder or ".", name)
            self.where = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex}")
        else:
            self.where = self.target
        self.file = self.fs.open(self.where, "wb")
        self.lines = 0

    def write(self, lines: list[str]) -> None:
        if lines:
            self.file.write(("\n".join(lines) + "\n").encode("utf-8"))
            self.lines += len(lines)

    def commit(self) -> None:
        self.file.close()
        if self.local:
            os.replace(self.where, self.target)

    def discard(self) -> None:
        try:
            if not self.local and hasattr(self.file, "discard"):
                self.file.discard()  # an object store's upload is abandoned, not completed
            else:
                self.file.close()
        finally:
            if self.local and os.path.exists(self.where):
                os.remove(self.where)


def _remove_stale_temporaries(folder: str, name: str) -> None:
    """Temporary outputs that killed runs of this job left beside the output."""
    pattern = re.compile(rf"\.{re.escape(name)}\.tmp-[0-9a-f]{{32}}")
    for entry in os.listdir(folder):
        if pattern.fullmatch(entry):
            os.remove(os.path.join(folder, entry))


class _Assembler:
    """Streams finished parts of the staging folder into the output (and error) file, in
    input order or as they come (see the module docstring)."""

    COLUMNS = ["line", "key", "custom_id", "status_code", "body", "error_code", "error_message", "error_param"]

    def __init__(self, staging: str, storage_options: dict | None, output: _Sink, errors: _Sink | None, ordered: bool):
        self.fs, self.root = writer.folder_filesystem(staging, storage_options)
        self.output, self.errors, self.ordered = output, errors, ordered
        self.records: dict[int, dict] = {}
        self.prefix = 0  # parts 0..prefix-1 are done and fully written
        self.offset = 0  # input lines in those parts
        self.lines = self.failed = 0

    def part_done(self, i: int, record: dict) -> None:
        self.records[i] = record
        if not self.ordered and i != self.prefix:
            self._stream(i, successes=True, failures=False, offset=None)
        while self.prefix in self.records:
            k = self.prefix
            first_time = self.ordered or k == i
            self._stream(k, successes=first_time, failures=True, offset=self.offset)
            self.offset += self.records[k]["rows"]
            self.prefix += 1

    def _stream(self, i: int, successes: bool, failures: bool, offset: int | None) -> None:
        with self.fs.open(writer.part_path(self.root, i), "rb") as f:
            part = pq.ParquetFile(f)
            record = json.loads((part.metadata.metadata or {}).get(writer.FOOTER_KEY, b"{}"))
            if record.get("key") != self.records[i]["key"]:
                raise RuntimeError(f"staged part {i} changed while the job ran; is another job writing to {self.root}?")
            for batch in part.iter_batches(batch_size=4096, columns=self.COLUMNS):
                self._write(batch.to_pydict(), successes, failures, offset)

    def _write(self, b: dict, successes: bool, failures: bool, offset: int | None) -> None:
        out: list[str] = []  # in input order
        bad = [] if self.errors is not None else out
        failed = 0
        for line, key, cid, status, body, code, message, param in zip(*(b[c] for c in self.COLUMNS)):
            if status is None:
                continue  # a blank line
            if code is None:
                if successes:
                    out.append(answer_line(key, cid, status, body))
            elif failures:
                assert offset is not None
                n = offset + line + 1
                bad.append(answer_line(key, cid, status, None, BatchError(code, f"line {n}: {message}", param, n)))
                failed += 1
        self.lines += len(out) + (len(bad) if bad is not out else 0)
        self.failed += failed
        self.output.write(out)
        if self.errors is not None:
            self.errors.write(bad)


# ---- the job ---------------------------------------------------------------------------------------------------
def _job_options(
    model, engine_kwargs: dict, response_role: str, served_model_name, partition_bytes, reasoning_parser, cache
):
    """A batch job's response cache and checked options (``ValueError`` naming a bad one);
    ``engine_kwargs`` gain the reasoning parser."""
    cache = as_cache(cache)
    if reasoning_parser:
        engine_kwargs["reasoning_parser"] = reasoning_parser
    options = check_options(model, engine_kwargs, response_role, served_model_name)
    if not isinstance(partition_bytes, int) or isinstance(partition_bytes, bool) or partition_bytes < 1:
        raise ValueError(f"partition_bytes must be a positive number of bytes, got {partition_bytes!r}")
    return cache, options


def run_batch(
    input_file: str,
    output_file: str,
    *,
    model: str | None = None,
    error_file: str | None = None,
    response_role: str = "assistant",
    served_model_name: str | None = None,
    resume: bool = False,
    unordered: bool = False,
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
    storage_options: dict | None = None,
    resources: dict | None = None,
    progress: bool = True,
    keep_parts: bool = False,
    reasoning_parser: str | None = None,
    cache=None,
    **engine_kwargs,
) -> BatchSummary:
    """Answer an OpenAI batch file (JSON Lines of ``{"custom_id", "method", "url", "body"}``)
    into an output file of OpenAI's ``BatchRequestOutput`` lines; see the module docstring
    and ``docs/batch.md``.

    ``model``: a model directory or bundled alias for every line (default: the bundled chat
    model for chat and completions, MiniLM for embeddings, score and rerank); ``body.model``
    is not read, so files written for OpenAI run unchanged. ``engine_kwargs`` go to
    :class:`dfllm.LLM` (``max_model_len=...``). Runs on the current Dask client's cluster
    (``resources`` as in :func:`dfllm.write_parquet`), or in this process without one.
    Bad options raise ``ValueError`` before any work; a bad line is that line's error answer.

    ``reasoning_parser`` (``"qwen3"``, ``"deepseek_r1"``; vLLM's ``--reasoning-parser``): chat
    answers carry a thinking model's reasoning in ``message.reasoning_content`` and the answer
    alone in ``message.content`` (see :mod:`dfllm.jobs.batch`). ``cache``: a response cache
    (a path or fsspec URL, a :class:`~dfllm.tasks.response_cache.ResponseCache` or a dict
    of its fields): deterministic chat and completions lines (greedy, or seeded) asked before
    on the same model and engine settings are answered from it without the engine, and the
    new ones stored.
    """
    start = time.perf_counter()
    cache, options = _job_options(
        model, engine_kwargs, response_role, served_model_name, partition_bytes, reasoning_parser, cache
    )
    staging = output_file.rstrip("/") + STAGING_SUFFIX
    check_paths(input_file, output_file, error_file, storage_options)
    writer.refuse_cache_overlap(cache, [], staging, storage_options)  # the staging folder is the job's own
    lines = read_lines(input_file, partition_bytes, storage_options)
    output = _Sink(output_file, storage_options)
    errors = _Sink(error_file, storage_options) if error_file else None
    sinks = [output] if errors is None else [output, errors]
    cache_before = cache_counts() if cache is not None else None
    try:
        if lines is None:  # an empty input: empty outputs
            written = skipped = partitions = tokens_in = tokens_out = 0
            assembler = None
        else:
            settings = placement_settings()  # prefix-aware placement (Dask config dfllm.prefix-placement)
            placement = JobPlacement(settings, lines.npartitions) if settings.enabled else None
            job = lines.map_partitions(
                BatchFunction(options, resources, cache, placement),
                meta=pd.DataFrame({c: pd.Series([], dtype=d) for c, d in PART_COLUMNS.items()}),
            )
            assembler = _Assembler(staging, storage_options, output, errors, ordered=not unordered)
            s = writer.write_parquet(
                job,
                staging,
                resume=resume,
                storage_options=storage_options,
                progress=progress,
                on_partition=assembler.part_done,
            )
            assert assembler.prefix == s.partitions, "every part was streamed"
            written, skipped, partitions = s.written, s.skipped, s.partitions
            tokens_in, tokens_out = s.input_tokens, s.output_tokens
        for sink in sinks:
            sink.commit()
    except BaseException:
        for sink in sinks:
            sink.discard()
        raise
    if not keep_parts and lines is not None:
        _remove_staging(staging, storage_options, partitions)
    cache_delta = None
    if cache_before is not None:
        cache_delta = {k: v - cache_before.get(k, 0) for k, v in cache_counts().items()}
    return BatchSummary(
        output_file,
        error_file,
        assembler.lines if assembler else 0,
        assembler.failed if assembler else 0,
        partitions,
        written,
        skipped,
        tokens_in,
        tokens_out,
        time.perf_counter() - start,
        cache_delta,
    )


def cache_counts(client=None) -> dict[str, int]:
    """The response cache counts (:func:`dfllm.tasks.response_cache.counts`) of every
    worker of ``client``'s cluster (default: the current Dask client's), summed; of this
    process without a client. A worker that died meanwhile is left out."""
    from dfllm.tasks.response_cache import counts

    if client is None:
        try:
            from distributed import default_client

            client = default_client()
        except (ImportError, ValueError):
            return counts()
    total: dict[str, int] = {}
    for worker in client.run(counts, on_error="ignore").values():
        for name, n in worker.items():
            total[name] = total.get(name, 0) + n
    return total


# ---- the dry run --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchRequests:
    """A batch job's lines as a dry run reads them (a :class:`~dfllm.jobs.dry_run.RequestSource`
    for :func:`~dfllm.jobs.dry_run.dry_run_source`): each line is read and checked as
    :func:`answer_partition` reads it, and a chat or completions line becomes requests through
    the engine's input processor exactly as :func:`dfllm.jobs.batch.answer` makes them, so the
    dry run refuses the lines the real run answers with an error before generating, with the
    same messages. Embeddings, score and rerank lines run on the pooling model, not on the
    engine the dry run checks: without ``--model`` they are counted as not estimated; with
    ``--model`` (a generative one, which the dry run needs) they are refused, as the real run
    refuses them."""

    options: BatchOptions
    cache: ResponseCache | None = None

    @property
    def model(self) -> str | None:
        return self.options.model_for("chat")

    @property
    def engine_kwargs(self) -> tuple:
        return self.options.engine_kwargs

    def requests(self, df: pd.DataFrame, processor, lock) -> tuple[list, dict[int, str], dict[int, str]]:
        from dfllm.jobs.batch import (
            DEFAULT_POOLING_MODEL,
            GENERATIVE,
            Generation,
            as_line_error,
            engine_requests,
            unsupported_endpoint,
        )

        gen = Generation(processor, lock, _not_here, _not_here)
        requests: list = []
        refused: dict[int, str] = {}
        skipped: dict[int, str] = {}
        for pos, (text, ok) in enumerate(zip(df["text"].tolist(), df["utf8"].tolist())):
            try:
                line = parse_row(text, ok)
                if line.endpoint not in GENERATIVE:
                    if self.options.model is None:
                        skipped[pos] = (
                            f"{line.endpoint} lines (run on {DEFAULT_POOLING_MODEL}; a dry run checks "
                            "chat and completions lines)"
                        )
                        continue
                    raise unsupported_endpoint(line.endpoint, self.options)
                requests += engine_requests(line.request, gen)
            except Exception as exc:  # noqa: BLE001  (as the real run: whatever a line raises is that line's)
                refused[pos] = printable(str(as_line_error(exc)))
        return requests, refused, skipped

    def cache_hits(self, requests: list, config) -> list[bool] | None:
        if self.cache is None:
            return None
        return cached_requests(self.cache, config, self.options.engine_kwargs, requests)


def _not_here(*args):
    raise AssertionError("a dry run generates nothing")


def dry_run_rows(df: pd.DataFrame) -> pd.DataFrame:
    """One partition's lines for a dry run: blank lines left out (the job skips them), each
    line labelled by its ``custom_id`` (by its place when it has none: ``line N`` of the
    file, or of a later partition). A partition may have no line (each block after the
    first of a line longer than ``partition_bytes``)."""
    blank = pd.Series([not t.strip() for t in df["text"].tolist()], index=df.index, dtype=bool)
    keep = df[~blank]  # a mask, not a list: an empty partition's [] would select no columns
    labels = []
    for block, line, text, ok in zip(
        keep["block"].tolist(), keep["line"].tolist(), keep["text"].tolist(), keep["utf8"].tolist()
    ):
        cid = custom_id_of(text) if ok else None
        labels.append(cid if cid else f"line {line + 1}" + (f" of partition {block}" if block else ""))
    return keep.set_axis(pd.Index(labels, dtype=object), axis=0)


def dry_run_batch(
    input_file: str,
    *,
    model: str | None = None,
    output_file: str | None = None,
    error_file: str | None = None,
    response_role: str = "assistant",
    served_model_name: str | None = None,
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
    storage_options: dict | None = None,
    resources: dict | None = None,
    progress: bool = False,
    reasoning_parser: str | None = None,
    cache=None,
    sample_rows: int | None = None,
    calibration_seconds: float | None = None,
    **engine_kwargs,
) -> DryRunReport:
    """A dry run of :func:`run_batch` with the same arguments (``dfllm run-batch --dry-run``):
    every line read and checked, and every chat and completions line rendered and tokenized
    by the job's engine on the cluster (the current Dask client's, else this process), then a
    short calibration run and an estimate of the job's time; see :mod:`dfllm.jobs.dry_run`.
    Nothing is written: no output, no ``<output>.parts`` folder, no cache entry (``cache``
    is looked up, by name). ``output_file`` and ``error_file`` are checked as the real run
    checks them, read only. Returns the :class:`~dfllm.jobs.dry_run.DryRunReport`, whose rows
    are the non-blank lines and whose "would run" counts the engine's requests (a
    completions line with several prompts is several); embeddings, score and rerank lines
    are not estimated (see :class:`BatchRequests`)."""
    start = time.perf_counter()
    cache, options = _job_options(
        model, engine_kwargs, response_role, served_model_name, partition_bytes, reasoning_parser, cache
    )
    if output_file is not None:
        check_paths(input_file, output_file, error_file, storage_options)
    else:
        check_input(input_file, storage_options)
    lines = read_lines(input_file, partition_bytes, storage_options)
    if lines is None:
        report = build_report([], None, cluster_shape(resources), 0.0, f"run-batch of {input_file} (empty)")
    else:
        meta = _INPUT_META.set_axis(pd.Index([], dtype=object), axis=0)
        rows = lines.map_partitions(dry_run_rows, meta=meta)
        report = dry_run_source(
            rows,
            BatchRequests(options, cache),
            resources=resources,
            progress=progress,
            sample_rows=DEFAULT_SAMPLE_ROWS if sample_rows is None else sample_rows,
            calibration_seconds=calibration_seconds or DEFAULT_CALIBRATION_SECONDS,
            what=f"run-batch of {input_file} ({lines.npartitions:,} partition(s))",
        )
    if output_file is not None:
        fs, where = fsspec.core.url_to_fs(output_file, **(storage_options or {}))
        staging = output_file.rstrip("/") + STAGING_SUFFIX
        sfs, swhere = fsspec.core.url_to_fs(staging, **(storage_options or {}))
        report.output = output_file + (
            " (exists: the run replaces it)" if fs.exists(where) else " (does not exist yet)"
        )
        if sfs.exists(swhere):
            report.output += f"; {staging} holds an earlier run's parts (--resume keeps those still complete)"
    report.seconds = time.perf_counter() - start
    return report


def check_options(
    model: str | None, engine_kwargs: dict, response_role: str = "assistant", served_model_name: str | None = None
) -> BatchOptions:
    """The job's :class:`~dfllm.jobs.batch.BatchOptions`, checked before any work: engine
    argument names and vLLM values, a model that can be checked here, the role."""
    from dfllm.engine_args import ENGINE_ARG_NAMES, check_engine_args

    known = set(ENGINE_ARG_NAMES)
    unknown = sorted(set(engine_kwargs) - known)
    if unknown:
        raise ValueError(f"unknown engine argument(s) {unknown}: they go to dfllm.LLM, which takes {sorted(known)}")
    check_engine_args(**engine_kwargs)
    if not isinstance(response_role, str) or not response_role:
        raise ValueError(f"response_role must be a non-empty string, got {response_role!r}")
    if model is not None:
        from pathlib import Path

        from dfllm.models.bundled import BUNDLED_MODELS, resolve_model
        from dfllm.models.loader import check_model_dir

        if model.strip().lower() in BUNDLED_MODELS or Path(model).expanduser().is_dir():
            check_model_dir(resolve_model(model))  # else a folder only the workers have: loading there tells
    return BatchOptions(model, tuple(sorted(engine_kwargs.items())), response_role, served_model_name)


def check_paths(
    input_file: str, output_file: str, error_file: str | None = None, storage_options: dict | None = None
) -> None:
    """``ValueError`` unless the input is a file and the output, the error file and the
    staging folder (``<output>.parts``) are paths of their own, none of the files inside the
    staging folder, and the staging folder holds nothing but what batch jobs write there
    (:func:`check_staging`): it is the job's own, and the job removes its files at the end."""
    fs, where = check_input(input_file, storage_options)
    staging = output_file.rstrip("/") + STAGING_SUFFIX
    seen = {("input file", writer.normal_path(fs, where))}
    for what, path in (("output file", output_file), ("error file", error_file), ("staging folder", staging)):
        if path is None:
            continue
        pfs, p = fsspec.core.url_to_fs(path, **(storage_options or {}))
        p = writer.normal_path(pfs, p)
        clash = next((other for other, q in seen if q == p), None)
        if clash is not None:
            raise ValueError(f"the {what} {path} is the {clash}: give each its own path")
        if what != "staging folder" and pfs.isdir(p):
            raise ValueError(f"the {what} {path} is a folder; give a file path")
        seen.add((what, p))
    s = next(p for what, p in seen if what == "staging folder")
    for what, p in seen:
        if p.startswith(s + "/"):
            raise ValueError(
                f"the {what} {p} is inside the staging folder {staging}, which the job owns (it writes its "
                f"parts there and removes them when done): put the {what} elsewhere"
            )
    check_staging(staging, storage_options)


def _staging_files(fs, root: str) -> tuple[list[str], list[str]]:
    """The files under a staging folder (relative to it): those batch jobs write there (their
    parts, key records, set-aside parts, schema and temporary files) and the others."""

    def batch_parquet(name: str) -> bool:  # written by dfllm (its record in the footer), with a batch part's columns
        try:
            with fs.open(f"{root}/{name}", "rb") as f:
                meta = pq.read_metadata(f)
            names = set(meta.schema.to_arrow_schema().names)
        except (FileNotFoundError, ValueError, OSError, pa.ArrowException):
            return False
        return writer.FOOTER_KEY in (meta.metadata or {}) and set(PART_COLUMNS) <= names

    ours: list[str] = []
    foreign: list[str] = []
    for name in sorted(f[len(root) + 1 :] for f in fs.find(root) if f.startswith(root + "/")):
        folder, _, base = name.rpartition("/")
        mine = (
            (folder == "" and (writer.PART.fullmatch(base) or base == writer.COMMON_METADATA) and batch_parquet(name))
            or (folder == "_dfllm_keys" and writer.KEY_FILE.fullmatch(base))
            or (folder == "_dfllm_keys/set-aside" and writer.SET_ASIDE_FILE.fullmatch(base) and batch_parquet(name))
            or (folder in ("", "_dfllm_keys") and writer.TEMPORARY.fullmatch(base))
            or (folder == "" and _COMMON_METADATA_TEMPORARY.fullmatch(base))
        )
        (ours if mine else foreign).append(name)
    return ours, foreign


_COMMON_METADATA_TEMPORARY = re.compile(r"\.tmp-[0-9a-f]{32}-_common_metadata")  # dfllm.write_parquet's


def check_staging(staging: str, storage_options: dict | None = None) -> None:
    """``ValueError`` if the staging folder ``<output>.parts`` exists and holds anything a
    batch job did not write there (the job removes its files from it when done, so the
    folder must be the job's own); a folder of an earlier, killed run of a job is fine
    (``resume=True`` keeps its parts, a run without it replaces them)."""
    fs, root = writer.folder_filesystem(staging, storage_options)
    if not fs.exists(root):
        return
    if not fs.isdir(root):
        raise ValueError(f"the staging folder {staging} is a file: the job needs that path for its parts")
    foreign = _staging_files(fs, root)[1]
    if foreign:
        names = ", ".join(foreign[:3]) + (" ..." if len(foreign) > 3 else "")
        raise ValueError(
            f"the staging folder {staging} holds {len(foreign)} file(s) that no batch job wrote ({names}); "
            "the job owns that folder (it writes its parts there and removes them when done): move "
            "those files, or write the output elsewhere"
        )


def check_input(input_file: str, storage_options: dict | None = None) -> tuple:
    """``(filesystem, path)`` of the input; ``ValueError`` unless it is a file."""
    fs, where = fsspec.core.url_to_fs(input_file, **(storage_options or {}))
    if not fs.isfile(where):
        raise ValueError(f"the input file {input_file} does not exist (or is not a file)")
    return fs, where


def _remove_staging(staging: str, storage_options: dict | None, partitions: int) -> None:
    """Remove the files this job wrote in its staging folder (its ``partitions`` parts and
    key records, the schema file, temporary files of dfllm's names), each by its literal
    name, then the folder if nothing else is left in it: a file someone put there meanwhile
    stays, and so does the folder holding it."""
    fs, root = writer.folder_filesystem(staging, storage_options)
    if not fs.exists(root):
        return
    recorded = [path(root, i) for path in (writer.part_path, writer.key_path) for i in range(partitions)]
    recorded.append(f"{root}/{writer.COMMON_METADATA}")
    listed = _staging_files(fs, root)[0]
    recorded += [f"{root}/{f}" for f in listed if ".tmp-" in f]  # a killed run's temporary files
    writer.remove_files(fs, recorded)
    for folder in (f"{root}/{writer.SET_ASIDE}", f"{root}/{writer.KEYS}", root):
        try:
            fs.rmdir(folder)  # only if empty (a no-op on object stores, which have no folders)
        except (FileNotFoundError, OSError):
            pass
