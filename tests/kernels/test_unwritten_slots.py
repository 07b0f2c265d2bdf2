"""Attention reads no slot of the paged KV cache that its sequence has not written.

The engine hands blocks out without clearing them, as vLLM does: a slot past a sequence's
length (in its last block, in a decode group's padding with that block, in a block a sliding
window released) holds whatever the memory held: never-written memory, or a previous
owner's keys and values, NaN where that owner's model output went non-finite. So every
attention path must give, bit for bit, the output it gives with those slots zero: the
PyTorch references (which gather whole blocks and zero what the mask hides), dfllm's CPU
kernels, the Triton kernel (through its interpreter on a CPU) and MLA's latent attention.
Each batch is drawn by hypothesis: decodes and prefill chunks over cached prefixes, block
sizes, head layouts, a sliding window with its released blocks, soft-capping.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dfllm.kernels.backend import TORCH_OPS, select_ops
from dfllm.models.mla import mla_attention_torch

from attention_data import attention_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch"]
if DEVICE == "cpu" and (shutil.which("c++") or shutil.which("g++")):
    BACKENDS.append("cpu")
if os.environ.get("TRITON_INTERPRET") == "1" or DEVICE == "cuda":
    BACKENDS.append("triton")
POISON = [float("nan"), float("inf"), float("-inf")]


@st.composite
def batches(draw, max_seqs: int = 5, max_len: int = 60):
    """(q_len, seq_len) per sequence: a decode (q_len 1) or a prefill chunk, fresh or over a
    cached prefix."""
    seqs = []
    for _ in range(draw(st.integers(1, max_seqs))):
        seq_len = draw(st.integers(1, max_len))
        q_len = 1 if draw(st.booleans()) else draw(st.integers(1, seq_len))
        seqs.append((q_len, seq_len))
    return seqs


def written(meta, seqs, block_size: int, num_blocks: int) -> torch.Tensor:
    """A mask ``[num_blocks, block_size]``: True at the slots some sequence wrote (positions
    before its length, in blocks its table still holds)."""
    mask = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    tables = meta.block_tables.cpu()
    for i, (_, seq_len) in enumerate(seqs):
        for pos in range(seq_len):
            block = int(tables[i, pos // block_size])
            if block >= 0:
                mask[block, pos % block_size] = True
    return mask


def poisoned(cache: torch.Tensor, seen: torch.Tensor, value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache`` with its unwritten slots zero, and with them ``value``."""
    hide = ~seen.to(cache.device)
    return cache.masked_fill(hide[..., None, None], 0.0), cache.masked_fill(hide[..., None, None], value)


def ops_for(name: str):
    return TORCH_OPS if name == "torch" else select_ops(name, torch.device(DEVICE))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=batches(),
    block_size=st.sampled_from([4, 8, 16]),
    heads=st.sampled_from([(2, 1, 32), (1, 3, 64), (2, 2, 32)]),
    window=st.one_of(st.none(), st.integers(1, 24)),
    softcap=st.sampled_from([None, 5.0]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    poison=st.sampled_from(POISON),
    seed=st.integers(0, 2**16),
)
def test_unwritten_slots_change_no_output(backend, seqs, block_size, heads, window, softcap, dtype, poison, seed):
    if backend == "triton" and DEVICE == "cpu":  # the interpreter is slow: short batches only
        seqs = seqs[:3]
    kv_heads, group, head_dim = heads
    q, k, v, kc, vc, meta = attention_batch(
        seqs, kv_heads, group, head_dim, block_size, dtype, DEVICE, seed=seed, freed_before=window
    )
    seen = written(meta, seqs, block_size, kc.shape[0])
    ops = ops_for(backend)
    scale = head_dim**-0.5
    (kc0, kcx), (vc0, vcx) = poisoned(kc, seen, poison), poisoned(vc, seen, poison)
    want = ops.paged_attention(q, k, v, kc0, vc0, meta, scale, window, softcap)
    got = ops.paged_attention(q, k, v, kcx, vcx, meta, scale, window, softcap)
    assert torch.isfinite(want).all()
    assert torch.equal(got, want)


@settings(max_examples=25, deadline=None)
@given(
    seqs=batches(),
    block_size=st.sampled_from([4, 8, 16]),
    poison=st.sampled_from(POISON),
    seed=st.integers(0, 2**16),
)
def test_unwritten_latents_change_no_mla_output(seqs, block_size, poison, seed):
    heads, nope, rope, rank, v_dim = 3, 16, 8, 24, 16
    q, k, _, kc, _, meta = attention_batch(seqs, 1, 1, rank + rope, block_size, torch.float32, DEVICE, seed=seed)
    seen = written(meta, seqs, block_size, kc.shape[0])
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q.shape[0], heads, nope + rope, generator=g).to(DEVICE)
    kv_b = (torch.randn(heads * (nope + v_dim), rank, generator=g) * 0.2).to(DEVICE)
    clean, dirty = poisoned(kc, seen, poison)
    args = (meta, (nope + rope) ** -0.5, nope, v_dim)
    want = mla_attention_torch(q, k[:, 0], clean, kv_b, *args)  # the cache as the engine holds it: one head
    got = mla_attention_torch(q, k[:, 0], dirty, kv_b, *args)
    assert torch.isfinite(want).all()
    assert torch.equal(got, want)
