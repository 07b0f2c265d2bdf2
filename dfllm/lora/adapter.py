"""Reading a LoRA adapter as PEFT saves it, checked against the base model before any work.

A folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``...) and ``adapter_model.safetensors`` (never a pickle: a folder with
only ``adapter_model.bin`` is refused). Each targeted projection ``W`` (``in -> out``) of
layer ``i`` has ``lora_A`` (``[r, in]``) and ``lora_B`` (``[out, r]``); the adapted layer
computes ``W x + scaling * B A x`` with ``scaling = lora_alpha / r`` (``lora_alpha /
sqrt(r)`` under ``use_rslora``). Dropout is a training-time thing and is ignored.

Targets are the attention's ``q_proj``/``k_proj``/``v_proj``/``o_proj`` and the MLP's
``gate_proj``/``up_proj``/``down_proj``; an adapter trained on a checkpoint with fused
``qkv_proj``/``gate_up_proj`` (Phi-3) is split as the base loader splits those weights: the
one ``lora_A`` is shared, ``lora_B`` is cut into the parts' rows. Everything else is refused
with :class:`LoRAAdapterError` naming the adapter and the problem: a missing file, a rank
above ``max_lora_rank``, a module the base model does not have (an embedding, the LM head,
``modules_to_save``, a layer past the model's, another stack's ``layers.N`` such as a vision
tower's), tensors whose shapes do not fit the base model (another architecture or size), DoRA,
biases, ``fan_in_fan_out``; a tensor whose rank is not the config's ``r`` (nor one of its
``rank_pattern`` ranks: PEFT could not load it, and its scaling would be a guess); weights
that overflow the model's dtype (float16); a file larger than any adapter of the model can
be (:func:`max_weights_bytes`, :data:`MAX_CONFIG_BYTES`), refused before it is read.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as safetensors_load

from dfllm.errors import shown
from dfllm.lora.request import LoRARequest
from dfllm.models.spec import ModelSpec

# a checkpoint module -> (the model's fused projection it belongs to, its part index)
MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# a tensor of the language model's decoder layers, as PEFT names it on a causal LM
# (``base_model.model.model.layers.N...``), on a bare decoder (``base_model.model.layers.N...``),
# on a vision-language model's language model (``...language_model.layers.N...``,
# ``...language_model.model.layers.N...``) or without PEFT's prefix: never another stack's
# ``layers.N`` (a vision tower's, an encoder's), whose tensors would land on the decoder's layer N
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?(?:model\.)?"
    r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
# safetensors' own limit on a file's JSON header (its Rust reader refuses a longer one)
SAFETENSORS_MAX_HEADER = 100_000_000
# the most bytes of adapter_config.json read (PEFT writes about a kilobyte; lists of every
# layer's module names stay far below)
MAX_CONFIG_BYTES = 16 << 20
# the widest floating-point dtype a weights file may hold (float64), in bytes per value
_WIDEST_FLOAT = 8


class LoRAAdapterError(ValueError):
    """A LoRA adapter that cannot serve this model; the message names the adapter and why."""


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each projection LoRA can target, on the full model."""
    h, q, kv, inter = (
        spec.hidden_size,
        spec.num_attention_heads * spec.head_dim,
        spec.num_key_value_heads * spec.head_dim,
        spec.intermediate_size,
    )
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def max_weights_bytes(spec: ModelSpec, max_lora_rank: int) -> int:
    """The most bytes an ``adapter_model.safetensors`` that :func:`load_adapter` accepts can
    hold for a model of ``spec``: every layer's seven projections at rank ``max_lora_rank`` in
    float64, plus safetensors' longest header. A longer file is refused before it is read (a
    fused ``qkv_proj``/``gate_up_proj`` pair is smaller than its parts; a tensor given twice,
    one of another module or layer, or one of a higher rank is refused anyway)."""
    per_layer = sum(i + o for i, o in module_shapes(spec).values())
    data = spec.num_hidden_layers * max_lora_rank * per_layer * _WIDEST_FLOAT
    return 8 + SAFETENSORS_MAX_HEADER + data


