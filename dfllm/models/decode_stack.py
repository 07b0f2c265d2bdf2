"""A decode step's decoder layers as one call to dfllm's CPU kernels.

From Python a Llama layer is eleven kernel calls (two norms, four GEMMs, rotary, the cache
write, attention, SiLU-and-multiply, a split), each with its module call, checks and tensor
wrapping: on SmolLM2's 30 layers ~330 calls a step, ~10 ms of host work at 64 sequences on
an AVX512-BF16 EPYC (of a ~65 ms step), more than the norms, rotary and SiLU cost together.
Where a model's layers are all the plain Llama layer (Qwen2's biases and Qwen3's q/k norms
included) and its linear layers are packed for one GEMM (dfllm's bfloat16 GEMM on AVX512-BF16,
oneDNN's in bfloat16 on AMX and in float32 on any CPU: :mod:`dfllm.models.cpu_linear`), a step
whose every sequence decodes runs them as one call instead (``decode_layers`` in
``csrc/cpu_ops.cpp``): the same kernels with the same operands in the same order, so the same
bits. Anything else takes the modules' forward: a prefill in the step, LoRA adapters, a sliding
window, other dtypes or caches, a float32 step of more rows than oneDNN's packed GEMM takes
(:data:`PACKED_MAX_ROWS`), or a weight written since it was packed (which that forward packs
again).
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
from torch import nn

from dfllm.kernels.backend import cpu_decode_layers
from dfllm.kernels.metadata import AttentionMetadata
from dfllm.models.cpu_linear import PACKED_MAX_ROWS, PackableLinear, weight_key
from dfllm.models.layers import GatedMLP, PagedAttention, RMSNorm
from dfllm.models.llama import DecoderLayer, DecoderModel


def _linears(layer: DecoderLayer) -> list[PackableLinear]:
    """The layer's qkv, o, gate_up and down projections (PackableLinears where :func:`_plain`)."""
    attn, mlp = layer.self_attn, layer.mlp
    return cast(list[PackableLinear], [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj])


def _plain(layer: nn.Module) -> bool:
    """Whether ``layer`` is the plain Llama layer: RMSNorms, grouped-query attention over the
    paged cache on the CPU kernels (no window or soft cap; Qwen3's q/k RMSNorms allowed), a
    SiLU-gated MLP, and packable linear layers (with biases or without: Qwen2's qkv bias)."""
    if type(layer) is not DecoderLayer:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not PagedAttention or type(mlp) is not GatedMLP:
        return False
    if attn.sliding_window is not None or attn.softcap is not None:
        return False
    if not (attn.q_norm is None and attn.k_norm is None or type(attn.q_norm) is type(attn.k_norm) is RMSNorm):
        return False
    if attn.ops.name != "cpu" or type(layer.input_layernorm) is not RMSNorm:
        return False
    if type(layer.post_attention_layernorm) is not RMSNorm:
        return False
    return all(type(m) is PackableLinear for m in _linears(layer))


class StepOperands(NamedTuple):
    """What ``decode_layers`` reads of the layers in a step (:func:`dfllm.kernels._cpu.decode_layers_cpu`)."""

    weights: list[torch.Tensor]  # six a layer: the two norms and the four packed linears
    biases: list[torch.Tensor | None]  # four a layer: the linears' (None where one has none)
    qk_norms: list[torch.Tensor]  # two a layer (Qwen3's q_norm and k_norm) or none
    caches: list[torch.Tensor]  # two a layer: keys, values
    onednn: bool  # the linears take oneDNN's GEMM (else dfllm's bfloat16 GEMM)


class _Weights(NamedTuple):
    """The weights' part of :class:`StepOperands` (what stays from step to step)."""

    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    qk_norms: list[torch.Tensor]
    onednn: bool


