"""Opt-in dynamic int8 quantization of linear layers on CPU (``quantization="int8"``): decoders and encoders.

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
mean prompt log-probability error, per-token scales 0.2-0.4.

On CPUs without VNNI (AVX2), fbgemm sums pairs of uint8 x int8 products in int16, which
saturates for full-range operands (255 x 127 x 2 > 32,767). Either side can give up a bit:
7-bit activations (``reduce_range``) or 7-bit weights (-63..63). :func:`int8_ranges` probes the
kernel once and takes the widest exact choice: 8 bits each with VNNI; otherwise 7-bit weights
with 8-bit activations, because the activations are the side with outliers (on SmolLM2-135M
it nearly halved the log-probability error; figures in docs/benchmarks.md, 2026-12-04).

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

Encoders (``runner="pooling"``: BERT, RoBERTa, XLM-R, ColBERT; :func:`quantize_encoder`)
differ, because at their widths (384-1024) each extra elementwise pass costs about as much as
the int8 GEMM saves. Measured on all-MiniLM-L6-v2 (one thread, CPU time of the four linear
layers at 2048 tokens): float32 50 ms, int8 with per-token scales 46 ms, int8 with one scale
per call (bias added inside fbgemm) 22 ms. So encoders take one activation scale per call,
and the precision it loses is won back where it matters:

- the layers reading a LayerNorm (``qkv_proj``, the MLP's first ``dense``) are smoothed
  (SmoothQuant: activation outlier channels moved into the weight's per-channel scales);
- the MLP's second ``dense`` (reading GELU's output, whose outliers smoothing does not tame)
  stays float; the attention output ``dense`` is quantized as is.

Lowest cosine to float32's embeddings over 46 mixed-length texts (MiniLM, in dfllm's batches):
all four layers per call 0.981, all four per token 0.994, this scheme 0.994 (mean 0.999);
the whole model then took 1.2x less CPU time than float32's on 48 mixed-length texts (one
thread, measured beside other work; attention, norms and GELU are untouched). One scale
per call makes a text's vector depend slightly on the texts batched with it (run alone, the
lowest cosine was 0.996). The pooler, a classifier's head and a ColBERT projection stay float:
the first two run once per sequence, not per token, and their outputs are the logits
returned; a ColBERT head (hidden -> 128) is about 1% of a token's work and its outputs are
the vectors returned. The MLP's GELU, which :class:`~dfllm.models.cpu_linear.PackedLinear`
fuses into a float GEMM on AVX-512 CPUs, is applied after the int8 GEMM
(``Int8Linear.fused_activation`` is None).

Weight updates (``LLM.update_weights``) re-quantize the rows they replace
(:meth:`Int8Linear.update_weight`); a head tied to the embeddings is re-quantized from the
updated embedding table.

Note: recent PyTorch (2.13 here) warns once per process that creating ``torch.qint8`` tensors is
deprecated; packing a weight for these ops needs one, so that warning is expected and left
visible.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from dfllm.models.bert import BertEmbeddings, BertIntermediate, BertLayer, BertSelfAttention

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
        f"(supported engines: {supported}); use quantization=None"
    )


class Int8Linear(nn.Module):
    """A frozen linear layer in dynamic int8: int8 weight with per-output-channel scales,
    packed once for fbgemm, and int8 activations quantized at each call; float32 in, float32
    out.

    Activations get one scale per token (``per_token=True``, decoders), or one per call
    (``per_token=False``, encoders: the bias is then added inside fbgemm's GEMM and no pass
    over the activations or outputs is added; see the module docstring).

    ``smooth`` (one positive factor per input channel, SmoothQuant) moves activation outliers
    into the weight: the int8 weight is ``weight * smooth`` (columns) and the activations are
    divided by ``smooth`` before they are quantized; None for no smoothing.

    ``tied_to`` names the float parameter the weight was copied from when the layer shared it
    (a tied LM head: ``model.embed_tokens.weight``). A fused layer's ``output_sizes`` (the
    q/k/v rows of ``qkv_proj``) are kept for weight updates. No activation is fused
    (``fused_activation`` is None), so a caller that checks it applies its own."""

    fused_activation = None
    smooth: torch.Tensor | None  # buffers
    bias: torch.Tensor | None

    def __init__(
        self,
        linear: nn.Linear,
        engine: str,
        tied_to: str | None = None,
        smooth: torch.Tensor | None = None,
        per_token: bool = True,
    ):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.engine, self.tied_to, self.per_token = engine, tied_to, per_token
        sizes = getattr(linear, "output_sizes", None)
        if sizes is not None:
            self.output_sizes = list(sizes)
        self.register_buffer("smooth", None if smooth is None else smooth.detach().float().cpu().clone())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.weight_max, self.reduce_range = int8_ranges(engine)
        self._pack(_quantize_rows(self._smoothed(linear.weight), self.weight_max))

    def _smoothed(self, weight: torch.Tensor) -> torch.Tensor:
        weight = weight.detach().float().cpu()
        return weight if self.smooth is None else weight * self.smooth

    def _pack(self, qweight: torch.Tensor) -> None:
        bias = None if self.per_token or self.bias is None else self.bias.cpu()
        self._packed = _prepack(qweight, self.engine, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = x / self.smooth if self.smooth is not None else None
        if not self.per_token:
            return torch.ops.quantized.linear_dynamic(x if scaled is None else scaled, self._packed, self.reduce_range)
        # aminmax is the fastest per-row peak; the output is scaled back and biased in one addcmul
        source = x if scaled is None else scaled
        low, high = torch.aminmax(source, dim=-1, keepdim=True)
        peak = torch.maximum(high, low.neg_()).clamp_min_(1e-12)  # per-token activation scale
        scaled = source / peak if scaled is None else scaled.div_(peak)
        y = torch.ops.quantized.linear_dynamic(scaled, self._packed, self.reduce_range)
        return y.mul_(peak) if self.bias is None else torch.addcmul(self.bias, y, peak)

    def int8_weight(self) -> torch.Tensor:
        """The packed weight (times ``smooth`` when smoothed), unpacked: a ``torch.qint8``
        per-channel quantized tensor."""
        weight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return weight

    @torch.no_grad()
    def update_weight(self, weight: torch.Tensor, start: int = 0) -> None:
        """Re-quantize output rows ``start .. start + len(weight)`` from a new float ``weight``
        and repack; the other rows keep their int8 values and scales (each row has its own)."""
        rows = weight.shape[0]
        if weight.dim() != 2 or weight.shape[1] != self.in_features or not 0 <= start <= self.out_features - rows:
            raise ValueError(
                f"Int8Linear.update_weight: weight of shape {tuple(weight.shape)} at row {start} "
                f"does not fit [{self.out_features}, {self.in_features}]"
            )
        current, new = self.int8_weight(), _quantize_rows(self._smoothed(weight), self.weight_max)
        values, scales = current.int_repr().clone(), current.q_per_channel_scales().clone()
        values[start : start + rows] = new.int_repr()
        scales[start : start + rows] = new.q_per_channel_scales()
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        self._pack(torch._make_per_channel_quantized_tensor(values, scales, zero_points, 0))

    @torch.no_grad()
    def update_bias(self, bias: torch.Tensor, start: int = 0) -> None:
        """Copy ``bias`` into entries ``start ..`` of the float bias (repacking when fbgemm adds it)."""
        if self.bias is None:
            raise ValueError("Int8Linear.update_bias: this layer has no bias")
        self.bias[start : start + bias.shape[0]].copy_(bias)
        if not self.per_token:
            self._pack(self.int8_weight())

    def extra_repr(self) -> str:
        scales = "per-token" if self.per_token else "per-call"
        smoothed = ", smoothed" if self.smooth is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int8 dynamic "
            f"({scales} activation scales{smoothed})"
        )


def _quantize_rows(weight: torch.Tensor, weight_max: int) -> torch.Tensor:
    """``weight`` in int8 with one symmetric scale per row (output channel), each row's
    largest magnitude mapped to ``weight_max``."""
    weight = weight.detach().float().cpu()
    scales = (weight.abs().amax(dim=1) / weight_max).clamp_min(1e-8).double()
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    return torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)


def _prepack(qweight: torch.Tensor, engine: str, bias: torch.Tensor | None = None):
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        return torch.ops.quantized.linear_prepack(qweight, bias)
    finally:
        torch.backends.quantized.engine = previous


@functools.cache
def int8_ranges(engine: str) -> tuple[int, bool]:
    """``(weight_max, reduce_range)`` for this CPU's int8 kernel: the widest ranges whose
    products it sums exactly (see the module docstring). ``(127, False)`` with VNNI,
    ``(63, False)`` (7-bit weights) on CPUs whose kernel saturates int16 pair sums, and
    ``(127, True)`` (7-bit activations) if even that saturated."""
    for weight_max, reduce_range in ((127, False), (63, False)):
        if _exact(engine, weight_max, reduce_range):
            return weight_max, reduce_range
    return 127, True


def _exact(engine: str, weight_max: int, reduce_range: bool) -> bool:
    """Whether the kernel's result is exact for the largest operands of these ranges:
    activations that quantize to the top of their range times weights of ``weight_max``."""
    k = 64
    weight = torch.quantize_per_channel(
        torch.ones(8, k),
        torch.full((8,), 1 / weight_max, dtype=torch.double),
        torch.zeros(8, dtype=torch.long),
        0,
        torch.qint8,
    )
    x = torch.ones(4, k)
    x[:, 0] = 0.0  # range [0, 1]: zero point 0, 1.0 -> the top of the activation range
    y = torch.ops.quantized.linear_dynamic(x, _prepack(weight, engine), reduce_range)
    return torch.allclose(y, torch.full_like(y, k - 1), rtol=1e-3)


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Replace the ``nn.Linear`` layers of a loaded float32 CPU ``model`` by :class:`Int8Linear`
    (``method="int8"``, the only one) in place, except those named in :data:`KEEP_FLOAT`.
    Returns the model."""
    engine = _engine_for(method)
    _replace(model, engine, "", _first_names(model))
    return model


