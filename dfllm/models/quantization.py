"""Opt-in dynamic int8 quantization of a decoder's linear layers on CPU (``quantization="int8"``).

Each ``nn.Linear`` of a loaded decoder (the fused q/k/v and gate/up projections, ``o_proj``,
``down_proj`` and the LM head) becomes an :class:`Int8Linear`: its weight is quantized once
to int8 with one symmetric scale per output channel and packed for fbgemm
(``torch.ops.quantized.linear_prepack``); at each call the activations are quantized to
uint8 and the GEMM runs in int8 with int32 accumulation (``torch.ops.quantized.linear_dynamic``),
the result coming back in float32, then the bias is added.

Activations get one scale per token: ``linear_dynamic`` quantizes its whole input with one
scale, so each row is first divided by its largest magnitude and the output rows multiplied
back. With one scale per call, a batch's largest token (LLMs have a few tokens of very large
activations) set the resolution of every other row: on SmolLM2-135M that cost 1.4 nats of
mean prompt log-probability error, per-token scales 0.2-0.4. ``reduce_range`` (7-bit
activations, which keeps fbgemm's int16 pair sums from saturating on CPUs without VNNI) is
used only when a probe of the kernel shows that full 8-bit activations would saturate.

What stays float: the embeddings and norms (cheap, and precision-sensitive), the rotary
tables, the attention itself and the KV cache, a mixture of experts' fused expert weights
(they are not ``nn.Linear``) and router (``gate``, ``shared_expert_gate``: routing decisions
are discrete and the layer is tiny), and MLA's ``kv_b_proj`` (its attention reads the weight
itself). The LM head is quantized, also when tied to the embeddings (it is a fifth of
SmolLM2-135M's parameters and a quarter of a token's matmul work): the embedding table keeps
the float weight and the head gets its own int8 copy. Measured on SmolLM2-135M, keeping the
head in float lowered the mean prompt log-probability error only from 0.21 to 0.20 nats.

Accuracy: greedy outputs differ from float32's after some tokens (``benchmarks/bench_quant.py``
measures by how much); ``dtype="bfloat16"`` is closer to float32, but not faster on CPU.

Note: recent PyTorch (2.13 here) warns once per process that creating ``torch.qint8`` tensors is
deprecated; packing a weight for these ops needs one, so that warning is expected and left
visible.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

QUANTIZATIONS = ("int8",)
# nn.Linear children kept in float (see the module docstring)
KEEP_FLOAT = frozenset({"gate", "shared_expert_gate", "kv_b_proj"})
_ENGINES = ("x86", "fbgemm")


def quantized_engine() -> str:
    """The PyTorch quantized engine the int8 layers are packed for: ``"x86"`` (fbgemm's
    kernels for linear layers) or ``"fbgemm"``; ``RuntimeError`` naming ``quantization`` when
    this PyTorch build has neither (e.g. an ARM CPU)."""
    supported = torch.backends.quantized.supported_engines
    for engine in _ENGINES:
        if engine in supported:
            return engine
    raise RuntimeError(
        f"quantization='int8' needs PyTorch's x86/fbgemm quantized engine, which this platform lacks "
        f"(supported engines: {supported}); use quantization=None")


class Int8Linear(nn.Module):
    """A frozen linear layer in dynamic int8: int8 weight with per-output-channel scales,
    packed once for fbgemm, and int8 activations with one scale per token; float32 in,
    float32 out."""

    def __init__(self, linear: nn.Linear, engine: str):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-8).double()
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        self._packed = _prepack(qweight, engine)
        self.reduce_range = needs_reduce_range(engine)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        peak = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)  # per-token activation scale
        y = torch.ops.quantized.linear_dynamic(x / peak, self._packed, self.reduce_range) * peak
        return y if self.bias is None else y + self.bias

    def int8_weight(self) -> torch.Tensor:
        """The packed weight, unpacked: a ``torch.qint8`` per-channel quantized tensor."""
        weight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return weight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 dynamic"


def _prepack(qweight: torch.Tensor, engine: str):
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        return torch.ops.quantized.linear_prepack(qweight, None)
    finally:
        torch.backends.quantized.engine = previous


@functools.cache
def needs_reduce_range(engine: str) -> bool:
    """Whether full-range (8-bit) activations would saturate this CPU's int8 kernel: all-255
    activations times all-127 weights overflow int16 pair sums (CPUs without VNNI); with VNNI
    the product is exact and the activations keep their 8th bit."""
    k = 64
    weight = torch.quantize_per_channel(torch.ones(8, k), torch.full((8,), 1 / 127, dtype=torch.double),
                                        torch.zeros(8, dtype=torch.long), 0, torch.qint8)
    x = torch.ones(4, k)
    x[:, 0] = 0.0  # range [0, 1]: zero point 0, 1.0 -> 255
    y = torch.ops.quantized.linear_dynamic(x, _prepack(weight, engine), False)
    return not torch.allclose(y, torch.full_like(y, k - 1), rtol=1e-3)


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Replace the ``nn.Linear`` layers of a loaded float32 CPU ``model`` by :class:`Int8Linear`
    (``method="int8"``, the only one) in place, except those named in :data:`KEEP_FLOAT`.
    Returns the model."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {method!r}")
    engine = quantized_engine()
    _replace(model, engine)
    return model


def _replace(module: nn.Module, engine: str) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            if name in KEEP_FLOAT:
                continue
            if child.weight.device.type != "cpu" or child.weight.dtype != torch.float32:
                raise ValueError(f"quantization='int8' runs float32 CPU models; layer {name} is "
                                 f"{child.weight.dtype} on {child.weight.device}")
            setattr(module, name, Int8Linear(child, engine))
        else:
            _replace(child, engine)
