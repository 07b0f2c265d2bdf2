"""Choosing the implementation of the engine's hot-path operations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dfllm.kernels.activation import silu_and_mul_torch
from dfllm.kernels.kv_cache import write_kv_cache_torch
from dfllm.kernels.paged_attention import paged_attention_torch
from dfllm.kernels.rms_norm import rms_norm_torch
from dfllm.kernels.rotary import rotary_torch

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KernelOps:
    """One implementation of each hot-path operation."""

    name: str
    write_kv_cache: Callable
    paged_attention: Callable
    rms_norm: Callable
    rotary: Callable
    silu_and_mul: Callable


TORCH_OPS = KernelOps(
    name="torch",
    write_kv_cache=write_kv_cache_torch,
    paged_attention=paged_attention_torch,
    rms_norm=rms_norm_torch,
    rotary=rotary_torch,
    silu_and_mul=silu_and_mul_torch,
)


def select_ops(attention_backend: str, device: torch.device) -> KernelOps:
    """The kernels for ``attention_backend`` ("auto", "torch" or "triton") on ``device``.

    "auto" picks the PyTorch implementations; the Triton kernels are not built yet, so
    "triton" raises until they are.
    """
    if attention_backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {attention_backend!r}")
    if attention_backend == "triton":
        raise NotImplementedError("attention_backend='triton': the Triton kernels are not available yet")
    return TORCH_OPS
