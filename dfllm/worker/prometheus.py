"""Exposing the engines' ``dfllm_`` metrics on the process's default Prometheus registry.

A Dask worker serves that registry on its ``/metrics`` endpoint, so every worker's engine
metrics appear there beside Dask's own. Engines keep their own registries; one collector
per process merges their metric families; an engine's leave when it is shut down
(:func:`unexpose`).
"""

from __future__ import annotations

import threading

import prometheus_client
from prometheus_client.core import Metric

_registries: list = []
_lock = threading.Lock()
_registered = False


class _EngineMetricsCollector:
    def collect(self):
        families: dict[str, Metric] = {}
        for registry in list(_registries):
            for family in registry.collect():
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                merged.samples.extend(family.samples)
        yield from families.values()


def expose(registry) -> None:
    """Add an engine's registry to what the process's default registry serves."""
    global _registered
    with _lock:
        _registries.append(registry)
        if not _registered:
            prometheus_client.REGISTRY.register(_EngineMetricsCollector())
            _registered = True


def unexpose(registry) -> None:
    """Stop serving an engine's registry (its engine was shut down); unknown ones are ignored."""
    with _lock:
        for i, known in enumerate(_registries):
            if known is registry:
                del _registries[i]
                return
