"""A response cache across jobs: the outputs of deterministic generations, kept on local disk
or object storage, so that a row asked again is answered without the engine.

Opt in with ``cache=`` on ``.llm.generate``/``.llm.chat`` (pandas, Dask, Polars), on the
processor config (``ProcessorConfig(cache=...)``) or ``--cache URL`` on ``dfllm run``: a
path or fsspec URL, or a :class:`ResponseCache` (URL, ``storage_options``, ``max_bytes``).

**What is cached.** A request is looked up only when its output is deterministic: greedy
(``temperature=0``) or seeded (``seed`` set); anything else, any request for several
completions (``n > 1``: an entry holds one) and any request whose params have no stable key
(a logits processor, a callable) bypasses the cache. Its key is the SHA-256 of the
canonical JSON (:func:`dfllm.tasks.write_key.canonical`) of

- the engine's identity: the loaded model's content identity
  (:func:`dfllm.models.identity.model_identity`: config, tokenizer and chat template by
  content, weights by size, time and header), the task's engine arguments, the resolved
  dtype, KV-cache dtype, quantization and device type, and dfllm's version;
- the exact prompt token ids (after the template and the chat template);
- with a reasoning parser, how it splits the request's text (its ``key``: Qwen3's depends
  on ``enable_thinking``; a ``dfllm run-batch`` completions line's text is not split);
- every field of the request's :class:`~dfllm.sampling_params.SamplingParams` (max tokens,
  stops, penalties, structured output constraint, logprobs...).

An entry holds everything a row's output columns need: every field of the completion (the
text, token ids, finish and stop reasons, the structured-output flag, the cumulative
logprob...), ``logprobs`` and ``prompt_logprobs`` as the request asked. A failed generation (``finish_reason="error"``)
is not stored.

**Storage.** One JSON file per entry, ``<root>/<k[:2]>/<k[2:4]>/<k>.json`` where ``k`` is
the key's SHA-256 (content-addressed: two writers of one key write the same answer). On
local disk an entry is written to a hidden temporary name in its folder and renamed into
place (atomic); on object storage a PUT is atomic already. Each entry carries its full key
text and the SHA-256 of its payload, both verified when read: a corrupt, truncated or
mismatched entry is a miss (and is deleted), never a wrong answer. Storage errors are
logged and counted as misses (or skipped stores); the job goes on.

**Size.** ``max_bytes`` (default 1 GiB) bounds the folder, best effort: a process that
writes estimates the folder's size from one fan-out folder (entries spread evenly over
256) after its first store and after each ``max_bytes / 16`` it writes; past the bound it
lists the cache and deletes the least recently used entries (by modification time, which a
hit on local disk refreshes; on object storage the time written) until the cache is at 90%
of the bound. Only files named as entries (and stale temporary files) under the root are
ever deleted. An entry larger than ``max_bytes`` is not stored.

**Counts.** :func:`counts` gives this process's lookups (``hits``, ``misses``,
``bypassed``), ``stored``, ``corrupt`` and ``evicted``; ``client.run(counts)`` reads them
on every Dask worker. The same go to the process's Prometheus registry (a Dask worker's
``/metrics``): ``dfllm_response_cache_lookups_total{result="hit"|"miss"|"bypass"}``,
``dfllm_response_cache_stored_entries_total``, ``dfllm_response_cache_corrupt_entries_total``
and ``dfllm_response_cache_evicted_entries_total``.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from dfllm.outputs import CompletionOutput, Logprob, RequestOutput
from dfllm.tasks.write_key import canonical

if TYPE_CHECKING:
    from dfllm.config import EngineConfig
    from dfllm.engine.input_processor import EngineRequest

logger = logging.getLogger("dfllm")

DEFAULT_MAX_BYTES = 1 << 30
FORMAT = "dfllm-response-cache/1"
_ENTRY = re.compile(r"[0-9a-f]{64}\.json")
_TMP_PREFIX = ".tmp-"
_STALE_TMP_SECONDS = 3600.0
_EVICT_TO = 0.9  # eviction brings the cache down to this share of max_bytes


@dataclasses.dataclass(frozen=True)
class ResponseCache:
    """Where a response cache lives: ``url``, a local path or any fsspec URL (``s3://...``,
    ``gs://...``); ``storage_options`` for fsspec (credentials, endpoint); ``max_bytes``, the
    bound on the cache's size (see the module docstring). Picklable; the store itself is
    opened once per process."""

    url: str
    storage_options: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)
    max_bytes: int = DEFAULT_MAX_BYTES

    def __hash__(self) -> int:
        return hash((self.url, self.max_bytes))

    def lookup(self, keys: Sequence[str]) -> list[dict | None]:
        """The payload stored under each key text (None: a miss, a corrupt entry included)."""
        return _store(self).lookup(keys)

    def store(self, entries: Mapping[str, dict]) -> None:
        """Store each key text's payload (best effort; then evict if the cache is past its bound)."""
        _store(self).store(entries)

    def evict(self) -> int:
        """List the cache and delete the least recently used entries past the bound now;
        returns how many were deleted."""
        return _store(self).evict()

    def size(self) -> int:
        """The bytes the cache's entries take (a full listing)."""
        return sum(size for _, size, _ in _store(self).entries())

    def path_of(self, key: str) -> str:
        """The file (in the store's filesystem) of the entry for key text ``key``."""
        return _store(self).path_of(entry_name(key))


def as_cache(value, what: str = "cache") -> ResponseCache | None:
    """``cache=`` as a :class:`ResponseCache` (None or False: no cache); ``ValueError``
    naming ``what`` for anything else, or a URL no filesystem opens.

    Takes a path or URL (``str``/``os.PathLike``), a :class:`ResponseCache`, or a dict of its
    fields (``{"url": ..., "storage_options": ..., "max_bytes": ...}``)."""
    if value is None or value is False:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        value = ResponseCache(value)
    elif isinstance(value, Mapping):
        fields = {f.name for f in dataclasses.fields(ResponseCache)}
        unknown = sorted(set(value) - fields)
        if unknown or "url" not in value:
            raise ValueError(
                f"{what}: a dict takes 'url' and optionally 'storage_options' and 'max_bytes', got keys {sorted(value)}"
            )
        value = ResponseCache(**value)
    if not isinstance(value, ResponseCache):
        raise ValueError(
            f"{what} must be a path or URL, a dfllm.ResponseCache or a dict of its fields, got {type(value).__name__}"
        )
    if isinstance(value.url, os.PathLike):
        value = dataclasses.replace(value, url=os.fspath(value.url))
    if not isinstance(value.url, str) or not value.url.strip():
        raise ValueError(f"{what}: url must be a non-empty path or URL, got {value.url!r}")
    mb = value.max_bytes
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        raise ValueError(f"{what}: max_bytes must be a positive integer, got {mb!r}")
    if value.storage_options is not None and not isinstance(value.storage_options, Mapping):
        raise ValueError(f"{what}: storage_options must be a dict or None, got {type(value.storage_options).__name__}")
    try:
        import fsspec

        fsspec.core.url_to_fs(value.url, **dict(value.storage_options or {}))
    except Exception as exc:  # noqa: BLE001 (unknown protocol, a missing package, bad options...)
        raise ValueError(f"{what}: cannot open {value.url!r}: {type(exc).__name__}: {exc}") from None
    return value


# ---- keys and payloads ------------------------------------------------------------------------------------
def engine_identity(config: EngineConfig, engine_kwargs: tuple) -> str | None:
    """What besides a request decides its output on this engine, as a digest; None when the
    engine arguments have no stable key (then every request bypasses the cache)."""
    from importlib.metadata import version

    from dfllm.models.identity import model_identity

    try:
        text = canonical(
            {
                "model": model_identity(config.model_path),
                "engine_kwargs": list(engine_kwargs),
                "dtype": str(config.dtype),
                "kv_cache_dtype": str(config.kv_dtype),
                "quantization": config.quantization,
                "device": config.device.type,
                "dfllm": version("dfllm"),
            }
        )
    except TypeError:
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def request_key(engine: str, request: EngineRequest) -> str | None:
    """The key text of ``request`` on the engine of identity ``engine``, or None when the
    request bypasses the cache (its output is not deterministic, it asks for several
    completions, or its params have no stable key)."""
    params = request.params
    if not (params.is_greedy or params.seed is not None) or params.n != 1:  # an entry holds one completion
        return None
    fields = {"format": FORMAT, "engine": engine, "prompt_token_ids": list(request.prompt_token_ids), "params": params}
    if request.reasoning is not None:  # how its text is split into reasoning and answer
        fields["reasoning"] = list(request.reasoning.key)
    mm = getattr(request, "mm_inputs", None)
    if mm is not None:  # its images' content (their placeholder tokens are the same for every image)
        fields["images"] = list(mm.keys)
    lora = getattr(request, "lora_request", None)
    if lora is not None:  # its LoRA adapter: what the files it runs from hold (the engine checks them)
        if getattr(lora, "identity", None) is None:  # an adapter known by its id only: no stable key
            return None
        fields["lora"] = lora.identity
    try:
        return canonical(fields)
    except TypeError:  # a logits processor or another callable
        return None


def entry_name(key: str) -> str:
    """The file name of key text ``key``'s entry."""
    return hashlib.sha256(key.encode()).hexdigest() + ".json"


#: CompletionOutput fields an entry does not keep as they are: the index (always 0), the
#: error (failed outputs are not stored), the logprobs (kept as JSON lists, below).
_NOT_STORED = ("index", "error", "logprobs")
#: The types of the CompletionOutput fields an entry must have right (others: JSON values).
_TYPES: dict[str, tuple[type, ...]] = {
    "text": (str,),
    "finish_reason": (str,),
    "token_ids": (list,),
    "cumulative_logprob": (int, float, type(None)),
    "stop_reason": (int, str, type(None)),
    "structured_output_complete": (bool, type(None)),
}


def payload_of(output: RequestOutput) -> dict:
    """What an entry holds of a finished request's output: every field of its completion
    (text, token ids, finish and stop reasons, and any field ``CompletionOutput`` has, so
    that a cached row fills every column a generated one does), its logprobs and its prompt
    logprobs."""
    c = output.outputs[0]
    fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name not in _NOT_STORED}
    fields["token_ids"] = [int(t) for t in c.token_ids]
    return {"completion": fields, "logprobs": _steps(c.logprobs), "prompt_logprobs": _steps(output.prompt_logprobs)}