def quantize_encoder(model: nn.Module, method: str, calibration_tokens: int = 256) -> nn.Module:
    """Quantize the transformer layers of a loaded float32 CPU encoder ``model`` (every
    :class:`~dfllm.models.bert.BertLayer`) in place: attention ``qkv_proj`` and output ``dense``
    and the MLP's first ``dense`` become :class:`Int8Linear` with one activation scale per call;
    the MLP's second ``dense``, embeddings, norms, the pooler and the heads stay float (see the
    module docstring). ``ValueError`` naming ``quantization`` if the model has no ``BertLayer``
    (nothing would be quantized). Returns the model.

    The two layers reading a LayerNorm's output (``qkv_proj``, the MLP's first ``dense``) are
    smoothed (:data:`SMOOTH_ALPHA`): BERT's LayerNorms leave a few channels of every token far
    larger than the rest, and the activations' one scale would spend its 8 bits on them. The
    channels' magnitudes come from one float forward pass over ``calibration_tokens`` random
    token ids (seed 0: the outlier channels are the model's, whatever the text)."""
    engine = _engine_for(method)
    layers = [m for m in model.modules() if isinstance(m, BertLayer)]
    if not layers:
        raise ValueError(f"quantization={method!r}: {type(model).__name__} has no BERT layers to quantize")
    smooth = _smoothing_factors(model, calibration_tokens)
    for layer in layers:
        attention, mlp = layer.attention, layer.intermediate
        qkv, out, up = attention.self.qkv_proj, attention.output.dense, mlp.dense
        # the attributes are typed nn.Linear; an Int8Linear is called the same way
        attention.self.qkv_proj = Int8Linear(qkv, engine, smooth=smooth[id(qkv)], per_token=False)  # type: ignore[assignment]
        attention.output.dense = Int8Linear(out, engine, per_token=False)  # type: ignore[assignment]
        mlp.dense = Int8Linear(up, engine, smooth=smooth[id(up)], per_token=False)  # type: ignore[assignment]
    return model


