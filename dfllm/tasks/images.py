"""A task's image column (``images=`` on ``generate``, ``chat`` and ``embed``), read on the
worker that runs the partition.

A cell holds one image or a list of them. An image is PNG/JPEG/... bytes (an Arrow ``binary``
or ``large_binary`` column, as parquet holds them), a path or URL string (local, ``file://``,
``data:``, fsspec URLs such as ``s3://``; http(s) only where the worker can reach it), a PIL
image (pandas), or a Hugging Face ``datasets`` image struct (``{"bytes", "path"}``). Each is
decoded by :func:`dfllm.multimodal.load_image`; a cell whose image cannot be read, of a
type that is no image, or with more images than allowed gets the row's ``llm_error``
naming the column and the problem, and the other rows go on. A null cell is a row without
images (``generate``/``chat``; for ``embed`` it is the row's error). Equal values in one
partition are decoded once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pandas as pd

from dfllm.tasks.rows import row_error
from dfllm.tasks.templates import is_null

if TYPE_CHECKING:
    from PIL.Image import Image

    from dfllm.tasks.task import LLMTask


def image_limit(task: LLMTask) -> int | None:
    """The most images a row may have: 1 for ``embed``, else the engine's
    ``limit_mm_per_prompt["image"]`` when the task sets it (None: the engine decides)."""
    if task.kind == "embed":
        return 1
    limits = dict(task.engine_kwargs).get("limit_mm_per_prompt")
    if isinstance(limits, Mapping) and isinstance(limits.get("image"), int):
        return limits["image"]
    return None


def _cell_values(cell) -> list:
    """The images of one cell, not yet decoded ([] for a null cell)."""
    if cell is None or (not hasattr(cell, "__len__") and is_null(cell)):
        return []
    if isinstance(cell, (list, tuple)) or (hasattr(cell, "tolist") and getattr(cell, "ndim", 0) == 1):
        return list(cell.tolist() if hasattr(cell, "tolist") else cell)
    return [cell]


def _decode(value, seen: dict) -> Image:
    """One image value decoded (equal bytes or strings once per partition)."""
    from dfllm.multimodal import load_image

    key: Any = bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else value
    if isinstance(key, (bytes, str)):
        if key not in seen:
            try:
                seen[key] = load_image(key)
            except ValueError as exc:
                seen[key] = exc
        found = seen[key]
        if isinstance(found, Exception):
            raise found
        return found
    if isinstance(value, Mapping):  # a datasets image struct: {"bytes": ..., "path": ...}
        data = value.get("bytes")
        inner = data if data is not None else value.get("path")
        if inner is None or isinstance(inner, Mapping):  # load_image says why (a chain of dicts: not unwrapped)
            return load_image(dict(value))
        return _decode(inner, seen)
    return load_image(value)  # a PIL image as it is; anything else: ImageLoadError naming the type


def row_images(df: pd.DataFrame, task: LLMTask, out: dict, rows) -> dict[int, list[Image]]:
    """Row position -> its decoded images, for ``rows`` (positions) of the task's image
    column; a row without images maps to []. Bad rows get their error and are left out."""
    column = task.images
    assert column is not None
    values = df[column].tolist()
    limit = image_limit(task)
    seen: dict = {}
    images: dict[int, list] = {}
    for i in rows:
        try:
            cell = _cell_values(values[i])
            if task.kind == "embed" and not cell:
                raise ValueError("is null (embed needs one image per row)")
            if limit is not None and len(cell) > limit:
                raise ValueError(
                    f"has {len(cell)} images, more than this engine takes per prompt "
                    f"(limit_mm_per_prompt={{'image': {limit}}})"
                )
            decoded = []
            for k, value in enumerate(cell):
                if is_null(value):
                    raise ValueError(f"image {k} is null")
                try:
                    decoded.append(_decode(value, seen))
                except ValueError as exc:
                    raise ValueError(f"image {k}: {exc}" if len(cell) > 1 else str(exc)) from None
            images[i] = decoded
        except ValueError as exc:
            row_error(task, out, i, f"images column {column!r}: {exc}")
    return images


def with_image_parts(conversation: list[dict], images: list) -> list[dict]:
    """``conversation`` with ``images`` as ``image_pil`` parts at the start of its last user
    turn (a copy; the turn's text follows them)."""
    if not images:
        return conversation
    conv = [dict(m) for m in conversation]
    last = max((k for k, m in enumerate(conv) if m.get("role") == "user"), default=None)
    if last is None:
        raise ValueError("the conversation has no user turn to attach its images to")
    content = conv[last].get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    conv[last]["content"] = [{"type": "image_pil", "image_pil": im} for im in images] + parts
    return conv
