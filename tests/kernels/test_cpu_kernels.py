"""dfllm's compiled CPU kernels (dfllm/kernels/csrc/cpu_ops.cpp) against their PyTorch references.

The kernels are built once per machine (about a minute, then cached); a machine without a C++
compiler cannot build them, and these tests say so instead of passing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dfllm.kernels import _cpu
from dfllm.kernels.backend import TORCH_OPS, select_ops
from dfllm.kernels.encoder_attention import encoder_attention_torch
from dfllm.kernels.logits import exact_top_logits_torch
from dfllm.kernels.metadata import AttentionMetadata

from attention_data import attention_batch, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler: dfllm's CPU kernels cannot be built here", allow_module_level=True)


@pytest.fixture(scope="module")
def cpu_ops():
    ops = select_ops("cpu", torch.device("cpu"))
    assert ops.name == "cpu"
    return ops


MIXED = [(5, 5), (1, 33), (7, 40), (1, 70), (1, 1), (1, 16), (1, 17)]


@pytest.mark.parametrize("dtype", DTYPES)
# groups wider than the decode kernel's value pass takes at once (4 heads of 64, 2 of 128) too
@pytest.mark.parametrize(
    "kv_heads,group,head_dim,bs",
    [(2, 1, 64, 16), (1, 3, 128, 32), (3, 3, 64, 16), (2, 4, 32, 8), (1, 7, 64, 16), (2, 5, 128, 16)],
)
def test_attention_mixed_batch(cpu_ops, dtype, kv_heads, group, head_dim, bs):
    q, k, v, kc, vc, meta = attention_batch(MIXED, kv_heads, group, head_dim, bs, dtype)
    want = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, head_dim**-0.5)
    got = cpu_ops.paged_attention(q, k, v, kc, vc, meta, head_dim**-0.5)
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_bfloat16_decode_scores_take_avx512_bf16_dot_products(cpu_ops, head_dim):
    """bfloat16 queries over a bfloat16 cache: the decode kernel's scores come from vdpbf16ps
    (no widening of the keys) where the CPU has AVX512-BF16, and stay as close to float32
    attention over the same bfloat16 values as the widening path is."""
    available, before, _ = _cpu.load().bf16_dot_stats()
    if not available:
        pytest.skip("this CPU has no AVX512-BF16 (the kernel widens the keys instead)")
    q, k, v, kc, vc, meta = attention_batch(MIXED, 3, 3, head_dim, 16, torch.bfloat16)
    got = cpu_ops.paged_attention(q, k, v, kc, vc, meta, head_dim**-0.5)
    assert _cpu.load().bf16_dot_stats()[1] == before + 1
    exact = TORCH_OPS.paged_attention(q.float(), k.float(), v.float(), kc.float(), vc.float(), meta, head_dim**-0.5)
    rows = meta.decodes.rows
    assert rel_err(got[rows].float(), exact[rows]) < 4e-3  # bfloat16 output rounding (2^-9) and no more


@pytest.mark.parametrize("head_dim", [64, 128, 48])  # 48: the portable loop, not the AVX-512 one
def test_attention_bfloat16_cache_under_float32_queries(cpu_ops, head_dim):
    """kv_cache_dtype="bfloat16": the kernel widens the cached values itself, as the reference's cast does."""
    q, k, v, kc, vc, meta = attention_batch(MIXED, 3, 3, head_dim, 16, torch.float32, seed=11)
    kc, vc = kc.bfloat16(), vc.bfloat16()
    want = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, head_dim**-0.5)
    got = cpu_ops.paged_attention(q, k, v, kc, vc, meta, head_dim**-0.5)
    assert got.dtype == torch.float32
    assert rel_err(got, want) < TOL[torch.float32]
    direct = torch.empty_like(q)  # the decodes went through the kernel, not a fallback to the reference
    d = meta.decodes
    _cpu.load().decode_attention(direct, q, kc, vc, d.rows, d.block_tables, d.seq_lens, head_dim**-0.5, 0, 0.0)
    assert torch.equal(got[d.rows], direct[d.rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_decodes_only_with_strided_queries(cpu_ops, dtype):
    """Queries as the layer hands them over: a view into the fused qkv projection."""
    seqs = [(1, n) for n in (3, 64, 65, 129, 200)]
    q, k, v, kc, vc, meta = attention_batch(seqs, 2, 3, 64, 16, dtype, seed=3)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q_view = qkv[:, : q[0].numel()].view_as(q)
    assert not q_view.is_contiguous()
    want = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, 0.125)
    assert rel_err(cpu_ops.paged_attention(q_view, k, v, kc, vc, meta, 0.125), want) < TOL[dtype]


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_attention_sliding_window_never_reads_freed_blocks(cpu_ops, window):
    seqs = [(1, 90), (6, 30), (1, 33), (1, 7)]
    freed: list[int] = []
    q, k, v, kc, vc, meta = attention_batch(
        seqs, 2, 2, 32, 8, torch.float32, seed=window, freed_before=window, freed=freed
    )
    assert freed or window == 40
    kc[freed] = float("nan")  # a freed block's keys would now be another sequence's
    vc[freed] = float("nan")
    want = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, 0.2, sliding_window=window)
    got = cpu_ops.paged_attention(q, k, v, kc, vc, meta, 0.2, sliding_window=window)
    assert not torch.isnan(want).any() and not torch.isnan(got).any()
    assert rel_err(got, want) < TOL[torch.float32]
    if window == 1:  # each decode sees only its own new key: the output is its own value
        rows = meta.decodes.rows
        assert torch.allclose(got[rows], v[rows].repeat_interleave(2, dim=1))


