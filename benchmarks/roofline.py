"""A GPU's own limits, and the least time a generation workload can take within them.

Two measurements of the device (``matmul_rate``, ``copy_bandwidth``), and pure arithmetic
that prices a workload against them (``ModelShape``, ``decode_steps``, ``roofline``): no GPU
is needed to check the arithmetic (``tests/system/test_bench_roofline.py``).

The model of a run (``roofline``)
---------------------------------
- **Prefill**: every prompt token goes through the layers once, compute-bound at the matmul
  rate: ``2 x linear params`` FLOPs per token plus causal attention, ``4 x layers x heads x
  head_dim x context`` with the token's own context (its position + 1), plus the LM head
  (``2 x hidden x vocab``) for the prompt's last token, which samples the first generated
  token. The weight reads of prefill steps are left out (a chunk of hundreds of tokens is
  compute-bound: its FLOPs take far longer than reading the weights once).
- **Decode**: continuous batching as the engine runs it, simplified: at most
  ``max_num_seqs`` sequences at a time, admitted in input order as slots free, every step
  decoding one token of every running sequence (``decode_steps``); a row of ``n`` generated
  tokens runs ``n - 1`` decode steps (its first token comes from its prefill). A step costs
  ``max(bytes / copy bandwidth, FLOPs / matmul rate)``: bytes = the weights once (read
  whole by every step) + the KV cache of every running sequence (its context x layers x 2 x
  kv_heads x head_dim x KV dtype bytes); FLOPs = per running sequence, ``2 x linear params``
  + attention over its context + the LM head. KV-cache capacity, preemption, and prefill
  chunks interleaved with decode steps are not modelled (they can only add time).
- Activations, norms, rotary, sampling and KV writes cost nothing here: the figure is a
  ceiling no engine reaches, the least time the weights, the KV cache and the matmuls
  allow on this device.

Example (Llama-3.2-1B's shape, one sequence of 100 prompt tokens and 3 generated ones, on
a device of 1 PFLOP/s and 1 TB/s)::

    >>> shape = ModelShape(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64,
    ...                    intermediate=8192, vocab=128256)
    >>> shape.linear_params, shape.kv_bytes_per_token(2)
    (973078528, 32768)
    >>> [ctx for ctx in decode_steps([100], [3], max_num_seqs=8)]
    [[101], [102]]
    >>> r = roofline(shape, [100], [3], max_num_seqs=8, weight_bytes=shape.weight_bytes(2),
    ...              kv_token_bytes=32768, matmul_flop_s=1e15, copy_bytes_s=1e12)
    >>> r["decode_steps"], r["memory_bound_steps"], round(r["decode_seconds"] * 1e3, 3)
    (2, 2, 4.95)
    >>> round(r["tok_s"], 1)
    583.0
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

# ---- the model's shape -------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a Llama/Qwen-style decoder (dense, gated MLP)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, cfg) -> ModelShape:
        """From a Hugging Face config (``LlamaConfig``, ``Qwen2Config``, ...)."""
        heads = cfg.num_attention_heads
        return cls(
            layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            intermediate=cfg.intermediate_size,
            vocab=cfg.vocab_size,
        )

    @property
    def linear_params(self) -> int:
        """Weights of the layers' linears (q, k, v, o, gate, up, down), the LM head and the
        embedding left out: a token's matmuls are ``2 x`` this many FLOPs."""
        h, qd, kvd = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * (h * qd + 2 * h * kvd + qd * h + 3 * h * self.intermediate)

    @property
    def lm_head_flops(self) -> int:
        """FLOPs of projecting one sampled token's hidden state onto the vocabulary."""
        return 2 * self.hidden * self.vocab

    def attention_flops(self, context: int) -> int:
        """FLOPs of one token's attention over ``context`` positions, every layer (QK^T and
        the weighted sum of V: 2 x 2 x head_dim per head and position)."""
        return 4 * self.layers * self.heads * self.head_dim * context

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of one position's keys and values over all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes of the weights a decode step reads, from the shape alone: the layers'
        linears and the LM head (an untied input embedding is only gathered from: not
        counted); norms left out."""
        return (self.linear_params + self.hidden * self.vocab) * dtype_bytes


def prefill_flops(shape: ModelShape, prompt_len: int) -> int:
    """FLOPs of one prompt's prefill: its tokens' linears, their causal attention (token i
    attends i + 1 positions) and the LM head for its last token (the first sampled one)."""
    p = prompt_len
    return p * 2 * shape.linear_params + shape.attention_flops(p * (p + 1) // 2) + shape.lm_head_flops


# ---- the decode phase --------------------------------------------------------------------


def decode_steps(prompt_lens: Sequence[int], gen_lens: Sequence[int], max_num_seqs: int) -> Iterator[list[int]]:
    """The contexts of the running sequences at every decode step of continuous batching:
    at most ``max_num_seqs`` sequences run at once, admitted in input order as slots free;
    a sequence of ``n`` generated tokens runs ``n - 1`` decode steps (its first token comes
    from its prefill), its context at its k-th step (from 0) being ``prompt + 1 + k``.
    Rows that generate one token or none never decode."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    waiting = [(p, n - 1) for p, n in zip(prompt_lens, gen_lens) if n > 1]
    waiting.reverse()  # pop() admits in input order
    running: list[list[int]] = []  # [context, decode steps left]
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            p, steps = waiting.pop()
            running.append([p + 1, steps])
        yield [c for c, _ in running]
        for r in running:
            r[0] += 1
            r[1] -= 1
        running = [r for r in running if r[1] > 0]


