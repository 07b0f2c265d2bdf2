"""Choosing the implementation of the engine's hot-path operations."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dfllm.kernels.activation import silu_and_mul_torch
from dfllm.kernels.encoder_attention import encoder_attention_torch
from dfllm.kernels.fused_moe import fused_moe_torch
from dfllm.kernels.kv_cache import write_kv_cache_torch
from dfllm.kernels.logits import exact_top_logits_torch
from dfllm.kernels.paged_attention import paged_attention_torch
from dfllm.kernels.rms_norm import rms_norm_torch
from dfllm.kernels.rotary import rotary_torch

BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass(frozen=True)
class KernelOps:
    """One implementation of each hot-path operation."""

    name: str
    write_kv_cache: Callable
    paged_attention: Callable
    rms_norm: Callable
    rotary: Callable
    silu_and_mul: Callable
    fused_moe: Callable


TORCH_OPS = KernelOps(
    name="torch",
    write_kv_cache=write_kv_cache_torch,
    paged_attention=paged_attention_torch,
    rms_norm=rms_norm_torch,
    rotary=rotary_torch,
    silu_and_mul=silu_and_mul_torch,
    fused_moe=fused_moe_torch,
)


def check_attention_backend(attention_backend: str) -> None:
    """``ValueError`` unless ``attention_backend`` is one of :data:`BACKENDS`."""
    if attention_backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {attention_backend!r}")


def select_ops(attention_backend: str, device: torch.device) -> KernelOps:
    """The kernels for ``attention_backend`` ("auto", "torch", "cpu" or "triton") on ``device``.

    "auto" picks Triton on CUDA, dfllm's compiled CPU kernels on a CPU (the PyTorch references
    where they cannot be built) and PyTorch elsewhere. "torch" forces the references. "triton"
    on a CPU runs the Triton kernels through Triton's interpreter (``TRITON_INTERPRET=1``):
    slow, but exact.
    """
    check_attention_backend(attention_backend)
    device = torch.device(device)
    if attention_backend in ("auto", "cpu") and device.type == "cpu":
        ops = cpu_ops()
        if ops is not None:
            return ops
        if attention_backend == "cpu":
            raise RuntimeError(
                "attention_backend='cpu': dfllm's CPU kernels could not be built (a C++ compiler "
                "and ninja are needed; see the warning above), use 'torch' or 'auto'"
            )
        return TORCH_OPS
    if attention_backend == "cpu":
        raise ValueError(f"attention_backend='cpu' runs on a CPU device, not {device.type!r}")
    if attention_backend == "torch" or (attention_backend == "auto" and device.type != "cuda"):
        return TORCH_OPS
    return triton_ops(device)


def encoder_attention_op(attention_backend: str, device: torch.device) -> Callable:
    """The encoders' attention over unpadded sequences for ``attention_backend`` on ``device``:
    dfllm's compiled CPU kernel under "auto" or "cpu" on a CPU where it builds, the PyTorch
    reference (SDPA over the sequences padded) elsewhere, and always under "torch"."""
    if attention_backend in ("auto", "cpu") and torch.device(device).type == "cpu":
        from dfllm.kernels import _cpu

        if _cpu.available():
            return _cpu.encoder_attention_cpu
    return encoder_attention_torch


def cpu_ops() -> KernelOps | None:
    """dfllm's compiled CPU kernels (built on first use), or None where they cannot be built."""
    from dfllm.kernels import _cpu

    if not _cpu.available():
        return None
    return KernelOps(
        name="cpu",
        write_kv_cache=_cpu.write_kv_cache_cpu,
        paged_attention=_cpu.paged_attention_cpu,
        rms_norm=_cpu.rms_norm_cpu,
        rotary=_cpu.rotary_cpu,
        silu_and_mul=_cpu.silu_and_mul_cpu,
        fused_moe=fused_moe_torch,
    )