def output_of(payload: dict, request: EngineRequest, request_id: str, vocab_size: int | None = None) -> RequestOutput:
    """The ``RequestOutput`` of a cached payload for ``request`` (every prompt token counted
    as cached); ``ValueError`` for a payload that is not one: fields of the wrong type, a
    failed output (``finish_reason="error"``: never stored), token ids outside
    ``[0, vocab_size)``."""
    fields = payload.get("completion")
    if not isinstance(fields, dict):
        raise ValueError("no completion")
    known = {f.name for f in dataclasses.fields(CompletionOutput)} - set(_NOT_STORED)
    for name, types in _TYPES.items():
        if not isinstance(fields.get(name), types) or isinstance(fields.get(name), bool) and bool not in types:
            raise ValueError(f"{name}: {fields.get(name)!r} is not a {' or '.join(t.__name__ for t in types)}")
    if fields["finish_reason"] == "error":
        raise ValueError("a failed output (finish_reason 'error'), which is never stored")
    if not all(_is_token(t, vocab_size) for t in fields["token_ids"]):
        raise ValueError(f"token_ids must be a list of token ids (ints in [0, {vocab_size or 2**63}))")
    completion = CompletionOutput(
        index=0,
        logprobs=_unsteps(payload.get("logprobs"), vocab_size),
        **{k: v for k, v in fields.items() if k in known},
    )
    return RequestOutput(
        request_id,
        request.prompt,
        list(request.prompt_token_ids),
        [completion],
        True,
        num_cached_tokens=len(request.prompt_token_ids),
        prompt_logprobs=_unsteps(payload.get("prompt_logprobs"), vocab_size),
    )