PREFILLS = [(40, 40), (70, 200), (23, 23), (2, 9), (1, 50), (130, 130), (3, 3), (1, 7)]


def prefill_rows(meta: AttentionMetadata) -> torch.Tensor:
    return torch.cat([torch.arange(p.q_start, p.q_start + p.q_len) for p in meta.prefills])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kv_heads,group,head_dim,bs", [(3, 3, 64, 16), (2, 1, 128, 16), (1, 8, 32, 32), (2, 16, 64, 8), (1, 5, 64, 16)]
)
def test_prefill_kernel_spans_tiles_and_cached_prefixes(cpu_ops, dtype, kv_heads, group, head_dim, bs):
    """Prefill spans longer than a tile (64 rows: 64 / group queries), over a cached prefix or
    none, beside decodes: the same attention as the reference's SDPA per span."""
    q, k, v, kc, vc, meta = attention_batch(PREFILLS, kv_heads, group, head_dim, bs, dtype, seed=group)
    want = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, head_dim**-0.5)
    got = cpu_ops.paged_attention(q, k, v, kc, vc, meta, head_dim**-0.5)
    assert rel_err(got, want) < TOL[dtype]
    # the prefills went through the kernel (not the reference's path): it writes their rows alone
    direct = torch.full_like(q, float("nan"))
    _cpu.load().prefill_attention(
        direct, q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, head_dim**-0.5, 0
    )
    rows = prefill_rows(meta)
    assert torch.equal(got[rows], direct[rows])
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.isnan(direct[others]).all()


@pytest.mark.parametrize("window", [1, 7, 16, 33])
def test_prefill_kernel_sliding_window_never_reads_before_it(cpu_ops, window):
    """A prefill chunk at positions 80-89 with a window: keys before its first query's window
    (whose blocks the block manager may have freed, here filled with NaN) are never read."""
    seqs = [(10, 90), (12, 12), (1, 40)]
    q, k, v, kc, vc, meta = attention_batch(seqs, 2, 3, 64, 8, torch.float32, seed=window)
    first = meta.block_tables[0].tolist()
    dead = (90 - 10 - window + 1) // 8  # blocks wholly before the first query's window
    kc[first[:dead]] = float("nan")
    vc[first[:dead]] = float("nan")
    want = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, 0.125, sliding_window=window)
    got = cpu_ops.paged_attention(q, k, v, kc, vc, meta, 0.125, sliding_window=window)
    assert dead > 0 and not torch.isnan(got).any()
    assert rel_err(got, want) < TOL[torch.float32]
    if window == 1:  # each query sees only its own key: the output is its own value
        rows = prefill_rows(meta)
        assert torch.allclose(got[rows], v[rows].repeat_interleave(3, dim=1))


