"""The engine's Prometheus metrics (prefix ``dfllm_``), kept in the engine's own registry, and
snapshots of them as plain objects (``Counter``, ``Gauge``, ``Histogram``), like vLLM's ``get_metrics``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge as PromGauge
from prometheus_client import Histogram as PromHistogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0)
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# vLLM's names of the same metrics, also reported by snapshot(..., vllm_names=True) (get_metrics)
VLLM_NAMES = {
    "dfllm_num_requests_running": "vllm:num_requests_running",
    "dfllm_num_requests_waiting": "vllm:num_requests_waiting",
    "dfllm_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "dfllm_prompt_tokens": "vllm:prompt_tokens",
    "dfllm_generation_tokens": "vllm:generation_tokens",
    "dfllm_num_preemptions": "vllm:num_preemptions",
    "dfllm_prefix_cache_queries": "vllm:prefix_cache_queries",
    "dfllm_prefix_cache_hits": "vllm:prefix_cache_hits",
    "dfllm_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "dfllm_time_per_output_token_seconds": "vllm:inter_token_latency_seconds",
    "dfllm_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "dfllm_request_prompt_tokens": "vllm:request_prompt_tokens",
    "dfllm_request_generation_tokens": "vllm:request_generation_tokens",
}


class EngineMetrics:
    """Request gauges, token counters, cache statistics and latency histograms of one engine."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r, name = self.registry, {"model_name": model_name}

        def counter(n, doc):
            return PromCounter(n, doc, labels, registry=r).labels(**name)

        def gauge(n, doc):
            return PromGauge(n, doc, labels, registry=r).labels(**name)

        def histogram(n, doc, buckets):
            return PromHistogram(n, doc, labels, buckets=buckets, registry=r).labels(**name)

        self.running = gauge("dfllm_num_requests_running", "Sequences being computed")
        self.waiting = gauge("dfllm_num_requests_waiting", "Sequences waiting to be scheduled")
        self.kv_usage = gauge("dfllm_kv_cache_usage_perc", "Fraction of KV-cache blocks in use")
        self.prompt_tokens = counter("dfllm_prompt_tokens", "Prompt tokens of requests whose prefill finished")
        self.generation_tokens = counter("dfllm_generation_tokens", "Generated tokens")
        self.preemptions = counter("dfllm_num_preemptions", "Sequences preempted for lack of KV blocks")
        self.prefix_queries = counter("dfllm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("dfllm_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.deduplicated = counter(
            "dfllm_deduplicated_requests", "Requests answered with the output of an identical deterministic request"
        )
        self.ttft = histogram("dfllm_time_to_first_token_seconds", "Arrival to first token", LATENCY_BUCKETS)
        self.tpot = histogram("dfllm_time_per_output_token_seconds", "Time between output tokens", TOKEN_BUCKETS)
        self.e2e = histogram("dfllm_e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS)
        self.request_prompt = histogram(
            "dfllm_request_prompt_tokens", "Prompt tokens per finished request", LENGTH_BUCKETS
        )
        self.request_generation = histogram(
            "dfllm_request_generation_tokens", "Generated tokens per finished request", LENGTH_BUCKETS
        )

    def observe_step(
        self, num_running: int, num_waiting: int, kv_usage: float, preempted: int, prefix_queries: int, prefix_hits: int
    ) -> None:
        """Gauges after a step, and the counters it advanced."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)
        self.preemptions.inc(preempted)
        self.prefix_queries.inc(prefix_queries)
        self.prefix_hits.inc(prefix_hits)

    def observe_token(self, first_of_request: bool, prompt_len: int, seconds: float) -> None:
        """One generated token; ``seconds`` is the time to first token or since the previous one."""
        self.generation_tokens.inc()
        if first_of_request:
            self.prompt_tokens.inc(prompt_len)
            self.ttft.observe(seconds)
        else:
            self.tpot.observe(seconds)

    def observe_tokens(self, prompt_tokens: int, ttfts: list[float], tpots: list[float]) -> None:
        """A step's generated tokens at once, as :meth:`observe_token` once per token would
        record them (the same counters, bucket counts and, added in the same order, sums):
        ``ttfts`` the times to first token of the requests whose first token this was (their
        prompts ``prompt_tokens`` tokens together), ``tpots`` the other tokens' times since
        their previous one."""
        n = len(ttfts) + len(tpots)
        if n:
            self.generation_tokens.inc(n)
        if ttfts:
            self.prompt_tokens.inc(prompt_tokens)
            _observe_all(self.ttft, ttfts)
        if tpots:
            _observe_all(self.tpot, tpots)

    def observe_finish(self, seconds: float, prompt_tokens: int, generated_tokens: int) -> None:
        """A finished request: its latency and its prompt and generated token counts."""
        self.e2e.observe(seconds)
        self.request_prompt.observe(prompt_tokens)
        self.request_generation.observe(generated_tokens)


def _observe_all(hist: PromHistogram, values: list[float]) -> None:
    """``hist.observe(v)`` for each of ``values`` in order, in one update of the sum and one of
    each bucket hit (a step's tokens mostly share one value) where the client's histogram is
    the one this was written against (``_sum``, ``_buckets``, ``_upper_bounds``); one
    ``observe`` per value otherwise. Only the engine's stepping thread observes tokens, so
    reading the sum and setting it back loses no concurrent update."""
    total, buckets, bounds = (getattr(hist, a, None) for a in ("_sum", "_buckets", "_upper_bounds"))
    if total is None or buckets is None or bounds is None:
        for v in values:
            hist.observe(v)
        return
    s = total.get()
    counts: dict[float, int] = {}
    for v in values:  # the same float additions, in the same order, as observe's
        s += v
        counts[v] = counts.get(v, 0) + 1
    total.set(s)
    for v, c in counts.items():
        for i, bound in enumerate(bounds):  # as observe: the first bucket whose bound holds v (none for NaN)
            if v <= bound:
                buckets[i].inc(c)
                break


# ---- snapshots -----------------------------------------------------------------------
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


def snapshot(registry: CollectorRegistry, vllm_names: bool = False) -> list[Metric]:
    """Every counter, gauge and histogram of ``registry``, one object per label set; with
    ``vllm_names``, each of :data:`VLLM_NAMES` a second time under vLLM's name (``vllm:...``),
    so code written against vLLM's ``get_metrics()`` finds what it reads."""
    out: list[Metric] = []
    for family in registry.collect():
        by_labels: dict[tuple, list] = {}
        for sample in family.samples:
            key = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            by_labels.setdefault(key, []).append(sample)
        for key, samples in by_labels.items():
            labels = dict(key)
            metric = _convert(family.type, family.name, labels, samples)
            if metric is not None:
                out.append(metric)
    if vllm_names:
        out += [dataclasses.replace(m, name=VLLM_NAMES[m.name]) for m in out if m.name in VLLM_NAMES]
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