def _is_token(t, vocab_size: int | None) -> bool:
    """Whether ``t`` (a JSON value) is a token id of a vocabulary of ``vocab_size`` (None:
    any that fits an int64, as the engine's tensors hold them)."""
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < (vocab_size or 2**63)


def _steps(logprobs) -> list | None:
    """Per-token logprob dicts as JSON: per step null or ``[[token id, logprob, rank, text], ...]``."""
    if logprobs is None:
        return None
    return [
        None if step is None else [[int(t), float(lp.logprob), lp.rank, lp.decoded_token] for t, lp in step.items()]
        for step in logprobs
    ]


def _unsteps(steps, vocab_size: int | None = None) -> list | None:
    if steps is None:
        return None
    if not isinstance(steps, list):
        raise ValueError("logprobs must be a list or null")
    out: list = []
    for step in steps:
        if step is None:
            out.append(None)
            continue
        d = {}
        for t, lp, rank, text in step:
            if not _is_token(t, vocab_size) or isinstance(lp, bool) or not isinstance(lp, (int, float)):
                raise ValueError("a logprob entry must be [token id, logprob, rank, text]")
            d[t] = Logprob(float(lp), rank, text)
        out.append(d)
    return out


def encode_entry(key: str, payload: dict) -> bytes:
    """An entry's file contents: its format, full key text, payload text and the payload's SHA-256."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return json.dumps(
        {"format": FORMAT, "key": key, "sha256": hashlib.sha256(text.encode()).hexdigest(), "payload": text},
        separators=(",", ":"),
    ).encode()


def decode_entry(raw: bytes, key: str) -> dict:
    """The payload of an entry read for key text ``key``; ``ValueError`` if the entry is
    corrupt, truncated, of another format, or stored under another key."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from None
    except RecursionError:  # "[[[[...": edited or corrupt, not dfllm's
        raise ValueError("not JSON (nested too deeply)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError("not a dfllm response cache entry")
    if doc.get("key") != key:
        raise ValueError("stored under another key")
    text = doc.get("payload")
    if not isinstance(text, str) or hashlib.sha256(text.encode()).hexdigest() != doc.get("sha256"):
        raise ValueError("payload checksum mismatch")
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"payload is not JSON ({exc})") from None
    except RecursionError:
        raise ValueError("payload is not JSON (nested too deeply)") from None
    if not isinstance(payload, dict):
        raise ValueError("payload is not an object")
    return payload


