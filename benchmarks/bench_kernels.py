"""Every Triton kernel in dfllm/kernels against its PyTorch reference: max abs error and time.

For each operation of :class:`dfllm.kernels.backend.KernelOps` (paged attention, with the
sliding-window and soft-cap options; the KV-cache write; RMSNorm, with and without the fused
residual; rotary; SiLU-and-multiply; the fused MoE) and each dtype, the script runs the
Triton kernel and the PyTorch reference on the same random inputs and reports

* the largest absolute difference of the outputs, and that difference relative to the largest
  reference value, which must be within a tolerance per dtype (the kernel tests' bounds);
* the time of one call of each (CUDA events on a GPU, after a warm-up call that compiles the
  kernel) and the speedup, torch time / Triton time.

Shapes are engine-sized on a GPU (32 query / 8 KV heads of 128, 64 decodes of 1-2K tokens,
8K-token RMSNorm/rotary/SiLU batches, a 64-expert top-8 MoE) and tiny with ``--cpu``, where the
kernels run in Triton's interpreter: the figures then check that everything runs and agrees,
the times mean nothing.

    python benchmarks/bench_kernels.py                       # on a GPU: fp16 and bf16
    python benchmarks/bench_kernels.py --cpu                 # tiny shapes, fp32 and fp16, interpreter
    python benchmarks/bench_kernels.py --dtypes bf16 --only attention --json kernels.json

Exit status 1 if any case is out of tolerance or raises.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
from bench_attention import seconds_per_call

from dfllm.kernels.backend import TORCH_OPS, KernelOps, select_ops
from dfllm.kernels.fused_moe import route_topk
from dfllm.kernels.metadata import AttentionMetadata, DecodeGroup, PrefillSpan

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# relative error bound: max |triton - torch| / max |torch| (tests/kernels/test_kernels.py's, fp32 with margin)
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@dataclass
class Sizes:
    """Problem sizes of one run (engine-sized on a GPU, tiny on the interpreter)."""

    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    decode_lens: list[int]  # context length of each decode
    prefills: list[tuple[int, int]]  # (new tokens, context length incl. them) of each prefill chunk
    window: int
    softcap: float
    tokens: int  # rows of the KV-write, RMSNorm, rotary and SiLU batches
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    moe_hidden: int
    moe_intermediate: int
    moe_tokens: tuple[int, int]  # a decode-sized and a prefill-sized MoE batch


class Rng:
    """Seeded draws: integers on the host, tensor data made on the device (no host copies)."""

    def __init__(self, seed: int, device: torch.device):
        self.host = torch.Generator().manual_seed(seed)
        self.dev = torch.Generator(device=device).manual_seed(seed)
        self.device = device

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.dev, device=self.device)
        return (x * scale if scale != 1.0 else x).to(dtype)


def gpu_sizes(rng: Rng) -> Sizes:
    decode_lens = torch.randint(1024, 2049, (64,), generator=rng.host).tolist()
    return Sizes(
        heads=32,
        kv_heads=8,
        head_dim=128,
        block_size=16,
        decode_lens=decode_lens,
        prefills=[(512, 512), (512, 1536), (256, 2048), (1024, 1024)],
        window=512,
        softcap=50.0,
        tokens=8192,
        hidden=4096,
        intermediate=11008,
        experts=64,
        top_k=8,
        moe_hidden=2048,
        moe_intermediate=1408,
        moe_tokens=(64, 2048),
    )


def cpu_sizes(rng: Rng) -> Sizes:
    # tests/kernels/test_kernels.py's mixed batch: a fresh prefill, a chunk over a cached prefix, decodes
    return Sizes(
        heads=4,
        kv_heads=2,
        head_dim=64,
        block_size=16,
        decode_lens=[33, 70, 17],
        prefills=[(5, 5), (7, 40)],
        window=24,
        softcap=30.0,
        tokens=24,
        hidden=96,
        intermediate=80,
        experts=4,
        top_k=2,
        moe_hidden=32,
        moe_intermediate=48,
        moe_tokens=(6, 130),
    )


# ---- inputs -------------------------------------------------------------------------------
def attention_inputs(sz: Sizes, seqs: list[tuple[int, int]], dtype: torch.dtype, device: torch.device, rng: Rng):
    """q, k, v, paged caches (the new keys written at their slots) and the metadata of a batch
    ``seqs`` = [(q_len, seq_len), ...]: the torch fields (prefill spans, one decode group) and
    the ragged ones, block tables drawn at random from a shuffled pool."""
    bs = sz.block_size
    tokens = sum(q for q, _ in seqs)
    blocks = [-(-n // bs) for _, n in seqs]
    num_blocks = sum(blocks) + 3
    pool = torch.randperm(num_blocks, generator=rng.host)
    tables, at = [], 0
    for b in blocks:
        tables.append(pool[at : at + b])
        at += b

    def rand(*shape):
        return rng.randn(*shape, dtype=dtype)

    q = rand(tokens, sz.heads, sz.head_dim)
    k, v = rand(tokens, sz.kv_heads, sz.head_dim), rand(tokens, sz.kv_heads, sz.head_dim)
    k_cache = rand(num_blocks, bs, sz.kv_heads, sz.head_dim)
    v_cache = rand(num_blocks, bs, sz.kv_heads, sz.head_dim)

    slots, prefills, dec_rows, dec_tables, dec_lens, qsl = [], [], [], [], [], [0]
    for (q_len, seq_len), table in zip(seqs, tables):
        row = qsl[-1]
        pos = torch.arange(seq_len)
        all_slots = table[pos // bs] * bs + pos % bs
        slots.append(all_slots[seq_len - q_len :])
        if q_len == 1:
            dec_rows.append(row)
            dec_tables.append(table)
            dec_lens.append(seq_len)
        else:
            cached = seq_len > q_len
            prefills.append(PrefillSpan(row, q_len, seq_len, all_slots.to(device) if cached else None))
        qsl.append(row + q_len)
    groups = []
    if dec_rows:
        width = max(len(t) for t in dec_tables)
        padded = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in dec_tables]).to(device)
        mask = torch.arange(width * bs)[None, :] < torch.tensor(dec_lens)[:, None]
        groups.append(DecodeGroup(torch.tensor(dec_rows, device=device), padded, mask.to(device)))
    width = max(blocks)
    block_tables = torch.stack([torch.cat([t, t.new_full((width - len(t),), -1)]) for t in tables])
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        prefills=prefills,
        decode_groups=groups,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n for _, n in seqs], dtype=torch.int32, device=device),
        block_tables=block_tables.to(torch.int32).to(device),
        block_size=bs,
        max_query_len=max(q for q, _ in seqs),
        max_seq_len=max(n for _, n in seqs),
    )
    TORCH_OPS.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta


# ---- cases: each returns (label, shape, triton fn, torch fn); a fn returns the output(s) ---
Case = tuple[str, str, Callable[[], object], Callable[[], object]]


def attention_cases(ops: KernelOps, sz: Sizes, dtype, device, rng: Rng) -> list[Case]:
    decodes = [(1, n) for n in sz.decode_lens]
    mixed = sz.prefills + decodes
    cases = []
    for label, seqs, window, cap in [
        ("decode", decodes, None, None),
        (f"decode window={sz.window} softcap={sz.softcap:g}", decodes, sz.window, sz.softcap),
        ("mixed prefill+decode", mixed, None, None),
        (f"mixed window={sz.window}", mixed, sz.window, None),
        (f"mixed softcap={sz.softcap:g}", mixed, None, sz.softcap),
    ]:
        q, k, v, kc, vc, meta = attention_inputs(sz, seqs, dtype, device, rng)
        scale = sz.head_dim**-0.5
        shape = (
            f"{len(seqs)} seqs, {q.shape[0]} tokens, max ctx {meta.max_seq_len}, "
            f"H={sz.heads}/{sz.kv_heads} D={sz.head_dim}"
        )

        def run(fn, q=q, k=k, v=v, kc=kc, vc=vc, meta=meta, scale=scale, window=window, cap=cap):
            return lambda: fn(q, k, v, kc, vc, meta, scale, sliding_window=window, softcap=cap)

        cases.append((f"paged_attention {label}", shape, run(ops.paged_attention), run(TORCH_OPS.paged_attention)))
    return cases


def kv_write_case(ops: KernelOps, sz: Sizes, dtype, device, rng: Rng) -> Case:
    t, bs = sz.tokens, sz.block_size
    num_blocks = -(-t // bs) + 4
    key = rng.randn(t, sz.kv_heads, sz.head_dim, dtype=dtype)
    value = rng.randn(t, sz.kv_heads, sz.head_dim, dtype=dtype)
    slots = torch.randperm(num_blocks * bs, generator=rng.host)[:t]
    slots[::7] = -1  # padding tokens are skipped
    slots = slots.to(device)
    caches = {
        name: (
            torch.zeros(num_blocks, bs, sz.kv_heads, sz.head_dim, dtype=dtype, device=device),
            torch.zeros(num_blocks, bs, sz.kv_heads, sz.head_dim, dtype=dtype, device=device),
        )
        for name in ("triton", "torch")
    }

    def run(fn, name):
        def call():
            kc, vc = caches[name]
            fn(key, value, kc, vc, slots)
            return kc, vc

        return call

    shape = f"{t} tokens ({(slots < 0).sum().item()} padding), kv {sz.kv_heads}x{sz.head_dim}, block {bs}"
    return "write_kv_cache", shape, run(ops.write_kv_cache, "triton"), run(TORCH_OPS.write_kv_cache, "torch")


def norm_act_rotary_cases(ops: KernelOps, sz: Sizes, dtype, device, rng: Rng) -> list[Case]:
    def rand(*shape):
        return rng.randn(*shape, dtype=dtype)

    t, h = sz.tokens, sz.hidden
    x, res, w = rand(t, h), rand(t, h), (1 + rng.randn(h, scale=0.1)).to(dtype)
    cases: list[Case] = [
        ("rms_norm", f"{t} x {h}", lambda: ops.rms_norm(x, w, 1e-6), lambda: TORCH_OPS.rms_norm(x, w, 1e-6)),
        (
            "rms_norm + residual",
            f"{t} x {h}",
            lambda: ops.rms_norm(x, w, 1e-6, res),
            lambda: TORCH_OPS.rms_norm(x, w, 1e-6, res),
        ),
    ]
    # rotary: Triton rotates in place, so each side gets its own copy (timed in place, no copy)
    q, k = rand(t, sz.heads, sz.head_dim), rand(t, sz.kv_heads, sz.head_dim)
    inv_freq = 10000 ** -(torch.arange(sz.head_dim // 2, device=device) / (sz.head_dim // 2))
    angles = torch.randint(0, 4096, (t, 1), generator=rng.host).to(device) * inv_freq  # positions x frequencies
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_tr, k_tr = q.clone(), k.clone()  # compared after its first call, then rotated again and again
    cases.append(
        (
            "rotary (in place)",
            f"{t} tokens, H={sz.heads}/{sz.kv_heads} D={sz.head_dim}",
            lambda: ops.rotary(q_tr, k_tr, cos, sin),
            lambda: TORCH_OPS.rotary(q, k, cos, sin),
        )
    )
    gate_up = rand(t, 2 * sz.intermediate)
    cases.append(
        (
            "silu_and_mul",
            f"{t} x 2*{sz.intermediate}",
            lambda: ops.silu_and_mul(gate_up),
            lambda: TORCH_OPS.silu_and_mul(gate_up),
        )
    )
    return cases


def moe_cases(ops: KernelOps, sz: Sizes, dtype, device, rng: Rng) -> list[Case]:
    e, hdim, inter = sz.experts, sz.moe_hidden, sz.moe_intermediate
    w13 = rng.randn(e, 2 * inter, hdim, dtype=dtype, scale=1 / math.sqrt(hdim))
    w2 = rng.randn(e, hdim, inter, dtype=dtype, scale=1 / math.sqrt(inter))
    cases = []
    for t in sz.moe_tokens:
        x = rng.randn(t, hdim, dtype=dtype)
        logits = rng.randn(t, e)
        weights, ids = route_topk(logits, sz.top_k, renormalize=True)
        shape = f"{t} tokens, {e} experts top-{sz.top_k}, H={hdim} I={inter}"
        cases.append(
            (
                f"fused_moe {t} tokens",
                shape,
                lambda x=x, weights=weights, ids=ids: ops.fused_moe(x, w13, w2, weights, ids),
                lambda x=x, weights=weights, ids=ids: TORCH_OPS.fused_moe(x, w13, w2, weights, ids),
            )
        )
    return cases


def all_cases(ops: KernelOps, sz: Sizes, dtype, device, rng):
    """Every case, one kind at a time (so that a kind's inputs are freed before the next's)."""
    yield from attention_cases(ops, sz, dtype, device, rng)
    yield kv_write_case(ops, sz, dtype, device, rng)
    yield from norm_act_rotary_cases(ops, sz, dtype, device, rng)
    yield from moe_cases(ops, sz, dtype, device, rng)


# ---- measuring ----------------------------------------------------------------------------
def as_tensors(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def errors(got, want) -> tuple[float, float]:
    """(max abs difference, that over max |reference|) over all outputs."""
    abs_err, ref_max = 0.0, 0.0
    for g, w in zip(as_tensors(got), as_tensors(want)):
        g, w = g.float(), w.float()
        abs_err = max(abs_err, (g - w).abs().max().item())
        ref_max = max(ref_max, w.abs().max().item())
    return abs_err, abs_err / max(ref_max, 1e-12)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, budget_s: float) -> float:
    """Milliseconds per call of an already warmed-up ``fn``: one call to size the loop, then
    as many as fit in ``budget_s`` (at most 200; none more when one call exceeds it)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    first = time.perf_counter() - t0
    iters = min(200, int(budget_s / max(first, 1e-7)))
    if iters < 2:
        return first * 1e3
    return seconds_per_call(fn, iters, device) * 1e3