def triton_ops(device: torch.device) -> KernelOps:
    """The Triton kernels, imported on first use (through the interpreter on a CPU)."""
    interpret = torch.device(device).type != "cuda"
    if interpret:
        _enable_interpreter()
    modules = {
        stem: importlib.import_module(f"dfllm.kernels._triton_{stem}")
        for stem in ("kv_cache", "paged_attention", "rms_norm", "rotary", "activation", "fused_moe")
    }
    if interpret and not _interpreted(modules["rms_norm"]._rms_norm_kernel):
        raise RuntimeError(_INTERPRETER_HINT + " (dfllm's Triton kernels were already compiled for a GPU)")
    return KernelOps(
        name="triton",
        write_kv_cache=modules["kv_cache"].write_kv_cache_triton,
        paged_attention=modules["paged_attention"].paged_attention_triton,
        rms_norm=modules["rms_norm"].rms_norm_triton,
        rotary=modules["rotary"].rotary_triton,
        silu_and_mul=modules["activation"].silu_and_mul_triton,
        fused_moe=modules["fused_moe"].fused_moe_triton,
    )


_INTERPRETER_HINT = (
    "attention_backend='triton' on a CPU runs Triton's interpreter, which needs TRITON_INTERPRET=1 "
    "in the environment before triton is first imported in this process"
)


def _enable_interpreter() -> None:
    """Set ``TRITON_INTERPRET=1``, or raise if triton was already imported without it."""
    preset = os.environ.get("TRITON_INTERPRET")
    if preset is None and "triton" in sys.modules:
        raise RuntimeError(_INTERPRETER_HINT + " (triton was imported without it)")
    if preset is not None and preset.lower() not in ("1", "true", "on"):
        raise RuntimeError(_INTERPRETER_HINT + f" (it is set to {preset!r})")
    os.environ["TRITON_INTERPRET"] = "1"


def _interpreted(kernel: object) -> bool:
    """Whether a ``@triton.jit`` kernel runs in Triton's interpreter."""
    return type(kernel).__name__ == "InterpretedFunction"


def exact_top_logits(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`~dfllm.kernels.logits.exact_top_logits_torch` through the compiled CPU kernel on a
    CPU where it is loaded, the reference elsewhere."""
    if logits.device.type == "cpu":
        from dfllm.kernels import _cpu

        return _cpu.exact_top_logits_cpu(logits, hidden, weight)
    return exact_top_logits_torch(logits, hidden, weight)


def argmax_rows(x: torch.Tensor, code_non_finite: bool = False) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D ``x``, through the compiled CPU kernel where it applies
    (float32 rows on a CPU where the kernels are loaded), ``torch.argmax`` elsewhere; with
    ``code_non_finite``, -1 for a row whose maximum is not finite (a NaN, a +inf, or no finite
    value)."""
    from dfllm.kernels import _cpu

    return _cpu.argmax_rows_cpu(x, code_non_finite)


def build_cpu_kernels() -> bool:
    """Build (or load from the cache) dfllm's compiled CPU kernels in this process, saying so;
    whether they are available. A parent process calls it before starting workers, which then
    load the build instead of each compiling it silently."""
    from dfllm.kernels import _cpu

    return _cpu.load() is not None


def cpu_bf16_gemm_available() -> bool:
    """Whether dfllm's compiled bfloat16 GEMM (:mod:`dfllm.kernels.gemm`) runs here: the CPU
    kernels build and the CPU has AVX512-BF16."""
    from dfllm.kernels import _cpu

    return _cpu.bf16_gemm_ready()


def cpu_bf16_gemm_pack(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight ``[n, k]`` laid out for :func:`cpu_bf16_gemm` (an opaque copy)."""
    from dfllm.kernels import _cpu

    return _cpu.bf16_gemm_pack_cpu(weight)


def cpu_decode_layers(x: torch.Tensor, *operands: list, **kw) -> tuple:
    """A decode step's decoder layers in one call to the compiled kernels (the operands, the
    keywords and their meaning: :func:`dfllm.kernels._cpu.decode_layers_cpu`); ``(hidden, residual)``."""
    from dfllm.kernels import _cpu

    return _cpu.decode_layers_cpu(x, *operands, **kw)


def cpu_bf16_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """:func:`~dfllm.kernels.gemm.bf16_linear_torch` through the compiled GEMM, the weight as
    :func:`cpu_bf16_gemm_pack` laid it out."""
    from dfllm.kernels import _cpu

    return _cpu.bf16_gemm_cpu(x, packed, bias, out_features)