def _norms(layer: DecoderLayer) -> list[RMSNorm]:
    """The layer's input and post-attention RMSNorms, then its q and k norms where it has them (Qwen3)."""
    attn = layer.self_attn
    norms = [cast(RMSNorm, layer.input_layernorm), cast(RMSNorm, layer.post_attention_layernorm)]
    if attn.q_norm is not None and attn.k_norm is not None:
        norms += [cast(RMSNorm, attn.q_norm), cast(RMSNorm, attn.k_norm)]
    return norms


def _qk_eps(layer: DecoderLayer) -> tuple[float, float] | None:
    """The epsilons of the layer's q and k RMSNorms (Qwen3), or None where it has none."""
    attn = layer.self_attn
    if attn.q_norm is None or attn.k_norm is None:
        return None
    return cast(RMSNorm, attn.q_norm).eps, cast(RMSNorm, attn.k_norm).eps


class DecodeStack:
    """A :class:`DecoderModel`'s layers as one kernel call in decode-only steps (see the
    module's docstring); ``calls`` counts the steps that took it."""

    def __init__(self, layers: list[DecoderLayer]):
        self.layers = layers
        attn = layers[0].self_attn
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self.scale = attn.scale
        self.eps = layers[0].input_layernorm.eps
        qk_eps = _qk_eps(layers[0])
        self.qk_eps = 0.0 if qk_eps is None else qk_eps[0]
        self.intermediate = _linears(layers[0])[3].in_features
        self.calls = 0
        # what a step reads of each layer: its attention, its four linears, its norms (the
        # modules are the model's own from here on: the engine replaces none once built)
        self._parts = [(layer.self_attn, _linears(layer), _norms(layer)) for layer in layers]
        # the last step's weights (:meth:`_weights`), with the key they were taken under and
        # the objects whose ids the key holds (kept alive, so that no id is reused meanwhile)
        self._weights_cache: tuple[list, _Weights, list] | None = None

    @classmethod
    def build(cls, model: DecoderModel) -> DecodeStack | None:
        """The stack of ``model``'s layers, or None where a layer is not the plain Llama layer,
        a linear layer is not packed, or the layers differ in shape, q/k norms or norm epsilon."""
        layers = model.stage_layers
        if not layers or not all(_plain(layer) for layer in layers):
            return None
        if any(m.packed_copy() is None for layer in layers for m in _linears(layer)):
            return None  # not packed (quantized, or the copies would not fit in memory)
        first = layers[0]
        same = {
            (
                layer.self_attn.num_heads,
                layer.self_attn.num_kv_heads,
                layer.self_attn.head_dim,
                layer.self_attn.scale,
                layer.input_layernorm.eps,
                layer.post_attention_layernorm.eps,
                _linears(layer)[3].in_features,
                _qk_eps(layer),
            )
            for layer in layers
        }
        if len(same) != 1 or first.input_layernorm.eps != first.post_attention_layernorm.eps:
            return None
        qk_eps = _qk_eps(first)
        if qk_eps is not None and qk_eps[0] != qk_eps[1]:
            return None
        return cls(layers)

    def _operands(self, dtype: torch.dtype) -> StepOperands | None:
        """This step's operands, or None where a packed copy is stale or missing, the layers'
        GEMMs differ, or a norm or cache is not in ``dtype``.

        The weights' part is taken once and reused while every object it came from is the
        same and unchanged (a packed copy, its weight's version and storage, each norm and
        bias): checking that costs an eighth of walking the modules for them (SmolLM2's 30
        layers ~75 µs against ~600). The caches are read at every step, so that the engine's
        freeing or replacing them is never held up here."""
        caches: list[torch.Tensor] = []
        for attn, _, _ in self._parts:
            k_cache, v_cache = attn.k_cache, attn.v_cache
            if k_cache is None or v_cache is None or k_cache.dtype != dtype or v_cache.dtype != dtype:
                return None
            if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
                return None
            caches += (k_cache, v_cache)
        key, held = self._key(dtype)
        cached = self._weights_cache
        if cached is not None and cached[0] == key:
            weights = cached[1]
        else:
            self._weights_cache = None
            found = self._weights(dtype)
            if found is None:
                return None
            weights = found
            self._weights_cache = (key, weights, held)
        return StepOperands(weights.weights, weights.biases, weights.qk_norms, caches, weights.onednn)

    def _key(self, dtype: torch.dtype) -> tuple[list, list]:
        """What the weights' part depends on (ids, and each weight's :func:`weight_key`), and the
        objects whose ids it holds."""
        key: list = [dtype]
        held: list = []
        for _, linears, norms in self._parts:
            for m in linears:
                w, b, packed = m._parameters["weight"], m._parameters.get("bias"), m.packing
                assert w is not None
                key += (id(packed), weight_key(w), id(b))
                held += (packed, b)
            for n in norms:
                w = n._parameters["weight"]
                assert w is not None
                key += (id(w), weight_key(w))
                held.append(w)
        return key, held

    def _weights(self, dtype: torch.dtype) -> _Weights | None:
        """The layers' packed linears, norms and biases as ``decode_layers`` takes them, or
        None (see :meth:`_operands`)."""
        weights: list[torch.Tensor] = []
        biases: list[torch.Tensor | None] = []
        qk_norms: list[torch.Tensor] = []
        gemms: set[str] = set()
        for _, linears, norms in self._parts:
            packed = [m.packed_copy() for m in linears]
            weights_of_norms = [n.weight for n in norms]
            if any(p is None for p in packed) or any(w.dtype != dtype for w in weights_of_norms):
                return None
            copies = cast(list[tuple[str, torch.Tensor]], packed)
            gemms.update(gemm for gemm, _ in copies)
            # dfllm's GEMM pairs its inputs' features: every input width even
            if any(gemm == "dfllm" and m.in_features % 2 for (gemm, _), m in zip(copies, linears, strict=True)):
                return None
            qkv, o, gate_up, down = (copy for _, copy in copies)
            weights += [weights_of_norms[0], qkv, o, weights_of_norms[1], gate_up, down]
            biases += [m.bias for m in linears]
            qk_norms += weights_of_norms[2:]
        if len(gemms) != 1 or (gemms == {"dfllm"} and dtype != torch.bfloat16):
            return None
        return _Weights(weights, biases, qk_norms, gemms == {"onednn"})

    def run(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layers' ``(hidden, residual)`` for the first layer's input ``x``, or None where
        this step must take the modules' forward."""
        cos, sin = cos_sin
        heads, kv_heads, head_dim = self.shape
        if (
            meta.decodes is None
            or meta.prefills
            or meta.lora is not None
            or meta.sliding_window is not None
            or x.dtype not in (torch.bfloat16, torch.float32)
            or (x.dtype == torch.float32 and x.shape[0] > PACKED_MAX_ROWS)  # the modules take F.linear
            or x.dim() != 2
            or x.stride(1) != 1
            or cos.shape[-1] * 2 != head_dim
            or cos.dtype != torch.float32
            or meta.slot_mapping.dtype != torch.int64
        ):
            return None
        operands = self._operands(x.dtype)
        if operands is None:
            return None
        self.calls += 1
        return cpu_decode_layers(
            x,
            operands.weights,
            operands.biases,
            operands.qk_norms,
            operands.caches,
            cos=cos,
            sin=sin,
            slots=meta.slot_mapping,
            decodes=meta.decodes,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=self.intermediate,
            eps=self.eps,
            qk_eps=self.qk_eps,
            scale=self.scale,
            onednn=operands.onednn,
        )


def enable_decode_stacks(model: nn.Module) -> int:
    """Give each :class:`DecoderModel` in ``model`` whose layers allow it a :class:`DecodeStack`
    (the engine calls it on CPU once the linear layers are packed); how many got one."""
    count = 0
    for m in model.modules():
        if isinstance(m, DecoderModel):
            m.decode_stack = DecodeStack.build(m)
            count += m.decode_stack is not None
    return count