def measure(case: Case, dname: str, device: torch.device, budget_s: float) -> dict:
    name, shape, triton_fn, torch_fn = case
    dtype = DTYPES[dname]
    row = {"kernel": name, "dtype": dname, "shape": shape, "tol": TOL[dtype]}
    try:
        t0 = time.perf_counter()
        want = torch_fn()
        got = triton_fn()  # first call: compiles the kernel
        sync(device)
        row["first_call_s"] = time.perf_counter() - t0
        row["max_abs_err"], row["rel_err"] = errors(got, want)
        del got, want
        row["triton_ms"] = time_ms(triton_fn, device, budget_s)
        row["torch_ms"] = time_ms(torch_fn, device, budget_s)
        row["speedup"] = row["torch_ms"] / row["triton_ms"]
        row["ok"] = bool(row["rel_err"] <= TOL[dtype])  # NaN fails
    except Exception as exc:  # one failing case must not hide the others
        traceback.print_exc()
        row["ok"], row["error"] = False, f"{type(exc).__name__}: {exc}"[:200]
    return row


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['kernel']:<48} {r['dtype']:<9} FAIL  {r['error']}", flush=True)
        return
    print(
        f"{r['kernel']:<48} {r['dtype']:<9} {'ok  ' if r['ok'] else 'FAIL'}  max|err| {r['max_abs_err']:.2e} "
        f"(rel {r['rel_err']:.1e} <= {r['tol']:.0e}?)  triton {r['triton_ms']:9.3f} ms  "
        f"torch {r['torch_ms']:9.3f} ms  {r['speedup']:6.2f}x   [{r['shape']}]",
        flush=True,
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
    p.add_argument(
        "--dtypes",
        default=None,
        help="comma-separated, of fp32,fp16,bf16 "
        "(default: fp16,bf16 on a GPU; fp32,fp16 with --cpu: the interpreter has no bf16)",
    )
    p.add_argument("--only", default=None, help="run only the kernels whose name contains this")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds of timed calls per kernel and side (default 0.05 on a GPU, 0 with --cpu: one call)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file")
    args = p.parse_args()
    args.dtypes = (args.dtypes or ("fp32,fp16" if args.cpu else "fp16,bf16")).split(",")
    if bad := [d for d in args.dtypes if d not in DTYPES]:
        p.error(f"unknown dtype(s) {bad}; choose from {list(DTYPES)}")
    if args.time_budget is None:
        args.time_budget = 0.0 if args.cpu else 0.05
    return args


def main() -> int:
    args = parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch; use --cpu for the interpreter dry run")
    device = torch.device("cpu" if args.cpu else "cuda")
    ops = select_ops("triton", device)  # on a CPU: TRITON_INTERPRET=1 before triton is imported
    import triton

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"kernels on {dev_name}: torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows = []
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        rng = Rng(args.seed, device)
        sz = cpu_sizes(rng) if args.cpu else gpu_sizes(rng)
        for case in all_cases(ops, sz, dtype, device, rng):
            if args.only and args.only not in case[0]:
                continue
            row = measure(case, dname, device, args.time_budget)
            print_row(row)
            rows.append(row)
            if args.json:  # after every case, so that a run cut short still leaves its figures
                with open(args.json, "w") as f:
                    json.dump(
                        {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__, "rows": rows},
                        f,
                        indent=2,
                    )
            if device.type == "cuda":
                torch.cuda.empty_cache()
    failed = [f"{r['kernel']} {r['dtype']}" for r in rows if not r["ok"]]
    print(
        f"{len(rows) - len(failed)}/{len(rows)} kernel cases within tolerance"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
