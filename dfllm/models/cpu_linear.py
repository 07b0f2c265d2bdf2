"""Prepacked linear layers for CPU inference (oneDNN's GEMM; dfllm's own for bfloat16 on
CPUs with AVX512-BF16 and no AMX, :mod:`dfllm.kernels.gemm`).

On CPU, ``torch.nn.Linear`` re-lays its weight out for the GEMM on every call; oneDNN can
do that once (the path PyTorch's own compiler uses after freezing). It measured 1.1-1.3x
faster per GEMM here in float32, with results equal to ``F.linear`` up to float rounding
(about 1e-6 relative); for a decoder's layers streamed one after another it was 1.1x faster
at the small batches of a decode step and no faster for prefill chunks.

Two forms:

* :class:`PackedLinear` replaces an encoder's ``nn.Linear`` outright (its float weight is
  dropped): encoders are loaded once and never updated in place.
* :class:`PackableLinear` is the decoders' linear layer. It keeps its float ``weight``
  parameter (``update_weights``, tied embeddings, RLHF callables and sleep mode read and
  write it) and, once :func:`pack_linears` has run, multiplies through a packed copy, made
  again whenever the weight changes (its version counter or storage moves). The copy costs
  the layer's weight memory a second time, on CPU float32 only, so a model whose copies would
  take more than an eighth of the available RAM is not packed.
"""

from __future__ import annotations

import logging

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from dfllm.kernels.backend import cpu_bf16_gemm, cpu_bf16_gemm_available, cpu_bf16_gemm_pack

logger = logging.getLogger("dfllm")


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can take a linear layer of ``dtype`` on ``device``: float32 on any CPU,
    bfloat16 where the CPU has bfloat16 instructions (AVX512-BF16 or AMX)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_gemm_isa() is not None)


def bf16_gemm_isa() -> str | None:
    """The CPU's bfloat16 matrix instructions oneDNN uses ("AMX", "AVX512-BF16"), or None
    where it has none (there bfloat16 GEMMs are emulated and float32 is faster)."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return "AMX" if torch.cpu._is_amx_tile_supported() else "AVX512-BF16"


def own_gemm_applies(weight: torch.Tensor) -> bool:
    """Whether dfllm's own bfloat16 GEMM (:mod:`dfllm.kernels.gemm`) takes a linear layer of
    ``weight``: bfloat16 on a CPU with AVX512-BF16 and no AMX (with AMX oneDNN's tiles are
    faster), where dfllm's CPU kernels build."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and bf16_gemm_isa() == "AVX512-BF16"
        and cpu_bf16_gemm_available()
    )


def gelu_fusion_pays() -> bool:
    """Whether oneDNN's GEMM should apply an exact (erf) GELU itself: on CPUs with AVX-512,
    not on AVX2-only ones. On an AVX2 EPYC (2026-12-03, 2 threads, MiniLM's MLP shape, 2,048
    rows by 384 into 1,536) the GEMM took 17.8 ms, 25.2 ms with the GELU fused, and 19.4 ms
    followed by torch's own GELU pass (1.6 ms, at memory speed): there the fused GELU cost 16%
    of the whole encoder's time."""
    return torch.backends.cpu.get_cpu_capability().lower().startswith("avx512")


