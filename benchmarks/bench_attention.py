"""Decode attention bandwidth: dfllm's Triton paged-attention kernel vs a device-to-device copy.

A decode-only batch (one query per sequence) over a paged KV cache with random block tables.
The kernel must read every key and value once, so its achieved bandwidth is
``bytes of K + V read / kernel time``; the yardstick is a ``copy_`` of the same number of
bytes on the same device in the same run, whose bandwidth counts its read and its write
(``2 x bytes / time``). Also times the kernel without the KV split (flash decoding off) and
checks the output against the PyTorch reference (exit status 1 when it is off by more than
the kernel tests' tolerance).

    python benchmarks/bench_attention.py                # on a GPU, bfloat16, batch 64 x 4096 tokens
    python benchmarks/bench_attention.py --tiny         # smoke test on a CPU (Triton interpreter)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dfllm.kernels.backend import TORCH_OPS, select_ops
from dfllm.kernels.metadata import AttentionMetadata, DecodeGroup

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# the largest error, relative to the largest reference value, that passes (tests/kernels/test_kernels.py's, with margin)
TOL = {"bf16": 2e-2, "fp16": 1e-2, "fp32": 1e-4}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--tiny", action="store_true", help="tiny fp32 shapes on the CPU through Triton's interpreter")
    p.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    args = p.parse_args()
    if args.tiny:
        args.batch, args.heads, args.kv_heads, args.head_dim = 2, 4, 2, 64
        args.context, args.dtype, args.iters = 80, "fp32", 1
    return args


def decode_batch(args, device: torch.device):
    """Queries, KV caches and metadata for ``batch`` decodes at ``context`` tokens each."""
    dtype, bs = DTYPES[args.dtype], args.block_size
    width = -(-args.context // bs)
    num_blocks = args.batch * width
    tables = torch.randperm(num_blocks, device=device).view(args.batch, width)
    shape = (num_blocks, bs, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    q = torch.randn(args.batch, args.heads, args.head_dim, device=device, dtype=dtype)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32, device=device)
    mask = torch.arange(width * bs, device=device)[None, :] < lens[:, None]
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long, device=device),
        prefills=[],
        decode_groups=[DecodeGroup(torch.arange(args.batch, device=device), tables.long(), mask)],
        query_start_loc=torch.arange(args.batch + 1, dtype=torch.int32, device=device),
        seq_lens=lens,
        block_tables=tables.to(torch.int32),
        block_size=bs,
        max_query_len=1,
        max_seq_len=args.context,
    )
    return q, k_cache, v_cache, meta


def seconds_per_call(fn, iters: int, device: torch.device) -> float:
    """Mean wall seconds per call of ``fn`` after one warm-up call (CUDA events on a GPU)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    args = parse_args()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible to torch; --tiny runs tiny shapes on the CPU (Triton's interpreter)")
    device = torch.device("cpu" if args.tiny else "cuda")
    select_ops("triton", device)  # sets TRITON_INTERPRET=1 on a CPU before triton is imported
    from dfllm.kernels._triton_paged_attention import launch_plan, paged_attention_launch

    torch.manual_seed(0)
    q, k_cache, v_cache, meta = decode_batch(args, device)
    scale = args.head_dim**-0.5
    kv_bytes = 2 * args.batch * args.context * args.kv_heads * args.head_dim * k_cache.element_size()
    segments = launch_plan(q, args.kv_heads, meta)[3]

    out = paged_attention_launch(q, k_cache, v_cache, meta, scale)
    want = TORCH_OPS.paged_attention(q, None, None, k_cache, v_cache, meta, scale)
    err = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()

    t_split = seconds_per_call(lambda: paged_attention_launch(q, k_cache, v_cache, meta, scale), args.iters, device)
    t_plain = seconds_per_call(
        lambda: paged_attention_launch(q, k_cache, v_cache, meta, scale, num_segments=1), args.iters, device
    )
    src = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t_copy = seconds_per_call(lambda: dst.copy_(src), args.iters, device)

    figures = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "shape": f"B={args.batch} H={args.heads}/{args.kv_heads} D={args.head_dim} L={args.context} "
        f"bs={args.block_size} {args.dtype}",
        "dtype": args.dtype,
        "kv_bytes": kv_bytes,
        "segments": segments,
        "rel_err": err,
        "tol": TOL[args.dtype],
        "attn_us": t_split * 1e6,
        "attn_gb_s": kv_bytes / t_split / 1e9,
        "attn_nosplit_us": t_plain * 1e6,
        "attn_nosplit_gb_s": kv_bytes / t_plain / 1e9,
        "copy_us": t_copy * 1e6,
        "copy_gb_s": 2 * kv_bytes / t_copy / 1e9,
    }
    figures["ratio"] = figures["attn_gb_s"] / figures["copy_gb_s"]
    print_report(figures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    if not err <= TOL[args.dtype]:  # NaN fails too
        raise SystemExit(f"decode attention is off: max rel err {err:.1e} > {TOL[args.dtype]:.0e}")


def print_report(f: dict) -> None:
    print(
        f"decode attention on {f['device']}: {f['shape']}, K+V {f['kv_bytes'] / 1e6:.1f} MB, "
        f"max rel err vs torch {f['rel_err']:.1e}"
    )
    print(f"  kernel, {f['segments']} KV segments: {f['attn_us']:10.1f} us  {f['attn_gb_s']:8.1f} GB/s")
    print(f"  kernel, no KV split:      {f['attn_nosplit_us']:10.1f} us  {f['attn_nosplit_gb_s']:8.1f} GB/s")
    print(f"  copy_ (read + write):     {f['copy_us']:10.1f} us  {f['copy_gb_s']:8.1f} GB/s")
    print(f"  kernel / copy bandwidth:  {f['ratio']:.2f}")


if __name__ == "__main__":
    main()