@dataclass
class LoRAAdapter:
    """One adapter's tensors, checked: ``weights[(layer, module)] = (A, B)`` with ``A``
    ``[r, in]`` and ``B`` ``[out, r]`` already multiplied by the module's scaling (float32, CPU)."""

    request: LoRARequest
    rank: int  # the largest rank of its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    identity: str = ""  # what the files it was read from held (dfllm.lora.resolve.digest)

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}

    def merged_into(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hugging Face checkpoint tensors with this adapter merged in (``W + scaling B A``):
        what a separate merged-model job would load (benchmarks, tests)."""
        out = dict(weights)
        for (layer, module), (a, b) in self.weights.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"model.layers.{layer}.{part}.{module}.weight"
            out[name] = (out[name].float() + b @ a).to(out[name].dtype)
        return out


def _fail(request: LoRARequest, why: str) -> LoRAAdapterError:
    return LoRAAdapterError(
        f"LoRA adapter {request.lora_name!r} (lora_int_id={request.lora_int_id}, path {request.lora_path!r}): {why}"
    )


def _check_folder(request: LoRARequest) -> Path:
    """The adapter's folder, with its ``adapter_config.json``."""
    path = Path(request.lora_path)
    if not request.lora_path or not path.is_dir():
        raise _fail(
            request,
            "lora_path is not a directory (a PEFT adapter folder with adapter_config.json "
            "and adapter_model.safetensors)",
        )
    if not (path / "adapter_config.json").is_file():
        raise _fail(request, "adapter_config.json is missing")
    return path


def read_adapter_config(request: LoRARequest, raw: bytes | None = None) -> dict:
    """The adapter's ``adapter_config.json`` (its bytes ``raw``, read already, or read
    now), checked for what dfllm cannot serve."""
    if raw is None:
        try:
            with open(_check_folder(request) / "adapter_config.json", "rb") as f:
                raw = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise _fail(request, f"adapter_config.json cannot be read: {exc}") from None
        if len(raw) > MAX_CONFIG_BYTES:
            raise _fail(request, f"adapter_config.json holds more than {MAX_CONFIG_BYTES} bytes; it is not read")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(request, f"adapter_config.json cannot be read as UTF-8 text: {exc}") from None
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise _fail(request, f"adapter_config.json is not valid JSON: {exc}") from None
    except RecursionError:
        raise _fail(request, "adapter_config.json is not valid JSON: nested too deeply") from None
    if not isinstance(cfg, dict):
        raise _fail(request, f"adapter_config.json must hold a JSON object (PEFT's LoraConfig), not {_json_type(cfg)}")
    return _check_config(request, cfg)


def _json_type(value) -> str:
    """What a JSON value is, for a message (``null``, an array, a number, a string...)."""
    if value is None:
        return "null"
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}
    return kind.get(type(value), type(value).__name__)


def _check_config(request: LoRARequest, cfg: dict) -> dict:
    """``cfg`` (a JSON object) checked for what dfllm cannot serve, its fields' types included."""
    peft_type = cfg.get("peft_type", "LORA")
    if not isinstance(peft_type, str):
        raise _fail(request, f"adapter_config.json: peft_type must be a string, got {shown(peft_type)}")
    peft_type = peft_type.upper()
    if peft_type != "LORA":
        raise _fail(request, f"peft_type {shown(peft_type)} is not LoRA")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(key) == bad:
            raise _fail(request, f"{key}={bad} is not supported")
    if cfg.get("bias", "none") != "none":
        raise _fail(request, f"bias={shown(cfg['bias'])} is not supported (adapters without bias terms only)")
    if cfg.get("modules_to_save"):
        raise _fail(
            request,
            f"modules_to_save {shown(cfg['modules_to_save'])} is not supported: it replaces whole "
            "modules of the base model, which adapters sharing one batch cannot do",
        )
    if cfg.get("alpha_pattern"):
        raise _fail(request, "alpha_pattern is not supported (one lora_alpha for every module)")
    for key in ("use_dora", "fan_in_fan_out", "use_rslora"):
        if not isinstance(cfg.get(key, False), bool):
            raise _fail(request, f"adapter_config.json: {key} must be true or false, got {shown(cfg[key])}")
    targets = cfg.get("target_modules")
    if targets is not None and not isinstance(targets, str | list):
        raise _fail(
            request,
            f"adapter_config.json: target_modules must be a list of module names (or PEFT's regular "
            f"expression string), got {shown(targets)}",
        )
    if isinstance(targets, list):
        odd = [t for t in targets if not isinstance(t, str)]
        if odd:
            raise _fail(request, f"adapter_config.json: target_modules must be module names, got {shown(odd[0])}")
        # PEFT matches a name to every module whose dotted path ends with it ("self_attn.q_proj")
        unknown = sorted(t for t in set(targets) if t.rsplit(".", 1)[-1] not in MODULES and t not in FUSED_PARTS)
        if unknown:
            raise _fail(
                request,
                f"target_modules {shown(unknown)} are modules the base model does not have as LoRA "
                f"targets (supported: {sorted(MODULES) + sorted(FUSED_PARTS)})",
            )
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise _fail(request, f"adapter_config.json: r must be a positive whole number (the rank), got {shown(r)}")
    alpha = cfg.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < _as_float(alpha) < math.inf:
        raise _fail(request, f"adapter_config.json: lora_alpha must be a positive finite number, got {shown(alpha)}")
    pattern = cfg.get("rank_pattern") or {}
    if not isinstance(pattern, dict) or any(
        isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in pattern.values()
    ):
        raise _fail(
            request,
            f"adapter_config.json: rank_pattern must map module names to positive whole numbers, got {shown(pattern)}",
        )
    return cfg


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_float(value: int | float) -> float:
    """``value`` as a float; NaN for an int too large for one (never ``OverflowError``)."""
    try:
        return float(value)
    except OverflowError:
        return math.nan


