"""Snapshots of the engine's Prometheus metrics as plain objects, like vLLM's ``get_metrics``."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    """``buckets`` maps each upper bound (as a string, "+Inf" last) to its cumulative count."""

    count: int
    sum: float
    buckets: dict[str, int] = field(default_factory=dict)


def snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every counter, gauge and histogram of ``registry``, one object per label set."""
    out: list[Metric] = []
    for family in registry.collect():
        by_labels: dict[tuple, list] = {}
        for sample in family.samples:
            by_labels.setdefault(tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le")), []).append(sample)
        for key, samples in by_labels.items():
            labels = dict(key)
            metric = _convert(family.type, family.name, labels, samples)
            if metric is not None:
                out.append(metric)
    return out


def _convert(kind: str, name: str, labels: dict, samples) -> Metric | None:
    if kind == "counter":
        total = next(s.value for s in samples if s.name.endswith("_total"))
        return Counter(name, labels, int(total))
    if kind == "gauge":
        return Gauge(name, labels, float(samples[0].value))
    if kind == "histogram":
        buckets = {s.labels["le"]: int(s.value) for s in samples if s.name.endswith("_bucket")}
        count = next(s.value for s in samples if s.name.endswith("_count"))
        total = next(s.value for s in samples if s.name.endswith("_sum"))
        return Histogram(name, labels, int(count), float(total), buckets)
    return None