BF16_PREFILL_CASES = [
    (3, 3, 64, 16, 0),
    (2, 1, 128, 16, 0),
    (1, 8, 32, 32, 0),
    (2, 16, 64, 8, 0),
    (1, 5, 64, 16, 0),
    (2, 3, 64, 8, 7),
]


def bf16_prefill_case(ext, kv_heads, group, head_dim, bs, window):
    """A bfloat16 prefill batch (short chunks: blocks of 8, a block's last keys; a sliding
    window whose dead blocks hold NaN) as (q, k cache, v cache, run), run(q, kc, vc) giving the
    prefill kernel's rows as float32."""
    seqs = PREFILLS + [(10, 90)]
    q, k, v, kc, vc, meta = attention_batch(seqs, kv_heads, group, head_dim, bs, torch.bfloat16, seed=group)
    if window:
        first = meta.block_tables[len(seqs) - 1].tolist()  # the chunk at positions 80-89
        dead = (90 - 10 - window + 1) // bs
        kc[first[:dead]] = float("nan")
        vc[first[:dead]] = float("nan")
    rows = prefill_rows(meta)

    def run(q, kc, vc) -> torch.Tensor:
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)
        ext.prefill_attention(
            out, q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, head_dim**-0.5, window
        )
        return out[rows].float()

    return q, kc, vc, run


def assert_as_close_as_the_loop(fast, loop, exact):
    """A bfloat16 scores path (AMX, AVX512-BF16) against the float32 loop: the loop is float32's
    result rounded once; the fast path rounds a few outputs the other way and has the same error."""
    assert not fast.isnan().any()
    assert torch.equal(loop, exact.bfloat16().float())
    assert (fast != loop).float().mean() < 2e-3
    err = {
        name: ((got - exact).abs().sum() / exact.abs().sum()).item() for name, got in [("fast", fast), ("loop", loop)]
    }
    assert err["fast"] < 1.01 * err["loop"], err


@pytest.mark.parametrize("kv_heads,group,head_dim,bs,window", BF16_PREFILL_CASES)
def test_prefill_kernel_bfloat16_scores_on_amx_tiles(cpu_ops, kv_heads, group, head_dim, bs, window):
    """bfloat16 queries over a bfloat16 cache: where the CPU has AMX, the prefill kernel's
    scores come from its tiles (the calls say so), and the attention is as close to the float32
    computation over the same bfloat16 values as the AVX-512 loop's: the same error against it,
    to within a few outputs that round to the neighbouring bfloat16."""
    ext = _cpu.load()
    available, before = ext.amx_stats()
    if not available:
        pytest.skip("no AMX here (or the OS refuses its tiles): the prefill scores take the AVX-512 loop")
    q, kc, vc, prefill = bf16_prefill_case(ext, kv_heads, group, head_dim, bs, window)
    amx = prefill(q, kc, vc)
    assert ext.amx_stats()[1] == before + 1
    was, dot_was = ext.set_amx(False), ext.set_bf16_dot(False)
    try:
        loop = prefill(q, kc, vc)
    finally:
        ext.set_amx(was)
        ext.set_bf16_dot(dot_was)
    assert ext.amx_stats()[1] == before + 1  # switched off: the loop
    assert_as_close_as_the_loop(amx, loop, prefill(q.float(), kc.float(), vc.float()))


