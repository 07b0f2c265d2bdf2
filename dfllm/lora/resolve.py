"""Adapters named by dataframe rows, resolved on the worker that runs them.

A row's adapter is a local directory (one that may exist only on the workers), an fsspec URL
(``s3://bucket/adapters/a1``, ``memory://...``, ``file://...``: the folder is fetched once
per worker process into a local cache directory, keyed by the URL, and reused), or a bare
name looked up under a root (``lora_root``; Ray Data LLM's ``dynamic_lora_loading_path``,
whose ``model`` column names adapters by their folder under it). Null is the base model.
Each distinct adapter (its name and what its files hold) gets a ``lora_int_id`` from a
hash of both (:meth:`~dfllm.lora.request.LoRARequest.for_path`): the same on every worker,
and never the id of another adapter in this process (a hash collision moves to the next
free id).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
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
    fetched; the engine then checks the folder), its ``identity`` what the folder's files
    hold now (:func:`adapter_identity`), and its id one for that name and identity
    (:meth:`~dfllm.lora.request.LoRARequest.for_path`): a folder whose files change between
    two jobs is another adapter, with another id, another prefix-cache chain and another
    response-cache key, and the engine refuses to run it from files that no longer hold it."""
    location = adapter_location(spec, root)
    local = fetch(location) if is_url(location) else location.removeprefix("file://")
    return LoRARequest.for_path(local, name=spec if location == spec else location, identity=adapter_identity(local))


_identities: dict[tuple, str] = {}


def _not_regular(file: Path) -> OSError:
    return OSError(errno.EINVAL, f"{file.name} is not a regular file (a pipe, a device...)")


def _stats(path: str) -> tuple:
    """What changes whenever either file of the folder is written or replaced: its device,
    inode, size, modification and change times (``st_ctime_ns`` cannot be set back by a copy
    that keeps the modification time); ``OSError`` if one cannot be read or is no regular
    file (a pipe would block a read for good, ``/dev/zero`` never end one)."""
    out = []
    for name in _FILES:
        f = Path(path, name)
        st = f.stat()
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(f)
        out.append((str(f), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


def _open_regular(file: Path):
    """``file`` opened for reading, refused (``OSError``) unless it is a regular file: opened
    without blocking, so that a pipe swapped in after :func:`_stats` never hangs the open."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _not_regular(file)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def digest(contents: dict[str, bytes]) -> str:
    """The identity of an adapter folder whose two files hold ``contents`` (file name ->
    bytes): the SHA-256 of each file's name and bytes, in order."""
    h = hashlib.sha256()
    for name in _FILES:
        h.update(name.encode() + b"\0" + contents[name])
    return h.hexdigest()


def _read(file: Path, limit: int | None) -> bytes:
    """The bytes of ``file``; ``OSError`` (``EFBIG``) if it holds more than ``limit``, with no
    more than ``limit + 1`` of them read."""
    with _open_regular(file) as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise OSError(errno.EFBIG, f"{file.name} holds more than {limit} bytes")
    return data


_CHUNK = 1 << 20


def _stream_digest(path: str) -> str:
    """:func:`digest` of the folder's files, read a chunk at a time (never whole in memory:
    a file of any size)."""
    h = hashlib.sha256()
    for name in _FILES:
        h.update(name.encode() + b"\0")
        with _open_regular(Path(path, name)) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def read_files(path: str, limits: dict[str, int] | None = None) -> tuple[dict[str, bytes], str]:
    """The bytes of an adapter folder's two files, read once, and their identity
    (:func:`digest`; remembered for :func:`adapter_identity` when the files did not change
    while they were read). ``OSError`` if one cannot be read, or holds more bytes than
    ``limits`` (file name -> bytes) allows it."""
    limits = limits or {}
    before = _stats(path)
    contents = {name: _read(Path(path, name), limits.get(name)) for name in _FILES}
    identity = digest(contents)
    if _stats(path) == before:
        _identities[before] = identity
    return contents, identity


def adapter_identity(path: str) -> str:
    """A hex digest of an adapter folder's two files' bytes (the response cache's key: a
    re-fetched copy of the same adapter keeps it; :func:`digest`, read a chunk at a time);
    for a folder that cannot be read (a path that is no file name, such as one with a lone
    surrogate, included), its path. Remembered by the files' :func:`_stats`, so that asking
    again costs two ``stat`` calls until a file is written or replaced."""
    try:
        stats = _stats(path)
        cached = _identities.get(stats)
        if cached is None:
            cached = _stream_digest(path)
            if _stats(path) == stats:
                _identities[stats] = cached
    except (OSError, ValueError):  # ValueError: a path the file system cannot encode
        return f"unreadable:{path}"
    return cached
