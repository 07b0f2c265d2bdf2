"""Adapters named by dataframe rows, resolved on the worker that runs them.

A row's adapter is a local directory (one that may exist only on the workers), an fsspec URL
(``s3://bucket/adapters/a1``, ``memory://...``, ``file://...``: the folder is fetched once
per worker process into a local cache directory, keyed by the URL, and reused), or a bare
name looked up under a root (``lora_root``; Ray Data LLM's ``dynamic_lora_loading_path``,
whose ``model`` column names adapters by their folder under it). Null is the base model.
Each distinct adapter gets a stable ``lora_int_id`` from its name
(:meth:`~dfllm.lora.request.LoRARequest.for_path`), the same on every worker.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from pathlib import Path

from dfllm.lora.request import LoRARequest

_FILES = ("adapter_config.json", "adapter_model.safetensors")
_lock = threading.Lock()
_fetched: dict[str, str] = {}  # URL -> local directory, in this process


def cache_dir() -> Path:
    """Where fetched adapters are kept: ``$DFLLM_LORA_CACHE``, else a ``dfllm-lora`` folder
    in the temporary directory."""
    return Path(os.environ.get("DFLLM_LORA_CACHE") or Path(tempfile.gettempdir()) / "dfllm-lora")


def is_url(spec: str) -> bool:
    return "://" in spec and not spec.startswith("file://")


def adapter_location(spec: str, root: str | None = None) -> str:
    """Where the adapter a row names lives: ``spec`` itself when it is a path or URL, else
    ``root/spec`` (a bare name under ``root``)."""
    bare = "/" not in spec and "://" not in spec and not spec.startswith(".")
    if root and bare:
        return root.rstrip("/") + "/" + spec
    return spec


def fetch(url: str) -> str:
    """The local directory holding the adapter at fsspec ``url`` (its two files), fetched
    the first time this process asks; ``ValueError`` naming the URL when it cannot be read."""
    with _lock:
        local = _fetched.get(url)
        if local is not None and Path(local, _FILES[0]).is_file():
            return local
        import fsspec

        target = cache_dir() / hashlib.sha256(url.encode()).hexdigest()[:32]
        try:
            fs, path = fsspec.core.url_to_fs(url)
            target.mkdir(parents=True, exist_ok=True)
            for name in _FILES:
                src = path.rstrip("/") + "/" + name
                if not fs.exists(src):
                    raise FileNotFoundError(f"{name} is missing")
                tmp = target / f".{name}.{os.getpid()}"
                fs.get(src, str(tmp))
                tmp.replace(target / name)
        except Exception as exc:  # noqa: BLE001  (the row's error names the URL and the cause)
            raise ValueError(f"LoRA adapter {url!r} could not be fetched: {exc}") from None
        _fetched[url] = str(target)
        return str(target)


def resolve(spec: str, root: str | None = None) -> LoRARequest:
    """The :class:`LoRARequest` of the adapter a row names (see the module docstring); its
    name is what the row gave, its path a local directory (``ValueError`` if a URL cannot be
    fetched; the engine then checks the folder)."""
    location = adapter_location(spec, root)
    local = fetch(location) if is_url(location) else location.removeprefix("file://")
    return LoRARequest.for_path(local, name=spec if location == spec else location)


_identities: dict[tuple, str] = {}


def adapter_identity(path: str) -> str:
    """A hex digest of an adapter folder's two files' bytes (the response cache's key: a
    re-fetched copy of the same adapter keeps it); for a folder that cannot be read, its path."""
    try:
        files = [Path(path, name) for name in _FILES]
        stats = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    except OSError:
        return f"unreadable:{path}"
    cached = _identities.get(stats)
    if cached is None:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        cached = _identities[stats] = h.hexdigest()
    return cached