# ---- generating through the cache ---------------------------------------------------------------------------
def generate_cached(
    cache: ResponseCache | None,
    config: EngineConfig | None,
    engine_kwargs: tuple,
    requests: list[EngineRequest],
    generate: Callable[[list[EngineRequest]], list[RequestOutput]],
) -> tuple[list[RequestOutput], list[bool]]:
    """The outputs of ``requests`` in order, and for each whether it came from ``cache``:
    deterministic requests found in the cache are answered from it, the rest go to
    ``generate`` (one call), and their deterministic outputs are stored. Without a cache (or
    an engine config), ``generate(requests)`` as it is."""
    if cache is None or config is None or not requests:
        return generate(requests), [False] * len(requests)
    engine = engine_identity(config, engine_kwargs)
    vocab_size = getattr(getattr(config, "model", None), "vocab_size", None) or None
    keys = [None if engine is None else request_key(engine, r) for r in requests]
    wanted = [k for k in keys if k is not None]
    found = dict(zip(wanted, cache.lookup(wanted))) if wanted else {}
    outputs: list[RequestOutput | None] = [None] * len(requests)
    for j, (req, key) in enumerate(zip(requests, keys)):
        payload = found.get(key) if key is not None else None
        if key is None or payload is None:
            continue
        try:
            outputs[j] = output_of(payload, req, f"cache-{j}", vocab_size)
        except (ValueError, TypeError, KeyError, RecursionError) as exc:  # well-formed entry, bad payload: a miss
            _count(corrupt=1)
            _store(cache).discard(key, exc)
    hits = [o is not None for o in outputs]
    bypassed = sum(k is None for k in keys)
    _count(hits=sum(hits), misses=len(requests) - sum(hits) - bypassed, bypassed=bypassed)
    todo = [j for j, o in enumerate(outputs) if o is None]
    if todo:
        for j, generated in zip(todo, generate([requests[j] for j in todo])):
            outputs[j] = generated
        new: dict[str, dict] = {}
        for j in todo:
            key, done = keys[j], outputs[j]
            if key is not None and done is not None and done.finished and done.outputs[0].finish_reason != "error":
                new[key] = payload_of(done)
        if new:
            cache.store(new)
    return [o for o in outputs if o is not None], hits