@pytest.mark.parametrize("kv_heads,group,head_dim,bs,window", BF16_PREFILL_CASES)
def test_prefill_kernel_bfloat16_scores_from_avx512_bf16_dot_products(cpu_ops, kv_heads, group, head_dim, bs, window):
    """bfloat16 queries over a bfloat16 cache, AMX off or absent: where the CPU has AVX512-BF16,
    the prefill kernel's scores come from vdpbf16ps (the calls say so), as close to the float32
    computation over the same bfloat16 values as the float32 loop's, as on AMX."""
    ext = _cpu.load()
    available, _, before = ext.bf16_dot_stats()
    if not available:
        pytest.skip("no AVX512-BF16 here: the prefill scores take the float32 loop")
    q, kc, vc, prefill = bf16_prefill_case(ext, kv_heads, group, head_dim, bs, window)
    amx_was = ext.set_amx(False)
    try:
        dot = prefill(q, kc, vc)
        assert ext.bf16_dot_stats()[2] == before + 1
        dot_was = ext.set_bf16_dot(False)
        try:
            loop = prefill(q, kc, vc)
        finally:
            ext.set_bf16_dot(dot_was)
    finally:
        ext.set_amx(amx_was)
    assert ext.bf16_dot_stats()[2] == before + 1  # switched off: the loop
    assert_as_close_as_the_loop(dot, loop, prefill(q.float(), kc.float(), vc.float()))


def test_prefill_kernel_bfloat16_cache_under_float32_queries_and_strided_queries(cpu_ops):
    q, k, v, kc, vc, meta = attention_batch(PREFILLS, 3, 3, 64, 16, torch.float32, seed=4)
    kc, vc = kc.bfloat16(), vc.bfloat16()
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q_view = qkv[:, : q[0].numel()].view_as(q)  # as the layer hands it over: a view of the fused projection
    want = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, 0.125)
    got = cpu_ops.paged_attention(q_view, k, v, kc, vc, meta, 0.125)
    assert rel_err(got, want) < TOL[torch.float32]