def _config_ranks(cfg: dict) -> set[int]:
    """The ranks a checked ``adapter_config.json`` gives its modules: ``r``, and each rank of
    ``rank_pattern`` (PEFT's per-module ranks, matched by regular expressions dfllm does not
    run: a module's rank must be one of them)."""
    return {cfg["r"], *(cfg.get("rank_pattern") or {}).values()}


def load_adapter(
    request: LoRARequest, spec: ModelSpec, max_lora_rank: int, dtype: torch.dtype = torch.float32
) -> LoRAAdapter:
    """Read and check the adapter of ``request`` for a model of ``spec`` that runs in
    ``dtype`` (its weights must be finite there too: a float16 model's slots hold them as
    float16); raise :class:`LoRAAdapterError` naming the problem (see the module docstring).
    Whatever else goes wrong reading its files (a file cut short, a tensor of an odd type) is
    a :class:`LoRAAdapterError` too, naming the adapter: the rows that use it fail, not the call."""
    try:
        return _load_adapter(request, spec, max_lora_rank, dtype)
    except LoRAAdapterError:
        raise
    except Exception as exc:  # noqa: BLE001  (a file dfllm cannot read: the adapter's rows' error)
        raise _fail(request, f"its files cannot be read: {type(exc).__name__}: {exc}") from None