# SmoothQuant's migration strength: smooth_j = max|x_j| ** alpha / max|w_j| ** (1 - alpha)
SMOOTH_ALPHA = 0.5


@torch.no_grad()
def _smoothing_factors(model: nn.Module, tokens: int) -> dict[int, torch.Tensor]:
    """``id(linear) -> smooth`` for the encoder's LayerNorm-fed linear layers, from the largest
    magnitude of each input channel over one forward pass on random token ids."""
    targets = {id(m.qkv_proj): m.qkv_proj for m in model.modules() if isinstance(m, BertSelfAttention)}
    targets.update({id(m.dense): m.dense for m in model.modules() if isinstance(m, BertIntermediate)})
    peaks: dict[int, torch.Tensor] = {}

    def record(layer: nn.Module, args: tuple) -> None:
        x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
        peaks[id(layer)] = x if id(layer) not in peaks else torch.maximum(peaks[id(layer)], x)

    hooks = [layer.register_forward_pre_hook(record) for layer in targets.values()]
    try:
        embeddings = next(m for m in model.modules() if isinstance(m, BertEmbeddings))
        length = min(64, getattr(model, "max_input_tokens", None) or embeddings.position_embeddings.num_embeddings)
        rows = max(1, tokens // length)
        device = embeddings.word_embeddings.weight.device
        ids = torch.randint(
            0, embeddings.word_embeddings.num_embeddings, (rows, length), generator=torch.Generator().manual_seed(0)
        ).to(device)
        model(ids, torch.zeros_like(ids), torch.ones_like(ids, dtype=torch.bool))
    finally:
        for hook in hooks:
            hook.remove()
    smooth = {}
    for key, layer in targets.items():
        w_peak = layer.weight.detach().abs().amax(dim=0).float().clamp_min(1e-5)
        factor = peaks[key].clamp_min(1e-5) ** SMOOTH_ALPHA / w_peak ** (1 - SMOOTH_ALPHA)
        smooth[key] = factor.cpu()
    return smooth


def _engine_for(method: str) -> str:
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {method!r}")
    return quantized_engine()


def _first_names(model: nn.Module) -> dict[int, str]:
    """Parameter id -> the name ``named_parameters`` gives it (the first module holding it)."""
    return {id(p): name for name, p in model.named_parameters()}


def _replace(module: nn.Module, engine: str, prefix: str, names: dict[int, str]) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            if name in KEEP_FLOAT:
                continue
            if child.weight.device.type != "cpu" or child.weight.dtype != torch.float32:
                raise ValueError(
                    f"quantization='int8' runs float32 CPU models; layer {name} is "
                    f"{child.weight.dtype} on {child.weight.device}"
                )
            owner = names.get(id(child.weight))
            tied_to = owner if owner is not None and owner != f"{prefix}{name}.weight" else None
            setattr(module, name, Int8Linear(child, engine, tied_to))
        else:
            _replace(child, engine, f"{prefix}{name}.", names)


@dataclass(frozen=True)
class Int8Destination:
    """Where a checkpoint tensor goes in an :class:`Int8Linear`: its ``attr`` ("weight" or
    "bias") from row ``start``, with the ``shape`` the tensor must have."""

    target: str
    layer: Int8Linear
    attr: str
    start: int
    shape: tuple[int, ...]

    @torch.no_grad()
    def copy_(self, tensor: torch.Tensor) -> None:
        """Write ``tensor`` there: re-quantize the weight rows, or copy into the float bias."""
        if self.attr == "weight":
            self.layer.update_weight(tensor, self.start)
        else:
            self.layer.update_bias(tensor, self.start)


def int8_destination(model: nn.Module, packed: dict, name: str) -> Int8Destination | None:
    """Where a checkpoint tensor (parameter-style ``name``) goes in an :class:`Int8Linear`, or
    None when ``name`` is no int8 layer's. A fused layer's part (``q_proj`` of ``qkv_proj``)
    starts at its row offset."""
    target, shard = name, None
    for part, (fused, index) in packed.items():
        if f".{part}." in name:
            target, shard = name.replace(f".{part}.", f".{fused}."), index
            break
    path, _, attr = target.rpartition(".")
    try:
        layer = model.get_submodule(path)
    except AttributeError:
        return None
    if not isinstance(layer, Int8Linear) or attr not in ("weight", "bias") or (attr == "bias" and layer.bias is None):
        return None
    start, rows = 0, layer.out_features
    if shard is not None:
        sizes = getattr(layer, "output_sizes", None)
        if sizes is None:
            return None
        start, rows = sum(sizes[:shard]), sizes[shard]
    shape = (rows, layer.in_features) if attr == "weight" else (rows,)
    return Int8Destination(target, layer, attr, start, shape)


def tied_int8_layers(model: nn.Module, updated: set[str]) -> list[Int8Linear]:
    """The int8 layers whose float source (``tied_to``) is among the ``updated`` parameter keys."""
    return [m for m in model.modules() if isinstance(m, Int8Linear) and m.tied_to in updated]
