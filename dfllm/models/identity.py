"""A model's identity by what its folder holds, for keys that must change when the model does.

:func:`model_identity` hashes a model directory's files: the text files that decide how the
model reads and writes (``config.json``, the tokenizer's files, the chat template,
``generation_config.json``...) by their content, each ``.safetensors`` file by its name,
size, modification time and header (the tensors' names, dtypes, shapes and offsets), and
any other file by name, size and modification time. Weights copied over the same folder
therefore change it, and so does an edited config or template, without reading gigabytes
of weights. The result is cached per process for as long as no file's size or time changes.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

#: Files read whole: small, and they decide outputs.
_TEXT_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".py")
_TEXT_LIMIT = 64 << 20
_cache: dict[tuple, str] = {}


def model_identity(model: str | os.PathLike[str] | None) -> str:
    """A hex digest of what the model's folder holds (see the module docstring); for a
    name that is no model here, the name itself (the task then fails with its own error)."""
    from dfllm.models.bundled import resolve_model

    try:
        root = resolve_model(model)
        stats = tuple(
            sorted(
                (str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                for p in root.rglob("*")
                if p.is_file() and not _hidden(p, root)
            )
        )
    except (ValueError, OSError) as exc:
        return f"unresolved:{model!r}:{type(exc).__name__}"
    cached = _cache.get((str(root), stats))
    if cached is not None:
        return cached
    h = hashlib.sha256()
    for name, size, mtime in stats:
        path = root / name
        h.update(f"{name}\0{size}\0".encode())
        if name.endswith(".safetensors"):
            h.update(f"{mtime}\0".encode() + _safetensors_header(path))
        elif name.endswith(_TEXT_SUFFIXES) and size <= _TEXT_LIMIT:
            h.update(path.read_bytes())
        else:
            h.update(f"{mtime}".encode())
    digest = h.hexdigest()
    _cache[(str(root), stats)] = digest
    return digest


def _safetensors_header(path: Path) -> bytes:
    """The header of a safetensors file (its first 8 bytes give the header's length)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return head
        (length,) = struct.unpack("<Q", head)
        return f.read(min(length, _TEXT_LIMIT))


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)