# ---- the store -----------------------------------------------------------------------------------------------
class _Store:
    """A cache's folder as this process sees it: its filesystem, and what it wrote since it
    last estimated the folder's size."""

    def __init__(self, cache: ResponseCache):
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        self.cache = cache
        self.fs, root = fsspec.core.url_to_fs(cache.url, **dict(cache.storage_options or {}))
        self.root = root.rstrip("/") or root
        self.local = isinstance(self.fs, LocalFileSystem)
        self.lock = threading.Lock()
        self.checked = False  # whether this process estimated the folder's size yet
        self.written = 0  # bytes written since the last estimate
        self.warned: set[str] = set()

    def path_of(self, name: str) -> str:
        return f"{self.root}/{name[:2]}/{name[2:4]}/{name}"

    def _warn(self, what: str, exc: BaseException) -> None:
        if what not in self.warned:  # once per kind of failure per process
            self.warned.add(what)
            logger.warning(
                "response cache %s: %s failed (%s: %s); the job goes on without it",
                self.cache.url,
                what,
                type(exc).__name__,
                exc,
            )

    def lookup(self, keys: Sequence[str]) -> list[dict | None]:
        paths = [self.path_of(entry_name(k)) for k in keys]
        try:
            raw = self.fs.cat(sorted(set(paths)), on_error="return") if paths else {}
        except Exception as exc:  # noqa: BLE001 (the store is unreachable: every lookup misses)
            self._warn("reading", exc)
            return [None] * len(keys)
        out: list[dict | None] = []
        hit_paths = []
        for key, path in zip(keys, paths):
            data = raw.get(path) if isinstance(raw, dict) else None
            if not isinstance(data, bytes):
                if isinstance(data, BaseException) and not isinstance(data, FileNotFoundError):
                    self._warn("reading", data)
                out.append(None)
                continue
            try:
                out.append(decode_entry(data, key))
                hit_paths.append(path)
            except (ValueError, RecursionError) as exc:
                _count(corrupt=1)
                self.discard(key, exc)
                out.append(None)
        if self.local:  # a hit is a use: eviction goes by modification time
            now = time.time()
            for path in set(hit_paths):
                try:
                    os.utime(path, (now, now))
                except OSError:
                    pass
        return out

    def discard(self, key: str, why: BaseException) -> None:
        """Delete the entry of ``key``, found corrupt (best effort)."""
        path = self.path_of(entry_name(key))
        logger.warning(
            "response cache %s: entry %s is unusable (%s); treated as a miss and deleted", self.cache.url, path, why
        )
        try:
            self.fs.rm_file(path)
        except Exception:  # noqa: BLE001 (already gone, or read-only: a miss all the same)
            pass

    def store(self, entries: Mapping[str, dict]) -> None:
        files: dict[str, bytes] = {}
        for key, payload in entries.items():
            try:
                data = encode_entry(key, payload)
            except (TypeError, ValueError):  # a value JSON cannot hold: not cacheable
                continue
            if len(data) <= self.cache.max_bytes:  # an entry past the whole bound is not kept
                files[self.path_of(entry_name(key))] = data
        if not files:
            return
        if self.local:
            done = []
            for path, data in files.items():
                try:
                    self._write(path, data)
                    done.append(path)
                except OSError as exc:  # a full disk, no permission...: not stored
                    self._warn("writing", exc)
        else:
            try:
                self.fs.pipe(files)  # one call: an async store (s3, gcs...) sends the PUTs at once
                done = list(files)
            except Exception as exc:  # noqa: BLE001 (unreachable, no permission...: not stored)
                self._warn("writing", exc)
                done = []
        _count(stored=len(done))
        if not done:
            return
        written, last = sum(len(files[p]) for p in done), done[-1].rsplit("/", 1)[-1]
        with self.lock:
            self.written += written
            due = not self.checked or self.written >= self.cache.max_bytes // 16
            if due:
                self.checked, self.written = True, 0
        if due and self._estimate(last) > self.cache.max_bytes:
            self.evict()

    def _write(self, path: str, data: bytes) -> None:
        """Write one entry on local disk (an object store's PUT is atomic by itself)."""
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: a reader sees the old entry or the new one, never a part
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _estimate(self, name: str) -> int:
        """The cache's size estimated from the fan-out folder of entry ``name`` (one of 256,
        which SHA-256 names fill evenly): biased up for a small cache, whose full listing is
        cheap."""
        folder = f"{self.root}/{name[:2]}"
        try:
            self.fs.invalidate_cache(folder)
            found = self.fs.find(folder, detail=True)
        except Exception as exc:  # noqa: BLE001
            self._warn("listing", exc)
            return 0
        return 256 * sum(int(info.get("size") or 0) for path, info in found.items() if _is_entry(path, folder, 1))

    def entries(self) -> list[tuple[str, int, float]]:
        """Every entry of the cache as (path, size, last use), and stale temporary files as size -1."""
        self.fs.invalidate_cache(self.root)
        try:
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return []
        out = []
        now = time.time()
        for path, info in found.items():
            when = _mtime(info)
            if _is_entry(path, self.root, 2):
                out.append((path, int(info.get("size") or 0), when))
            elif self.local and _is_tmp(path, self.root) and now - when > _STALE_TMP_SECONDS:
                out.append((path, -1, when))
        return out

    def evict(self) -> int:
        try:
            entries = self.entries()
        except Exception as exc:  # noqa: BLE001
            self._warn("listing", exc)
            return 0
        doomed = [p for p, size, _ in entries if size < 0]
        live = sorted((e for e in entries if e[1] >= 0), key=lambda e: e[2])
        total = sum(size for _, size, _ in live)
        if total > self.cache.max_bytes:
            target = int(self.cache.max_bytes * _EVICT_TO)
            for path, size, _ in live:
                if total <= target:
                    break
                doomed.append(path)
                total -= size
        if not doomed:
            return 0
        if self.local:
            gone = []
            for path in doomed:
                try:
                    os.unlink(path)
                    gone.append(path)
                except FileNotFoundError:  # another process evicted it first
                    pass
                except OSError as exc:
                    self._warn("evicting", exc)
            doomed = gone
        else:
            try:
                if any(c in p for p in doomed for c in "*?["):
                    # fs.rm expands patterns: "c[1]/..." would delete the cache "c1"'s entries
                    for path in doomed:
                        try:
                            self.fs.rm_file(path)
                        except FileNotFoundError:  # another process evicted it first
                            pass
                else:
                    self.fs.rm(doomed)  # one bulk request where the store has one
            except FileNotFoundError:  # another process evicted some of them first
                pass
            except Exception as exc:  # noqa: BLE001
                self._warn("evicting", exc)
                return 0
        evicted = sum(1 for p in doomed if _is_entry(p, self.root, 2))
        _count(evicted=evicted)
        return evicted


