"""The Triton kernels against their PyTorch references, on tiny random shapes.

Without a GPU they run in Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``); on a
CUDA machine they run compiled, and bfloat16 is tested too.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dfllm.kernels.backend import TORCH_OPS, select_ops

from attention_data import attention_batch, rel_err

CUDA = torch.cuda.is_available()
DEVICES = (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + (["cuda"] if CUDA else [])
DTYPES = [torch.float32, torch.float16] + (
    [
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(not CUDA, reason="the Triton interpreter does not support bfloat16"),
        )
    ]
)
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}

pytestmark = pytest.mark.parametrize("device", DEVICES)


def _skip_bf16_off_cuda(device: str, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and device != "cuda":
        pytest.skip("bfloat16 only on a GPU")


@pytest.fixture
def triton_ops(device):
    return select_ops("triton", torch.device(device))


# ---- paged attention ----------------------------------------------------------------------


# (q_len, seq_len): a fresh prefill, a prefill chunk over a cached prefix, two decodes.
MIXED = [(5, 5), (7, 40), (1, 33), (1, 70)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kv_heads,group,head_dim,block_size",
    [
        (2, 1, 64, 16),
        (1, 3, 128, 32),
        (1, 8, 64, 16),
    ],
)
def test_paged_attention_mixed_batch(device, triton_ops, dtype, kv_heads, group, head_dim, block_size):
    _skip_bf16_off_cuda(device, dtype)
    q, k, v, kc, vc, meta = attention_batch(MIXED, kv_heads, group, head_dim, block_size, dtype, device)
    want = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, head_dim**-0.5)
    got = triton_ops.paged_attention(q, k, v, kc, vc, meta, head_dim**-0.5)
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_long_chunk(device, triton_ops, dtype):
    """Chunks longer than 16 queries take the 64-row query tiles."""
    _skip_bf16_off_cuda(device, dtype)
    seqs = [(20, 52), (3, 3), (1, 17), (18, 18)]
    q, k, v, kc, vc, meta = attention_batch(seqs, 2, 3, 64, 16, dtype, device, seed=7)
    want = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, 0.125)
    got = triton_ops.paged_attention(q, k, v, kc, vc, meta, 0.125)
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_segments", [None, 4])
def test_paged_attention_split_kv_decode(device, triton_ops, dtype, num_segments):
    from dfllm.kernels._triton_paged_attention import paged_attention_launch

    _skip_bf16_off_cuda(device, dtype)
    seqs = [(1, 150), (1, 9), (1, 97)]
    q, k, v, kc, vc, meta = attention_batch(seqs, 1, 3, 64, 16, dtype, device, seed=1)
    want = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, 0.125)
    got = paged_attention_launch(q, kc, vc, meta, 0.125, num_segments=num_segments)
    assert rel_err(got, want) < TOL[dtype]


def test_paged_attention_split_kv_mixed_and_unknown_maxima(device, triton_ops):
    """Flash decoding over a batch with a prefill chunk; maxima left for the kernel to find."""
    from dfllm.kernels._triton_paged_attention import paged_attention_launch

    q, k, v, kc, vc, meta = attention_batch([(1, 60), (6, 45)], 2, 1, 64, 32, torch.float32, device, seed=2)
    meta.max_query_len = meta.max_seq_len = 0
    want = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, 0.125)
    got = paged_attention_launch(q, kc, vc, meta, 0.125, num_segments=2)
    assert rel_err(got, want) < 1e-5


# ---- KV-cache write, norm, rotary, activation ----------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_skips_padding(device, triton_ops, dtype):
    _skip_bf16_off_cuda(device, dtype)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(9, 2, 3, 64, generator=g).to(dtype).to(device)  # [T, k|v, kv_heads, d], non-contiguous k/v
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(4 * 16, generator=g)[:9]
    slots[[2, 7]] = -1
    slots = slots.to(device)
    caches = [torch.randn(4, 16, 3, 64, generator=g).to(dtype).to(device) for _ in range(2)]
    want = [c.clone() for c in caches]
    TORCH_OPS.write_kv_cache(key, value, *want, slots)
    triton_ops.write_kv_cache(key, value, *caches, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(device, triton_ops, dtype, with_residual):
    _skip_bf16_off_cuda(device, dtype)
    g = torch.Generator().manual_seed(4)
    x, res = (torch.randn(7, 96, generator=g).to(dtype).to(device) for _ in range(2))
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype).to(device)
    args = (x, w, 1e-6) + ((res,) if with_residual else ())
    want, got = TORCH_OPS.rms_norm(*args), triton_ops.rms_norm(*args)
    if with_residual:
        assert rel_err(got[1], want[1]) < TOL[dtype]
        want, got = want[0], got[0]
    assert got.dtype == want.dtype and rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place(device, triton_ops, dtype):
    _skip_bf16_off_cuda(device, dtype)
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, d, t = 6, 2, 64, 5
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype).to(device)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(t, heads, d), k.view(t, kv_heads, d)  # strided views, as in the model
    angles = torch.rand(t, d // 2, generator=g) * 6
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    want_q, want_k = TORCH_OPS.rotary(q.clone(), k.clone(), cos, sin)
    got_q, got_k = triton_ops.rotary(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()
    assert rel_err(q, want_q) < TOL[dtype] and rel_err(k, want_k) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(device, triton_ops, dtype):
    _skip_bf16_off_cuda(device, dtype)
    x = torch.randn(6, 2 * 80, generator=torch.Generator().manual_seed(6)).to(dtype).to(device)
    want, got = TORCH_OPS.silu_and_mul(x), triton_ops.silu_and_mul(x)
    assert got.shape == want.shape and rel_err(got, want) < TOL[dtype]


# ---- backend selection ------------------------------------------------------------------------


def test_select_ops(device):
    assert select_ops("auto", torch.device("cpu")).name == "cpu"  # dfllm's compiled CPU kernels
    assert select_ops("torch", torch.device(device)).name == "torch"
    assert select_ops("triton", torch.device(device)).name == "triton"
    assert select_ops("auto", torch.device("cuda")).name == "triton"
    with pytest.raises(ValueError):
        select_ops("flash", torch.device(device))


@pytest.mark.slow
def test_import_dfllm_does_not_import_triton(device):
    code = "import sys, dfllm, dfllm.llm; assert 'triton' not in sys.modules"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.slow
def test_triton_imported_without_interpreter_is_a_clear_error(device):
    code = (
        "import triton, torch\n"
        "from dfllm.kernels.backend import select_ops\n"
        "try:\n    select_ops('triton', torch.device('cpu'))\n"
        "except RuntimeError as e:\n    assert 'TRITON_INTERPRET=1' in str(e)\n"
        "else:\n    raise SystemExit('no error')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