def _load_adapter(request: LoRARequest, spec: ModelSpec, max_lora_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    from dfllm.lora.resolve import read_files

    path = _check_folder(request)
    if not (path / "adapter_model.safetensors").is_file():
        pickle = (
            " (only adapter_model.bin, a pickle, which dfllm never loads)"
            if (path / "adapter_model.bin").is_file()
            else ""
        )
        raise _fail(request, f"adapter_model.safetensors is missing{pickle}")
    limits = {  # a file no adapter can fill is never read: file name -> (most bytes, why)
        "adapter_config.json": (MAX_CONFIG_BYTES, "any PEFT adapter_config.json"),
        "adapter_model.safetensors": (
            max_weights_bytes(spec, max_lora_rank),
            f"any adapter of this model with rank <= max_lora_rank={max_lora_rank}",
        ),
    }
    for name, (limit, whose) in limits.items():
        try:
            size = (path / name).stat().st_size
        except OSError as exc:
            raise _fail(request, f"{name} cannot be read: {exc}") from None
        if size > limit:
            raise _fail(request, f"{name} holds {size} bytes, more than {whose} ({limit} bytes); it is not read")
    try:  # both files read once: the identity is that of the bytes parsed below
        contents, identity = read_files(str(path), {name: limit for name, (limit, _) in limits.items()})
    except OSError as exc:
        raise _fail(request, f"its files cannot be read: {exc}") from None
    if request.identity is not None and identity != request.identity:
        raise _fail(
            request,
            f"its files changed after this job read them (they hold {identity[:16]}, not "
            f"{request.identity[:16]}): the rows that named it are not run with other weights",
        )
    cfg = read_adapter_config(request, contents["adapter_config.json"])
    alpha, rslora = float(cfg["lora_alpha"]), bool(cfg.get("use_rslora", False))
    ranks = _config_ranks(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        tensors = safetensors_load(contents["adapter_model.safetensors"])
    except Exception as exc:  # noqa: BLE001  (a corrupt file: name it)
        raise _fail(request, f"adapter_model.safetensors cannot be read: {exc}") from None
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise _fail(
                request,
                f"tensor {shown(key)} is not a LoRA A/B weight of a q/k/v/o or gate/up/down "
                "projection of a decoder layer (embeddings, the LM head and other modules "
                "are not supported)",
            )
        layer, part, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in MODULES and module not in FUSED_PARTS:
            raise _fail(
                request,
                f"tensor {shown(key)} targets a {part} module the base model does not have "
                f"(LoRA targets: {sorted(MODULES)})",
            )
        if layer >= spec.num_hidden_layers:
            raise _fail(
                request,
                f"tensor {shown(key)} is for layer {layer}, but the base model has {spec.num_hidden_layers} layers",
            )
        if not tensor.is_floating_point():
            raise _fail(request, f"tensor {shown(key)} is {tensor.dtype}, not floating point")
        value = tensor.float()
        if not bool(torch.isfinite(value).all()):
            raise _fail(request, f"tensor {shown(key)} holds values that are not finite in float32 (NaN or infinity)")
        if ab in pairs.get((layer, module), {}):
            raise _fail(request, f"tensor {shown(key)}: layer {layer} {module} lora_{ab} is given twice")
        pairs.setdefault((layer, module), {})[ab] = value
    if not pairs:
        raise _fail(request, "adapter_model.safetensors holds no LoRA weights")
    shapes = module_shapes(spec)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise _fail(request, f"{where} has lora_{''.join(ab)} but not lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise _fail(
                request,
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                "each other ([r, in] and [out, r])",
            )
        r = a.shape[0]
        if r < 1:
            raise _fail(request, f"{where} has rank 0 (empty lora_A and lora_B)")
        if r > max_lora_rank:
            raise _fail(
                request, f"{where} has rank {r}, above max_lora_rank={max_lora_rank} (raise LLM(max_lora_rank=...))"
            )
        if r not in ranks:  # PEFT cannot load it; vLLM would scale it by lora_alpha / r: no guess
            given = f"r={shown(cfg['r'])}" + (
                f" and rank_pattern ranks {shown(sorted(ranks - {cfg['r']}))}" if len(ranks) > 1 else ""
            )
            raise _fail(
                request,
                f"{where} has rank {r} (lora_A {tuple(a.shape)}), but adapter_config.json gives {given}: "
                "its scaling lora_alpha / r would be a guess",
            )
        rank = max(rank, r)
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        parts = FUSED_PARTS.get(module, (module,))
        sizes = [shapes[p][1] for p in parts]
        want_in, want_out = shapes[parts[0]][0], sum(sizes)
        if a.shape[1] != want_in or b.shape[0] != want_out:
            raise _fail(
                request,
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                f"base model's {module} ({want_in} -> {want_out} features): an adapter for "
                "another model or size",
            )
        for p, b_part in zip(parts, b.split(sizes)):
            if (layer, p) in weights:
                raise _fail(request, f"layer {layer} {p} is given twice (fused and on its own)")
            scaled = (b_part * scaling).contiguous()
            if not bool(torch.isfinite(scaled).all()):
                raise _fail(
                    request,
                    f"{where}: lora_B times the scaling {scaling:g} (lora_alpha={cfg['lora_alpha']!r}) "
                    "is not finite (it overflows float32)",
                )
            for name, value in (("lora_A", a), (f"lora_B times the scaling {scaling:g}", scaled)):
                if not bool(torch.isfinite(value.to(dtype)).all()):  # what the model's slots would hold
                    raise _fail(
                        request,
                        f"{where}: {name} (lora_alpha={cfg['lora_alpha']!r}) overflows {_dtype_name(dtype)}, "
                        "the model's dtype",
                    )
            weights[(layer, p)] = (a.contiguous(), scaled)
    return LoRAAdapter(request, rank, weights, identity)