def _is_entry(path: str, root: str, depth: int) -> bool:
    """Whether ``path`` is an entry's file ``depth`` fan-out folders below ``root``, in the
    folders its name says (so nothing else there is ever deleted)."""
    path = path.rstrip("/")
    prefix = root.rstrip("/") + "/"
    if not path.startswith(prefix):
        return False
    parts = path[len(prefix) :].split("/")
    if depth == 1:  # root is <cache>/<k[:2]>
        parts = [os.path.basename(root.rstrip("/")), *parts]
    if len(parts) != 3 or not _ENTRY.fullmatch(parts[2]):
        return False
    return parts[0] == parts[2][:2] and parts[1] == parts[2][2:4]


def _is_tmp(path: str, root: str) -> bool:
    prefix = root.rstrip("/") + "/"
    if not path.startswith(prefix):
        return False
    parts = path[len(prefix) :].split("/")
    return (
        len(parts) == 3 and parts[2].startswith(_TMP_PREFIX) and all(re.fullmatch(r"[0-9a-f]{2}", p) for p in parts[:2])
    )


def _mtime(info: dict) -> float:
    """A listing entry's modification time as seconds since the epoch (0 if unknown)."""
    for name in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(name)
        if value is None:
            continue
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
    return 0.0


_stores: dict[tuple, _Store] = {}
_stores_lock = threading.Lock()


