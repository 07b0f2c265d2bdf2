"""What, besides its rows, decides a partition's output, as text a resumed write compares.

:func:`canonical` is the one serialisation every task and params object enters a write's
key through: JSON of every field (dataclasses by their fields, mappings sorted, floats
exact), never ``repr``, so that no field is left out and no field's text depends on the
process. :func:`model_key` adds what the models' files hold (see
:func:`dfllm.models.identity.model_identity`) and a LoRA adapter's (:class:`AdapterSource`),
so that new weights copied over a model's or an adapter's folder recompute.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Iterable, Mapping

import numpy as np


def canonical(value) -> str:
    """``value`` as canonical JSON text: equal for equal values in every process, different
    whenever any field differs. ``TypeError`` for a value with no stable text (a function,
    an open file...)."""
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _plain(v):
    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, enum.Enum):
        return {"enum": f"{type(v).__qualname__}.{v.name}"}
    if isinstance(v, np.generic):
        return _plain(v.item())
    if isinstance(v, np.ndarray):
        return {"ndarray": str(v.dtype), "values": _plain(v.tolist())}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        fields = {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        return {"dataclass": f"{type(v).__module__}.{type(v).__qualname__}", "fields": fields}
    if isinstance(v, Mapping):
        if all(isinstance(k, str) for k in v):
            return {"mapping": {k: _plain(x) for k, x in v.items()}}  # json.dumps sorts the keys
        return {"mapping": sorted(([_plain(k), _plain(x)] for k, x in v.items()), key=json.dumps)}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if isinstance(v, set | frozenset):
        return {"set": sorted((_plain(x) for x in v), key=json.dumps)}
    if isinstance(v, bytes | bytearray):
        return {"bytes": bytes(v).hex()}
    if isinstance(v, type) and hasattr(v, "model_json_schema"):  # a pydantic model as a JSON schema
        return {"pydantic": _plain(v.model_json_schema())}
    if type(v).__module__.startswith(("pyarrow", "pandas", "numpy")):  # dtypes, Arrow types
        return {type(v).__name__: str(v)}
    raise TypeError(f"a {type(v).__name__} has no stable key")


@dataclasses.dataclass(frozen=True)
class AdapterSource:
    """A LoRA adapter given for every row (``lora=`` a path, URL, or name under ``root``): its
    files' bytes enter the key (:func:`dfllm.lora.resolve.adapter_identity`)."""

    spec: str
    root: str | None = None


def model_key(models: Iterable[str | AdapterSource | None]) -> str:
    """The content identity of each model (None: the default chat model) and adapter, in order."""
    from dfllm.models.identity import model_identity

    return ",".join(_adapter_identity(m) if isinstance(m, AdapterSource) else model_identity(m) for m in models)


def _adapter_identity(source: AdapterSource) -> str:
    """What the adapter's files hold (a URL fetched on this worker), or, when it cannot be
    read, its name (its rows then fail with their own error)."""
    from dfllm.lora.resolve import adapter_identity, resolve

    try:
        return "lora:" + adapter_identity(resolve(source.spec, source.root).lora_path)
    except ValueError:
        return f"unresolved-lora:{source.spec!r}"