class PackedLinear(nn.Module):
    """A frozen linear layer whose weight oneDNN has laid out once.

    A linear layer marked ``fusable_activation = "gelu"`` gets its (exact, erf) GELU fused
    into the GEMM where :func:`gelu_fusion_pays`; ``fused_activation`` then tells the caller
    not to apply it again (it is None where the caller applies it).
    """

    packed_weight: torch.Tensor  # buffers
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        fusable = getattr(linear, "fusable_activation", None)
        self.fused_activation = fusable if fusable is not None and gelu_fusion_pays() else None
        self.register_buffer("packed_weight", _reorder(linear.weight))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x, self.packed_weight, self.bias, self.fused_activation == "gelu")


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` laid out for oneDNN's GEMM (an opaque copy)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False
) -> torch.Tensor:
    if gelu:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "gelu", [], "none")
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# In float32, above this many rows (a prefill chunk) F.linear's GEMM was as fast or faster
# (SmolLM2's shapes, all 30 layers streamed, 2026-12-01: packed 1.1x F.linear at 8-32 and 256
# rows, even at 64-128, 0.91x at 512 and 2048). In bfloat16 the packed GEMM is used at every
# size: F.linear's bfloat16 path was 2x slower than packed at 128-512 rows (2026-12-03).
PACKED_MAX_ROWS = 256


class PackableLinear(nn.Linear):
    """``nn.Linear`` that multiplies through a packed copy of its weight once :meth:`pack` has
    run, and exactly like ``nn.Linear`` otherwise. The copy is oneDNN's (CPU: bfloat16 batches of
    any size, float32 batches of at most :data:`PACKED_MAX_ROWS` rows) or, for bfloat16 where
    :func:`own_gemm_applies` and the packing asked for it, laid out for dfllm's own GEMM."""

    _packed: tuple[tuple[int, int], torch.Tensor] | None = None
    _gemm = "onednn"  # the GEMM the packed copy is laid out for: "onednn" or "dfllm"
    _own_gemm = False  # whether packing may choose dfllm's GEMM (pack_linears' own_gemm)

    def pack(self, own_gemm: bool | None = None) -> bool:
        """Pack the current weight (for dfllm's bfloat16 GEMM where ``own_gemm``, or an earlier
        call's choice when None, and it applies); False (and nothing packed) where no GEMM can take it."""
        if own_gemm is not None:
            self._own_gemm = own_gemm
        w = self.weight
        if self._own_gemm and own_gemm_applies(w):
            self._packed, self._gemm = (weight_key(w), cpu_bf16_gemm_pack(w)), "dfllm"
            return True
        if not packing_available(w.device, w.dtype):
            self._packed = None
            return False
        self._packed, self._gemm = (weight_key(w), _reorder(w)), "onednn"
        return True

    @property
    def packing(self) -> object:
        """The record of the current packing (None where not packed): the same object until
        the layer is packed again, so its identity tells a repacking apart."""
        return self._packed

    def packed_copy(self) -> tuple[str, torch.Tensor] | None:
        """The GEMM the packed copy is laid out for ("onednn" or "dfllm") and the copy, where it is
        current; None where the layer is not packed or its weight changed since (:meth:`forward`
        then packs again or falls back)."""
        packed = self._packed
        if packed is None or packed[0] != weight_key(self.weight):
            return None
        return self._gemm, packed[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed
        # a weight written, replaced or moved (to another device or dtype) is packed again, or
        # no longer packed where no GEMM can take it
        if packed is not None and packed[0] != weight_key(self.weight):
            packed = self._packed if self.pack() else None
        if packed is None or (x.numel() > PACKED_MAX_ROWS * x.shape[-1] and x.dtype == torch.float32):
            return F.linear(x, self.weight, self.bias)
        if self._gemm == "dfllm":
            if x.dtype != torch.bfloat16:
                return F.linear(x, self.weight, self.bias)
            return cpu_bf16_gemm(x, packed[1], self.bias, self.out_features)
        return _packed_linear(x, packed[1], self.bias)


def weight_key(w: torch.Tensor) -> tuple[int, int]:
    """Changes whenever the weight is written in place or replaced (``_version``, storage)."""
    return w._version, w.data_ptr()


# The packed copies may take at most this share of the available RAM: they double the linear
# weights' memory, which a small model affords for 1.01-1.18x faster decode steps and a large
# one on a RAM-bound CPU does not
PACK_MEMORY_FRACTION = 0.125


def pack_linears(model: nn.Module, budget_bytes: int | None = None, own_gemm: bool = False) -> int:
    """Pack every :class:`PackableLinear` of ``model`` that oneDNN can take (:func:`packing_available`), when
    the packed copies fit in ``budget_bytes`` (default :data:`PACK_MEMORY_FRACTION` of the
    available RAM); returns how many were packed (0 elsewhere: the layers run ``F.linear``).
    With ``own_gemm``, bfloat16 layers go to dfllm's own GEMM where :func:`own_gemm_applies`
    (the engine asks for it when it runs dfllm's CPU kernels)."""
    linears = [m for m in model.modules() if isinstance(m, PackableLinear) and m.weight.device.type == "cpu"]
    if any(m.weight.dtype == torch.bfloat16 for m in linears):
        isa = bf16_gemm_isa()
        if isa is None:
            logger.warning(
                "this CPU has no bfloat16 matrix instructions (AVX512-BF16 or AMX): bfloat16 GEMMs run "
                "emulated, slower than float32 (dtype='auto' or 'float32' is faster here)"
            )
        elif own_gemm and own_gemm_applies(next(m.weight for m in linears if m.weight.dtype == torch.bfloat16)):
            logger.info("bfloat16 linear layers: dfllm's GEMM on %s", isa)
        else:
            logger.info("bfloat16 linear layers: oneDNN GEMMs on %s", isa)
    layers = [m for m in linears if packing_available(m.weight.device, m.weight.dtype)]
    size = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    if budget_bytes is None:
        budget_bytes = int(psutil.virtual_memory().available * PACK_MEMORY_FRACTION)
    if not layers or size > budget_bytes:
        if layers:
            logger.info(
                "linear layers not packed for oneDNN: their copies (%.0f MiB) would exceed %.0f MiB "
                "(%.1f%% of the available memory)",
                size / 2**20,
                budget_bytes / 2**20,
                100 * PACK_MEMORY_FRACTION,
            )
        return 0
    return sum(m.pack(own_gemm) for m in layers)


def repack_linears(model: nn.Module) -> None:
    """Pack again every :class:`PackableLinear` of ``model`` that is packed (after its weights
    may have been written where no version counter sees it, e.g. through ``param.data``)."""
    for m in model.modules():
        if isinstance(m, PackableLinear) and m._packed is not None:
            m.pack()


def prepack_linears(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (weights already loaded) by a ``PackedLinear``."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child))
        elif not isinstance(child, nn.MultiheadAttention):  # it reads its out_proj's weight itself (SigLIP's head)
            prepack_linears(child)
    return model