def _store(cache: ResponseCache) -> _Store:
    """This process's store of ``cache`` (one per URL, options and bound)."""
    try:
        options = canonical(dict(cache.storage_options or {}))
    except TypeError:
        options = repr(cache.storage_options)
    key = (cache.url, options, cache.max_bytes)
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = _Store(cache)
        return store


# ---- counts and metrics --------------------------------------------------------------------------------------
_COUNTS = ("hits", "misses", "bypassed", "stored", "corrupt", "evicted")
_counts: collections.Counter[str] = collections.Counter()
_counts_lock = threading.Lock()
_metrics: dict[str, Any] = {}


def counts() -> dict[str, int]:
    """This process's response cache counts since it started: lookups answered (``hits``),
    not found (``misses``) and not made (``bypassed``: not deterministic, or no stable key),
    entries ``stored``, found ``corrupt`` (each also a miss) and ``evicted``."""
    with _counts_lock:
        return {name: _counts[name] for name in _COUNTS}


def _count(**by: int) -> None:
    by = {k: v for k, v in by.items() if v}
    if not by:
        return
    with _counts_lock:
        _counts.update(by)
        metrics = _prometheus()
    for name, n in by.items():
        metrics[name].inc(n)


def _prometheus() -> dict[str, Any]:
    """The cache's counters on the process's default Prometheus registry (a Dask worker's
    ``/metrics``), registered on first use. Call holding ``_counts_lock``."""
    if _metrics:
        return _metrics
    import prometheus_client

    def counter(name: str, doc: str, labels: tuple[str, ...] = ()):
        try:
            return prometheus_client.Counter(name, doc, labels)
        except ValueError:  # already registered (this module imported twice): reuse it
            return prometheus_client.REGISTRY._names_to_collectors[name]

    lookups = counter(
        "dfllm_response_cache_lookups",
        "Deterministic requests looked up in the response cache, and requests that bypassed it",
        ("result",),
    )
    _metrics.update(
        hits=lookups.labels(result="hit"),
        misses=lookups.labels(result="miss"),
        bypassed=lookups.labels(result="bypass"),
        stored=counter("dfllm_response_cache_stored_entries", "Entries written to the response cache"),
        corrupt=counter(
            "dfllm_response_cache_corrupt_entries",
            "Response cache entries found corrupt or mismatched (each a miss, deleted)",
        ),
        evicted=counter(
            "dfllm_response_cache_evicted_entries", "Response cache entries deleted to keep the cache within max_bytes"
        ),
    )
    return _metrics
