"""dfllm's bfloat16 GEMM (``bf16_gemm`` in csrc/cpu_ops.cpp, :mod:`dfllm.kernels.gemm`): float32
accumulation of bfloat16 products, rounded once, so equal to its PyTorch reference up to one
unit in the last place where the order of the float32 additions decides; and equal to
oneDNN's bfloat16 GEMM (the same instructions) on nearly every entry."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dfllm.kernels import _cpu
from dfllm.kernels.backend import cpu_bf16_gemm, cpu_bf16_gemm_available, cpu_bf16_gemm_pack
from dfllm.kernels.gemm import bf16_linear_torch

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler: dfllm's CPU kernels cannot be built here", allow_module_level=True)
if not cpu_bf16_gemm_available():
    pytest.skip("this CPU has no AVX512-BF16: dfllm's bfloat16 GEMM does not run here", allow_module_level=True)


def assert_within_one_ulp(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Each entry of ``got`` is the reference's or a neighbour of it: within a bfloat16 unit in
    the last place of the reference, plus what float32 accumulation in another order can move
    (a few float32 units of the sum of the products' magnitudes)."""
    want = bf16_linear_torch(x, w, bias).float()
    magnitude = x.float().abs() @ w.float().abs().T + (0 if bias is None else bias.float().abs())
    bound = want.abs() * 2.0**-7 + magnitude * x.shape[1] * 2.0**-22 + 1e-30
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert bool(((got.float() - want).abs() <= bound).all())


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    m=st.integers(0, 40),
    k=st.integers(1, 300),
    n=st.integers(1, 200),
    bias=st.booleans(),
    pad=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_gemm_equals_the_reference_for_any_shape(m, k, n, bias, pad, seed):
    """Any row count (tiles of 6 and their tails, none), any k (odd: padded to a pair), any n
    (panels of 64 and a partial last one), with and without a bias, rows strided in a wider tensor."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k + pad, generator=g) * 2).to(torch.bfloat16)[:, :k]
    w = (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    got = cpu_bf16_gemm(x, cpu_bf16_gemm_pack(w), b, n)
    assert_within_one_ulp(got, x, w, b)


@pytest.mark.parametrize("m", [1, 6, 64, 257])
def test_gemm_takes_leading_dimensions_and_model_shapes(m):
    torch.manual_seed(m)
    x = torch.randn(m, 3, 576).to(torch.bfloat16)
    w = (torch.randn(960, 576) * 0.02).to(torch.bfloat16)
    got = cpu_bf16_gemm(x, cpu_bf16_gemm_pack(w), None, 960)
    assert got.shape == (m, 3, 960)
    assert_within_one_ulp(got.reshape(-1, 960), x.reshape(-1, 576), w, None)


@pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="no oneDNN bfloat16 GEMM here",
)
def test_gemm_equals_onednns_bfloat16_gemm_on_nearly_every_entry():
    torch.manual_seed(0)
    x = torch.randn(64, 1536).to(torch.bfloat16)
    w = (torch.randn(576, 1536) * 0.02).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    got = cpu_bf16_gemm(x, cpu_bf16_gemm_pack(w), None, 576)
    assert (got == onednn).float().mean().item() > 0.999


def test_non_finite_inputs_reach_their_own_rows_and_columns_only():
    torch.manual_seed(1)
    x = torch.randn(9, 70).to(torch.bfloat16)
    w = (torch.randn(130, 70) * 0.1).to(torch.bfloat16)
    x[2, 5], x[7, 69] = float("nan"), float("inf")
    w[100, 3] = float("-inf")
    got, want = cpu_bf16_gemm(x, cpu_bf16_gemm_pack(w), None, 130), bf16_linear_torch(x, w)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got[got.isinf()], want[want.isinf()])


def test_bad_operands_are_refused_not_misread():
    w = torch.randn(8, 6).to(torch.bfloat16)
    packed = cpu_bf16_gemm_pack(w)
    ext = _cpu.load()
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.bf16_gemm(torch.randn(2, 6), packed, None, 8)
    with pytest.raises(RuntimeError, match="layout"):
        ext.bf16_gemm(torch.randn(2, 8).to(torch.bfloat16), packed, None, 8)
