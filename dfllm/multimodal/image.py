"""Decoding images from what users hand over (bytes, URLs, paths, PIL images) and hashing them."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
from typing import Any
from urllib.parse import unquote, urlparse

from PIL import Image

from dfllm.errors import value_text

__all__ = ["load_image", "image_hash", "ImageLoadError"]

_HTTP_TIMEOUT_S = 10.0


class ImageLoadError(ValueError):
    """An image value that could not be read or decoded (the message names why)."""


def _decode_bytes(data: bytes, what: str) -> Image.Image:
    if not data:
        raise ImageLoadError(f"{what}: empty image bytes")
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ...
        raise ImageLoadError(f"{what}: cannot decode image ({type(e).__name__}: {e})") from e
    return img


def _from_data_url(url: str) -> Image.Image:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ImageLoadError("data: URL without a ',' separating its header from its data")
    if header.endswith(";base64"):
        try:
            data = base64.b64decode(payload, validate=False)
        except (binascii.Error, ValueError) as e:
            raise ImageLoadError(f"data: URL: invalid base64 ({e})") from e
    else:
        data = unquote(payload).encode("latin-1")
    return _decode_bytes(data, "data: URL")


def _from_http(url: str) -> Image.Image:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT_S) as resp:  # noqa: S310 (http(s) only)
            data = resp.read()
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise ImageLoadError(
            f"cannot fetch image {url!r}: this machine has no network fetch for it ({type(e).__name__}: {e}); "
            "pass the image bytes, a local path, a data: URL or an fsspec URL (s3://, gs://, ...) instead"
        ) from e
    return _decode_bytes(data, url)


def _from_fsspec(url: str) -> Image.Image:
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - fsspec is a runtime dependency
        raise ImageLoadError(f"cannot open {url!r}: fsspec is not installed") from e
    try:
        with fsspec.open(url, "rb") as f:
            data = f.read()
    except FileNotFoundError as e:
        raise ImageLoadError(f"image not found: {url!r}") from e
    except Exception as e:
        raise ImageLoadError(f"cannot open image {url!r} ({type(e).__name__}: {e})") from e
    return _decode_bytes(data, url)


def _from_path(path: str) -> Image.Image:
    if not os.path.exists(path):
        raise ImageLoadError(f"image not found: {path!r}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ImageLoadError(f"cannot read image {path!r} ({e})") from e
    return _decode_bytes(data, path)


def load_image(value: Any) -> Image.Image:
    """Decode ``value`` into a loaded ``PIL.Image.Image``.

    Accepts a PIL image (returned as is), PNG/JPEG/... bytes (``bytes``, ``bytearray``, ``memoryview``),
    a ``data:`` URL, a local path or ``file://`` URL, an fsspec URL (``s3://``, ``gs://``, ``memory://``, ...)
    or an ``http(s)://`` URL (fetched only where the machine can reach it; otherwise a clear error).
    A dict ``{"url": ...}`` (an OpenAI ``image_url`` body) or ``{"bytes": ..., "path": ...}`` (a Hugging Face
    ``datasets`` image cell) is unwrapped. Anything else raises ``ImageLoadError`` (a ``ValueError``) naming
    the type; an undecodable image raises ``ImageLoadError`` naming the source.
    """
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _decode_bytes(bytes(value), "image bytes")
    if isinstance(value, dict):
        if "url" in value:
            key = "url"
        elif value.get("bytes") is not None:
            key = "bytes"
        elif value.get("path") is not None:
            key = "path"
        else:
            keys = sorted(value_text(k) for k in value)  # keys of any type, as text
            raise ImageLoadError(f"an image dict needs a 'url', 'bytes' or 'path' key, got keys {keys}")
        if isinstance(value[key], dict):  # unwrapped once: a chain of dicts nested without end is no image
            raise ImageLoadError(f"an image dict's {key!r} holds a dict, not an image (bytes, a path or a URL)")
        return load_image(value[key])
    if isinstance(value, os.PathLike):
        return _from_path(os.fspath(value))
    if isinstance(value, str):
        s = value.strip()
        if not s:
            raise ImageLoadError("empty image string")
        if s.startswith("data:"):
            return _from_data_url(s)
        scheme = urlparse(s).scheme.lower()
        if scheme in ("http", "https"):
            return _from_http(s)
        if scheme == "file":
            return _from_path(unquote(urlparse(s).path))
        if len(scheme) > 1 and "://" in s:  # a one-letter scheme is a Windows drive letter
            return _from_fsspec(s)
        return _from_path(s)
    raise ImageLoadError(
        f"cannot read an image from a value of type {type(value).__name__}: expected a PIL image, PNG/JPEG bytes, "
        "a data: URL, a path or a URL"
    )


def image_hash(image: Image.Image) -> str:
    """A stable hex digest of a decoded image: its mode, size and pixel bytes (same across processes)."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"image_hash expects a PIL image, got {type(image).__name__}")
    h = hashlib.blake2b(digest_size=20)
    h.update(f"{image.mode}|{image.size[0]}x{image.size[1]}|".encode())
    h.update(image.tobytes())
    if image.mode == "P":
        pal = image.getpalette()
        if pal is not None:
            h.update(bytes(pal))
    return h.hexdigest()
