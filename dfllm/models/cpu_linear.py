"""oneDNN-prepacked linear layers for CPU inference.

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

logger = logging.getLogger("dfllm")


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """A frozen linear layer whose weight oneDNN has laid out once.

    A linear layer marked ``fusable_activation = "gelu"`` gets its (exact, erf) GELU fused
    into the GEMM; ``fused_activation`` then tells the caller not to apply it again.
    """

    packed_weight: torch.Tensor  # buffers
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fused_activation = getattr(linear, "fusable_activation", None)
        self.register_buffer("packed_weight", _reorder(linear.weight))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _packed_linear(x, self.packed_weight, self.bias, self.fused_activation == "gelu")


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` laid out for oneDNN's GEMM (an opaque copy)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   gelu: bool = False) -> torch.Tensor:
    if gelu:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "gelu", [], "none")
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Above this many rows (a prefill chunk) F.linear's GEMM was as fast or faster (SmolLM2's shapes,
# all 30 layers streamed, 2026-12-01: packed 1.1x F.linear at 8-32 and 256 rows, even at 64-128,
# 0.91x at 512 and 2048)
PACKED_MAX_ROWS = 256


class PackableLinear(nn.Linear):
    """``nn.Linear`` that multiplies batches of at most :data:`PACKED_MAX_ROWS` rows through a
    oneDNN-packed copy of its weight once :meth:`pack` has run (CPU, float32), and exactly
    like ``nn.Linear`` otherwise."""

    _packed: tuple[tuple[int, int], torch.Tensor] | None = None

    def pack(self) -> bool:
        """Pack the current weight; False (and nothing packed) where oneDNN cannot take it."""
        w = self.weight
        if not packing_available(w.device, w.dtype):
            self._packed = None
            return False
        self._packed = (_weight_key(w), _reorder(w))
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed
        # a weight written, replaced or moved (to another device or dtype) is packed again, or
        # no longer packed where oneDNN cannot take it
        if packed is not None and packed[0] != _weight_key(self.weight):
            packed = self._packed if self.pack() else None
        if packed is None or x.numel() > PACKED_MAX_ROWS * x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        return _packed_linear(x, packed[1], self.bias)


def _weight_key(w: torch.Tensor) -> tuple[int, int]:
    """Changes whenever the weight is written in place or replaced (``_version``, storage)."""
    return w._version, w.data_ptr()


# The packed copies may take at most this share of the available RAM: they double the linear
# weights' memory, which a small model affords for 1.01-1.18x faster decode steps and a large
# one on a RAM-bound CPU does not
PACK_MEMORY_FRACTION = 0.125


def pack_linears(model: nn.Module, budget_bytes: int | None = None) -> int:
    """Pack every :class:`PackableLinear` of ``model`` whose weight is float32 on a CPU, when
    the packed copies fit in ``budget_bytes`` (default :data:`PACK_MEMORY_FRACTION` of the
    available RAM); returns how many were packed (0 elsewhere: the layers run ``F.linear``)."""
    layers = [m for m in model.modules() if isinstance(m, PackableLinear)
              and packing_available(m.weight.device, m.weight.dtype)]
    size = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    if budget_bytes is None:
        budget_bytes = int(psutil.virtual_memory().available * PACK_MEMORY_FRACTION)
    if not layers or size > budget_bytes:
        if layers:
            logger.info("linear layers not packed for oneDNN: their copies (%.0f MiB) would exceed %.0f MiB "
                        "(%.1f%% of the available memory)", size / 2**20, budget_bytes / 2**20,
                        100 * PACK_MEMORY_FRACTION)
        return 0
    return sum(m.pack() for m in layers)


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