def test_attention_softcap(cpu_ops):
    q, k, v, kc, vc, meta = attention_batch(MIXED, 2, 2, 64, 16, torch.float32, seed=5)
    q = q * 8  # large scores, so that the cap matters
    want = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, 0.125, softcap=5.0)
    got = cpu_ops.paged_attention(q, k, v, kc, vc, meta, 0.125, softcap=5.0)
    uncapped = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, 0.125)
    assert rel_err(got, want) < 1e-5
    assert rel_err(uncapped, want) > 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(cpu_ops, dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3 * 96, generator=g).to(dtype)[:, 96:192]  # rows with a stride, as views are
    weight = torch.randn(96, generator=g).to(dtype)
    residual = torch.randn(37, 96, generator=g).to(dtype) if with_residual else None
    want = TORCH_OPS.rms_norm(x, weight, 1e-6, residual)
    got = cpu_ops.rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the sum is rounded like PyTorch's
        got, want = got[0], want[0]
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head(cpu_ops, dtype):
    """Qwen3's q/k norm: [tokens, heads, head_dim] normalised over head_dim."""
    x = torch.randn(5, 4, 32).to(dtype)
    weight = torch.rand(32).to(dtype)
    assert rel_err(cpu_ops.rms_norm(x, weight, 1e-6), TORCH_OPS.rms_norm(x, weight, 1e-6)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
# sixteen lanes at a time only, then a scalar tail, the tail only, then sixteen, eight and a tail
@pytest.mark.parametrize("width", [80, 83, 5, 27])
def test_silu_and_mul(cpu_ops, dtype, width):
    x = (torch.randn(21, 2 * width) * 4).to(dtype)
    x[3, 1], x[4, 2], x[5, width + 3] = float("nan"), float("inf"), -float("inf")
    got, want = cpu_ops.silu_and_mul(x), TORCH_OPS.silu_and_mul(x)
    assert torch.equal(got.isnan(), want.isnan())
    finite = want.isfinite()
    assert torch.equal(got[~finite & ~want.isnan()], want[~finite & ~want.isnan()])
    assert rel_err(got[finite], want[finite]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_lanes_equal_the_scalar_tail(cpu_ops, dtype):
    """The sixteen-lane vectors, the eight-lane one and the scalar loop of a row's tail take the
    same steps: each (gate, up) pair gives the same bits wherever in a row it lies."""
    width = 27  # lanes 0-15 in sixteen, 16-23 in eight, 24-26 in the tail
    gate, up = (torch.randn(width) * 6).to(dtype), torch.randn(width).to(dtype)
    x = torch.stack([torch.cat([gate.roll(r), up.roll(r)]) for r in range(width)])  # every pair at every place
    out = cpu_ops.silu_and_mul(x)
    for r in range(width):
        assert torch.equal(out[r].roll(-r), out[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_on_views_of_qkv(cpu_ops, dtype):
    tokens, heads, kv_heads, d = 9, 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d).to(dtype)
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d)
    angles = torch.arange(tokens)[:, None] * torch.rand(d // 2)[None, :] * 3
    cos, sin = angles.cos(), angles.sin()
    want_q, want_k = TORCH_OPS.rotary(q, k, cos, sin)
    got_q, got_k = cpu_ops.rotary(q, k, cos, sin)
    assert rel_err(got_q, want_q) < TOL[dtype] and rel_err(got_k, want_k) < TOL[dtype]


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.bfloat16),
    ],
)
def test_write_kv_cache_skips_padding_and_takes_views(cpu_ops, dtype, cache_dtype):
    """Keys and values as the layer hands them over (a view of the fused projection), padding
    slots (-1) left alone, a float32 step into a bfloat16 cache rounded as ``.to`` does."""
    g = torch.Generator().manual_seed(1)
    tokens, kv_heads, d = 11, 2, 32
    qkv = torch.randn(tokens, 5 * kv_heads * d, generator=g).to(dtype)
    key = qkv[:, 3 * kv_heads * d : 4 * kv_heads * d].view(tokens, kv_heads, d)
    value = qkv[:, 4 * kv_heads * d :].view(tokens, kv_heads, d)
    slots = torch.randperm(6 * 4, generator=g)[:tokens]
    slots[[2, 7]] = -1
    fill = torch.randn(6, 4, kv_heads, d, generator=g).to(cache_dtype)
    want, got = (fill.clone(), fill.clone()), (fill.clone(), fill.clone())
    TORCH_OPS.write_kv_cache(key, value, *want, slots)
    cpu_ops.write_kv_cache(key, value, *got, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(got[0], fill)
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu_ops.write_kv_cache(key, value, *got, torch.full((tokens,), 6 * 4))


def test_bfloat16_rounding_matches_torch_on_ties_nan_inf_and_overflow(cpu_ops):
    """The kernels narrow float32 to bfloat16 with their own vectorised integer code (c10's is
    scalar): it must round exactly as ``.to(torch.bfloat16)`` does, ties to even, NaN kept,
    float32's largest values carried to infinity, subnormals rounded too."""
    bits = torch.tensor(
        [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000,
         0x7FC00001, 0xFFA00000, 0x00008000, 0x00018000, 0x80000000, 0x00000000, 0x7F7F8000, 0x3F7FFFFF],
        dtype=torch.int64,
    ).to(torch.int32)  # fmt: skip
    special = bits.view(torch.float32)
    values = torch.cat([special, torch.randn(48) * 1e3])  # 64 values: one token of 2 heads of 32
    key = values.view(1, 2, 32)
    got = (torch.zeros(2, 4, 2, 32, dtype=torch.bfloat16), torch.zeros(2, 4, 2, 32, dtype=torch.bfloat16))
    cpu_ops.write_kv_cache(key, key, *got, torch.tensor([5]))
    want = key.to(torch.bfloat16)[0]
    assert_same_bfloat16(got[0][1, 1], want)
    # and the residual sum of a bfloat16 norm, rounded from float32 the same way
    x = special.to(torch.bfloat16).view(1, 16)
    r = torch.full((1, 16), 2.0**-9, dtype=torch.bfloat16)  # half an ulp of 1.0: ties
    _, total = cpu_ops.rms_norm(x, torch.ones(16, dtype=torch.bfloat16), 1e-6, r)
    assert_same_bfloat16(total, x + r)


def assert_same_bfloat16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, except that a NaN only has to be a NaN (torch's own vectorised and scalar
    conversions give NaNs different payloads)."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("width", [1, 15, 16, 17, 49152 + 5])
def test_argmax_rows_matches_torch_ties_nan_and_inf_included(cpu_ops, width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(12, width + 3, generator=g)[:, 2 : 2 + width]  # rows with a stride, as row slices are
    last = width - 1
    x[1, last] = 50.0  # the maximum in the tail past the last full vector
    x[2, :] = float("-inf")
    x[3, min(3, last)] = x[3, last] = 100.0  # a tie: the first one wins
    x[4, last] = float("nan")
    x[5, min(1, last)] = float("inf")
    x[5, last] = float("nan")  # a NaN after a +inf: the NaN wins, as in torch
    x[6, :] = 7.0
    x[7, last // 2] = float("inf")
    assert not x.is_contiguous()
    _cpu.load()  # argmax_rows_cpu never starts a build; the fixture built the kernels
    got = _cpu.argmax_rows_cpu(x)
    assert _cpu.loaded() and got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))
    # coded: -1 exactly where torch.amax is not finite (rows 2, 4, 5, 7), the argmax elsewhere
    coded = _cpu.argmax_rows_cpu(x, code_non_finite=True)
    want = torch.where(torch.isfinite(x.amax(dim=-1)), x.argmax(dim=-1), -1)
    assert torch.equal(coded, want) and (coded == -1).nonzero().flatten().tolist() == [2, 4, 5, 7]
    assert torch.equal(_cpu.argmax_rows_cpu(x.double(), code_non_finite=True), want)  # torch's path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(4))
def test_exact_top_logits_matches_the_reference_and_float32s_argmax(cpu_ops, dtype, seed):
    """A reduced-precision LM head's logits, widened with the leading entries recomputed in
    float32: the kernel equals the reference, the argmax is the float32 product's (the rounded
    logits' often is not: near ties), and rows with NaN or infinities are only widened."""
    g = torch.Generator().manual_seed(seed)
    rows, h, vocab = 9, 64, 4099
    hidden = (torch.randn(rows, h, generator=g) * 3).to(dtype)
    weight = torch.randn(vocab, h, generator=g).to(dtype)
    # near ties: copies of the leading rows of the weight, nudged by less than a rounding step
    exact = hidden.float() @ weight.float().T
    for r in range(rows):
        j = int(exact[r].argmax())
        for k in range(1, 6):
            weight[(j + 97 * k) % vocab] = (weight[j].float() * (1 + (-1) ** k * 1e-3 * k)).to(dtype)
    exact = hidden.float() @ weight.float().T
    logits = (hidden @ weight.T).to(dtype)
    logits[1, 5] = float("nan")
    logits[2, :] = float("-inf")
    logits[3, 7] = float("inf")
    want = exact_top_logits_torch(logits, hidden, weight)
    _cpu.load()
    got = _cpu.exact_top_logits_cpu(logits, hidden, weight)
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    special = torch.tensor([1, 2, 3])
    torch.testing.assert_close(got[special], logits[special].float(), rtol=0, atol=0, equal_nan=True)
    plain = torch.tensor([0, 4, 5, 6, 7, 8])
    assert torch.equal(got[plain].argmax(-1), exact[plain].argmax(-1))


@pytest.mark.parametrize(
    "lengths",
    [[5, 17, 1, 33, 16], [24, 24, 24], [1], [200, 3]],
    ids=["mixed", "equal", "one-token", "long-and-short"],
)
@pytest.mark.parametrize("heads,head_dim", [(12, 32), (4, 64), (2, 128)])
def test_encoder_attention_matches_padded_sdpa(cpu_ops, lengths, heads, head_dim):
    """The encoders' attention over unpadded sequences: the kernel (which reads q, k and v in
    place from the fused projection's rows, here a strided view) against SDPA over the
    sequences padded with a key mask; the call counter proves the kernel ran."""
    g = torch.Generator().manual_seed(len(lengths) * head_dim)
    hidden = heads * head_dim
    qkv = torch.randn(sum(lengths), 3 * hidden + 8, generator=g)[:, 4 : 4 + 3 * hidden]
    assert qkv.stride(0) != qkv.shape[1]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    before = _cpu.encoder_attention_count()
    got = _cpu.encoder_attention_cpu(qkv, cu_seqlens, heads)
    assert _cpu.encoder_attention_count() == before + 1
    want = encoder_attention_torch(qkv, cu_seqlens, heads)
    assert got.shape == (sum(lengths), hidden)
    assert rel_err(got, want) < TOL[torch.float32]
    # each sequence alone: no token attends across a sequence's end
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        alone = _cpu.encoder_attention_cpu(qkv[start:end], torch.tensor([0, end - start]), heads)
        assert rel_err(got[start:end], alone) < TOL[torch.float32]


def test_encoder_attention_spreads_a_nan_key_to_its_own_head_and_sequence_only(cpu_ops):
    """A NaN score is not taken for a hidden key (weight 0, as -inf is): like the reference,
    the kernel's output is NaN for every query of that sequence and head, and exact elsewhere."""
    heads, head_dim, lengths = 12, 32, [5, 40]
    hidden = heads * head_dim
    qkv = torch.randn(sum(lengths), 3 * hidden, generator=torch.Generator().manual_seed(3))
    qkv[5 + 17, hidden + 2 * head_dim + 3] = float("nan")  # sequence 1's key 17, head 2
    cu_seqlens = torch.tensor([0, 5, 45])
    got = _cpu.encoder_attention_cpu(qkv, cu_seqlens, heads).view(-1, heads, head_dim)
    want = encoder_attention_torch(qkv, cu_seqlens, heads).view(-1, heads, head_dim)
    poisoned = torch.zeros_like(got, dtype=torch.bool)
    poisoned[5:, 2] = True
    assert torch.equal(want.isnan(), poisoned)
    assert torch.equal(got.isnan(), poisoned)
    assert rel_err(got[~poisoned], want[~poisoned]) < TOL[torch.float32]


def test_encoder_attention_falls_back_to_the_reference_off_its_head_sizes(cpu_ops):
    qkv, cu_seqlens = torch.randn(7, 3 * 2 * 24), torch.tensor([0, 3, 7])
    before = _cpu.encoder_attention_count()
    got = _cpu.encoder_attention_cpu(qkv, cu_seqlens, 2)  # head size 24
    assert _cpu.encoder_attention_count() == before
    assert torch.equal(got, encoder_attention_torch(qkv, cu_seqlens, 2))


def test_auto_picks_the_cpu_kernels_and_torch_forces_the_references():
    assert select_ops("auto", torch.device("cpu")).name == "cpu"
    assert select_ops("torch", torch.device("cpu")) is TORCH_OPS
    assert _cpu.available()


def test_a_killed_builds_lock_is_cleared_a_live_ones_is_kept(tmp_path):
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    _cpu._clear_stale_lock(tmp_path)
    assert lock.exists()
    old = time.time() - 2 * _cpu.STALE_LOCK_S
    os.utime(lock, (old, old))
    _cpu._clear_stale_lock(tmp_path)
    assert not lock.exists()


def test_the_build_is_named_by_what_it_is_built_from_not_where():
    """Two installs of the same dfllm (two clones, two virtual environments) share one build:
    its name hashes the source's content, torch's version and the flags, and the loaded
    library is that build's, whichever path the source was found at."""
    from dfllm.kernels import _cpu

    flags = ["-O3"]
    name = _cpu.build_name("avx2", flags)
    assert name == _cpu.build_name("avx2", list(flags)) and name.startswith("dfllm_cpu_ops_avx2_")
    assert _cpu.build_name("avx2", ["-O2"]) != name and _cpu.build_name("avx512", flags) != name
    module = _cpu.load()
    if module is None:
        pytest.skip("no C++ compiler here: the PyTorch references run")
    built = Path(module.__file__)
    assert built.parent.name == built.stem and built.stem.startswith("dfllm_cpu_ops_")
    assert (built.parent / _cpu.SOURCE.name).read_bytes() == _cpu.SOURCE.read_bytes()  # built from its own copy