def decode_step_cost(shape: ModelShape, contexts: Sequence[int], weight_bytes: int, kv_token_bytes: int) -> tuple:
    """(bytes read, FLOPs) of one decode step over sequences with these contexts."""
    n, total = len(contexts), sum(contexts)
    nbytes = weight_bytes + total * kv_token_bytes
    flops = n * (2 * shape.linear_params + shape.lm_head_flops) + shape.attention_flops(total)
    return nbytes, flops


# ---- the workload's ceiling --------------------------------------------------------------


def roofline(
    shape: ModelShape,
    prompt_lens: Sequence[int],
    gen_lens: Sequence[int],
    max_num_seqs: int,
    weight_bytes: int,
    kv_token_bytes: int,
    matmul_flop_s: float,
    copy_bytes_s: float,
) -> dict:
    """The least time of a workload (``prompt_lens[i]`` prompt tokens, ``gen_lens[i]``
    generated tokens per row) on a device of ``matmul_flop_s`` and ``copy_bytes_s``, as the
    module docstring models it; ``tok_s`` is generated tokens per second at that time."""
    prefill = sum(prefill_flops(shape, p) for p, n in zip(prompt_lens, gen_lens) if n > 0)
    prefill_s = prefill / matmul_flop_s
    decode_s = memory_s = compute_s = 0.0
    steps = memory_bound = 0
    total_bytes = total_flops = 0
    batch_sizes = []
    for contexts in decode_steps(prompt_lens, gen_lens, max_num_seqs):
        nbytes, flops = decode_step_cost(shape, contexts, weight_bytes, kv_token_bytes)
        t_mem, t_flops = nbytes / copy_bytes_s, flops / matmul_flop_s
        decode_s += max(t_mem, t_flops)
        memory_s += t_mem
        compute_s += t_flops
        memory_bound += t_mem >= t_flops
        steps += 1
        total_bytes += nbytes
        total_flops += flops
        batch_sizes.append(len(contexts))
    generated = sum(gen_lens)
    seconds = prefill_s + decode_s
    return {
        "model": "prefill compute-bound; decode steps of continuous batching, max(bytes/bw, flops/rate) each",
        "max_num_seqs": max_num_seqs,
        "matmul_flop_s": matmul_flop_s,
        "copy_bytes_s": copy_bytes_s,
        "weight_bytes": weight_bytes,
        "kv_token_bytes": kv_token_bytes,
        "prompt_tokens": sum(prompt_lens),
        "generated_tokens": generated,
        "prefill_flops": prefill,
        "prefill_seconds": prefill_s,
        "decode_steps": steps,
        "memory_bound_steps": memory_bound,
        "mean_decode_batch": statistics.mean(batch_sizes) if batch_sizes else 0.0,
        "decode_bytes": total_bytes,
        "decode_flops": total_flops,
        "decode_seconds": decode_s,
        "decode_memory_seconds": memory_s,
        "decode_compute_seconds": compute_s,
        "seconds": seconds,
        "tok_s": generated / seconds if seconds else float("nan"),
        "ceiling_tok_s": generated / seconds if seconds else float("nan"),
    }


def share(tok_s: float, ceiling: dict) -> float:
    """An engine's throughput as a percentage of the roofline's."""
    return 100 * tok_s / ceiling["tok_s"]


# ---- the device's limits (measured) --------------------------------------------------------


def _timed_reps(fn, device, reps: int, warmup: int) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after ``warmup`` untimed ones: CUDA events
    around each call on a GPU (one synchronisation at the end), wall time elsewhere."""
    import torch

    for _ in range(warmup):
        fn()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def matmul_rate(device, dtype, n: int = 8192, reps: int = 10, warmup: int = 3) -> dict:
    """FLOP/s of an ``n x n x n`` matmul in ``dtype`` on ``device`` (the fastest of ``reps``
    timed ones, and the median), its operands drawn from a normal distribution."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    c = torch.empty(n, n, device=device, dtype=dtype)
    with torch.inference_mode():
        times = _timed_reps(lambda: torch.mm(a, b, out=c), device, reps, warmup)
    flops = 2 * n**3
    return {
        "shape": [n, n, n],
        "dtype": str(dtype).removeprefix("torch."),
        "reps": reps,
        "best_seconds": min(times),
        "median_seconds": statistics.median(times),
        "flop_s": flops / min(times),
        "median_flop_s": flops / statistics.median(times),
    }


def copy_bandwidth(device, nbytes: int = 1 << 30, reps: int = 10, warmup: int = 3) -> dict:
    """Bytes/s of a device-to-device copy of ``nbytes`` (read + written, so 2 x ``nbytes``
    a copy; the fastest of ``reps`` timed copies, and the median)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    times = _timed_reps(lambda: dst.copy_(src), device, reps, warmup)
    moved = 2 * nbytes
    return {
        "bytes": nbytes,
        "reps": reps,
        "best_seconds": min(times),
        "median_seconds": statistics.median(times),
        "bytes_s": moved / min(times),
        "median_bytes_s": moved / statistics.median(times),
    }


def device_limits(device, dtype, matmul_n: int = 8192, copy_bytes: int = 1 << 30) -> dict:
    """Both measurements, then the memory they took handed back to the device (the engine's
    KV cache is sized from what is free)."""
    import torch

    limits = {"matmul": matmul_rate(device, dtype, matmul_n), "copy": copy_bandwidth(device, copy_bytes)}
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        limits["device_name"] = torch.cuda.get_device_name(device)
    return limits
