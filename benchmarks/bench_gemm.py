"""bfloat16 GEMMs over a decoder's linear layers: dfllm's own (AVX512-BF16) against oneDNN's
packed GEMM and ``F.linear``, at a decode step's and a prefill chunk's row counts.

Each pass multiplies ``--rows`` rows through every linear layer of the model's shape once
(q, k and v fused as the engine fuses them, o, gate and up fused, down; ``--lm-head`` adds the
vocabulary projection), each layer with its own weight as a forward pass streams them from
memory ("cold"), and again with the first layer's weights for every layer, which then stay in
cache ("hot": what the arithmetic alone allows). The GEMMs alternate pass by pass; the median
pass of each is printed in milliseconds and GFLOP/s, with the CPU, and the largest difference
between dfllm's result and oneDNN's on the first layer (in units of bfloat16's last place).

    python benchmarks/bench_gemm.py                        # SmolLM2-135M's shape, 1-512 rows
    python benchmarks/bench_gemm.py --rows 64 --passes 9
    python benchmarks/bench_gemm.py --hidden 2048 --intermediate 8192 --layers 16 --heads 32 --kv-heads 8

dfllm's GEMM runs where the CPU has AVX512-BF16 (the engine uses it there only without AMX,
whose oneDNN tiles are faster); oneDNN's bfloat16 GEMM where torch says the CPU supports it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from bench_host import machine, machine_line  # benchmarks/bench_host.py

from dfllm.kernels.backend import cpu_bf16_gemm, cpu_bf16_gemm_available, cpu_bf16_gemm_pack


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--lm-head", action="store_true", help="add the vocabulary projection to each pass")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 512])
    p.add_argument("--passes", type=int, default=7, help="timed passes per GEMM and mode (medians)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    return p.parse_args()


def shapes(a: argparse.Namespace) -> list[tuple[int, int]]:
    """(in, out) of one layer's linears as the engine fuses them, plus the LM head if asked."""
    head_dim = a.hidden // a.heads
    out = [
        (a.hidden, (a.heads + 2 * a.kv_heads) * head_dim),
        (a.heads * head_dim, a.hidden),
        (a.hidden, 2 * a.intermediate),
        (a.intermediate, a.hidden),
    ]
    return out


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    layer = shapes(a)
    # the weights in the order a pass reads them; "hot" reads the first of each shape throughout
    order = [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(a.layers) for k, n in layer]
    if a.lm_head:
        order.append((torch.randn(a.vocab, a.hidden, generator=gen) * 0.02).to(torch.bfloat16))
    first: dict[tuple, torch.Tensor] = {}
    for w in order:
        first.setdefault(tuple(w.shape), w)
    passes = {"cold": order, "hot": [first[tuple(w.shape)] for w in order]}
    gemms: dict[str, tuple] = {"F.linear": (lambda x, w, p: F.linear(x, w), lambda w: None)}
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        gemms["oneDNN packed"] = (
            lambda x, w, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
            lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None),
        )
    if cpu_bf16_gemm_available():
        gemms["dfllm bf16"] = (lambda x, w, p: cpu_bf16_gemm(x, p, None, w.shape[0]), cpu_bf16_gemm_pack)
    packed = {name: {id(w): pack(w) for w in order} for name, (_, pack) in gemms.items()}
    flops_per_row = sum(2 * w.numel() for w in order)
    info = machine("cpu")
    print(machine_line(info))
    print(
        f"shape: {a.layers} layers of {', '.join(f'{k}x{n}' for k, n in layer)}{' + LM head' if a.lm_head else ''}, "
        f"{sum(w.numel() for w in order) * 2 / 1e6:.0f} MB of bfloat16 weights"
    )
    results = []
    with torch.inference_mode():
        for rows in a.rows:
            inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen).to(torch.bfloat16) for w in order}
            times: dict[tuple[str, str], list[float]] = {(g, m): [] for g in gemms for m in passes}
            for p in range(a.passes + 1):
                for name, (gemm, _) in gemms.items():
                    for mode, ws in passes.items():
                        start = time.perf_counter()
                        for w in ws:
                            gemm(inputs[w.shape[1]], w, packed[name][id(w)])
                        if p:
                            times[name, mode].append(time.perf_counter() - start)
            ulps = None
            if "dfllm bf16" in gemms and "oneDNN packed" in gemms:
                w, x = order[0], inputs[order[0].shape[1]]
                mine = gemms["dfllm bf16"][0](x, w, packed["dfllm bf16"][id(w)]).float()
                theirs = gemms["oneDNN packed"][0](x, w, packed["oneDNN packed"][id(w)]).float()
                ulps = ((mine - theirs).abs() / (theirs.abs().clamp_min(1e-30) * 2.0**-7)).max().item()
            row: dict = {"rows": rows, "ulps_vs_onednn": ulps}
            parts = []
            for (name, mode), ts in times.items():
                med = statistics.median(ts)
                row[f"{name} {mode}"] = {"ms": med * 1e3, "gflop_s": rows * flops_per_row / med / 1e9}
                parts.append(f"{name} {mode} {med * 1e3:.2f} ms ({rows * flops_per_row / med / 1e9:.0f} GF)")
            results.append(row)
            tail = "" if ulps is None else f"; dfllm vs oneDNN at most {ulps:.1f} ulp apart"
            print(f"rows {rows}: " + ", ".join(parts) + tail)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": info, "args": vars(a), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
