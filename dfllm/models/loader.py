"""Loading a Hugging Face style model directory: its config and safetensors weights.

Weights are read from ``*.safetensors`` only; dfllm never unpickles (``*.bin``/``*.pt``
checkpoints are refused). Fused parameters (``qkv_proj``, ``gate_up_proj``) are filled
from the separate Hugging Face tensors. A parameter split over tensor-parallel ranks
(``tp_shard``, see ``parallel_layers``) reads only its rank's slice of each tensor.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from dfllm.models.quantization import Int8Destination, int8_destination, tied_int8_layers
from dfllm.models.spec import ModelSpec

logger = logging.getLogger("dfllm")

# checkpoint projection name -> (fused parameter name, shard index)
PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "position_ids")
FLOAT_DTYPES = {torch.float32, torch.float16, torch.bfloat16}


def load_config(path: Path) -> PretrainedConfig:
    """The model's ``config.json`` through transformers, never running code from the directory.

    ``trust_remote_code`` is always False: a config whose ``auto_map`` names custom code is
    loaded as its ``model_type`` when transformers knows it (the code is ignored), and
    refused otherwise (transformers would ask to run it)."""
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    if raw.get("auto_map") and raw.get("model_type") not in CONFIG_MAPPING:
        raise ValueError(
            f"model directory {path}: config.json's auto_map names custom code "
            f"({sorted(raw['auto_map'].values())}) for model_type {raw.get('model_type')!r}; dfllm never "
            "runs code from a model directory (no trust_remote_code)"
        )
    return AutoConfig.from_pretrained(path, trust_remote_code=False)


def check_model_dir(path: Path) -> None:
    """Cheap checks of a model directory before any engine is built (the dataframe accessors
    run them at call time): its config, a supported architecture, and weight files whose
    safetensors headers read; each failure raises the error loading would."""
    from dfllm.models.families import supported_architectures, unsupported_architecture_message

    archs = list(ModelSpec.from_hf(load_config(path)).architectures)
    supported = supported_architectures()
    if not any(a in supported for a in archs):
        raise ValueError(unsupported_architecture_message(archs))
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as exc:  # corrupt header, truncated file
            raise ValueError(f"cannot read weights file {file.name}: {exc}") from exc


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files; refuse pickle-only checkpoints."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickles:
        raise ValueError(
            f"model directory {path} holds only pickle weights ({', '.join(pickles)}); dfllm never "
            "unpickles: convert them to safetensors"
        )
    raise FileNotFoundError(f"model directory {path} has no *.safetensors weights")


def load_weights(model: nn.Module, path: Path) -> None:
    """Fill every parameter of ``model`` from the directory's safetensors files."""
    params = dict(model.named_parameters())
    rename = getattr(model, "checkpoint_name", None)
    packed = getattr(model, "packed_modules_mapping", PACKED)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in safetensors_files(path):
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as exc:  # corrupt header, truncated file
            raise ValueError(f"cannot read weights file {file.name}: {exc}") from exc
        with handle as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                key = rename(name) if rename else name
                if key is None:
                    continue
                target = _load_tensor(model, params, packed, key, lambda sl=None, n=name, fh=f: _read(fh, n, sl), file)
                if target is None:
                    unexpected.append(name)
                else:
                    loaded.add(target)
    tied = {n for n in params if n == "lm_head.weight" and getattr(model, "tie_word_embeddings", False)}
    missing = sorted(set(params) - loaded - tied)
    if missing:
        raise ValueError(f"weights missing from {path}: {', '.join(missing[:8])}")
    if unexpected:
        logger.warning("ignored %d unexpected tensors, e.g. %s", len(unexpected), unexpected[:4])


def destination(
    model: nn.Module, params: dict[str, nn.Parameter], packed: dict, name: str
) -> tuple[str, torch.Tensor] | None:
    """The parameter key and the (possibly sliced) parameter tensor a checkpoint tensor fills."""
    target, shard = name, None
    for part, (fused, index) in packed.items():
        if f".{part}." in name:
            target, shard = name.replace(f".{part}.", f".{fused}."), index
            break
    param = params.get(target)
    if param is None:
        return None
    dest = param.data
    if shard is not None:
        # a plain attribute set by the layer's builder (torch's stubs say Tensor | Module)
        sizes = cast(list[int], model.get_submodule(target.rsplit(".", 1)[0]).output_sizes)
        dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
    return target, dest


def check_tensor(name: str, tensor: torch.Tensor, dest: torch.Tensor, where: str) -> None:
    """Raise ``ValueError`` unless ``tensor`` is a float tensor of ``dest``'s shape."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"tensor {name} in {where} has unsupported dtype {tensor.dtype}")
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")


def _load_tensor(
    model: nn.Module, params: dict[str, nn.Parameter], packed: dict, name: str, read, file: Path
) -> str | None:
    """Copy one checkpoint tensor into its (possibly fused) parameter; return its key."""
    own = _own_destination(model, name, read)
    if own is not None:  # a tensor the model places itself (e.g. one expert of a fused expert weight)
        target, dest, tensor = own
        check_tensor(name, tensor, dest, file.name)
        dest.copy_(tensor)
        return target
    found = destination(model, params, packed, name)
    if found is None:
        return None
    target, dest = found
    shard = getattr(params[target], "tp_shard", None)
    tensor = read(shard)
    dest = _shard_dest(dest, params[target], tensor)
    check_tensor(name, tensor, dest, file.name)
    dest.copy_(tensor)
    return target


def _own_destination(model: nn.Module, name: str, read) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """``model.weight_destination(name, read)`` when the model defines it: ``(parameter key,
    destination view, tensor)`` for a checkpoint tensor it places itself, else None.
    ``read(shard)`` gives the tensor, or its rank's slice ``shard = (dim, rank, size)``."""
    own = getattr(model, "weight_destination", None)
    return own(name, read) if own is not None else None


def _read(handle, name: str, shard: tuple[int, int, int] | None) -> torch.Tensor:
    """A checkpoint tensor, or only the rank's slice ``shard = (dim, rank, size)`` of it."""
    if shard is None:
        return handle.get_tensor(name)
    from dfllm.models.parallel_layers import shard_range

    view = handle.get_slice(name)
    dim, rank, size = shard
    shape = view.get_shape()
    if dim >= len(shape):
        return handle.get_tensor(name)  # wrong rank: check_tensor names the shape mismatch
    start, stop = shard_range(shape[dim], rank, size)
    return view[(slice(None),) * dim + (slice(start, stop),)]


def _shard_of(tensor: torch.Tensor, shard: tuple[int, int, int] | None) -> torch.Tensor:
    """The rank's slice of a full tensor handed over in memory (see :func:`_read`)."""
    if shard is None or shard[0] >= tensor.dim():
        return tensor
    from dfllm.models.parallel_layers import shard_range

    dim, rank, size = shard
    start, stop = shard_range(tensor.shape[dim], rank, size)
    return tensor.narrow(dim, start, stop - start)


def _shard_dest(dest: torch.Tensor, param: nn.Parameter, tensor: torch.Tensor) -> torch.Tensor:
    """A split vocabulary that does not divide evenly is padded past its end: such a parameter
    (``tp_padded``) is filled only as far as its slice reaches."""
    shard = getattr(param, "tp_shard", None)
    dim = shard[0] if shard is not None and getattr(param, "tp_padded", False) else None
    if dim is None or tensor.dim() != dest.dim() or tensor.shape[dim] >= dest.shape[dim]:
        return dest
    return dest.narrow(dim, 0, tensor.shape[dim])


def update_weights(model: nn.Module, weights) -> list[str]:
    """Copy ``(name, tensor)`` pairs (checkpoint names) into ``model``; all are checked first.

    An unknown name, a non-float tensor or a wrong shape raises ``ValueError`` before any
    parameter changes. Returns the parameter keys updated. An int8 layer
    (``quantization="int8"``) re-quantizes the rows it receives, and an int8 head tied to the
    embeddings is re-quantized from the updated embedding table.
    """
    params = dict(model.named_parameters())
    rename = getattr(model, "checkpoint_name", None)
    packed = getattr(model, "packed_modules_mapping", PACKED)
    plan = []
    int8_plan: list[tuple[Int8Destination, torch.Tensor]] = []
    for name, tensor in weights:
        key = rename(name) if rename else name
        own = _own_destination(model, key, lambda sl=None, t=tensor: _shard_of(t, sl)) if key is not None else None
        if own is not None:
            check_tensor(name, own[2], own[1], "update_weights")
            plan.append(((own[0], own[1]), own[2]))
            continue
        found = destination(model, params, packed, key) if key is not None else None
        if found is None:
            if key is None:  # another pipeline stage's tensor
                continue
            int8 = int8_destination(model, packed, key)
            if int8 is None:
                raise ValueError(f"update_weights: unknown tensor name {name!r}")
            check_tensor(name, tensor, torch.empty(int8.shape, device="meta"), "update_weights")
            int8_plan.append((int8, tensor))
            continue
        shard = getattr(params[found[0]], "tp_shard", None)
        tensor = _shard_of(tensor, shard)
        found = (found[0], _shard_dest(found[1], params[found[0]], tensor))
        check_tensor(name, tensor, found[1], "update_weights")
        plan.append((found, tensor))
    with torch.no_grad():
        for (_, dest), tensor in plan:
            dest.copy_(tensor)
        for int8, tensor in int8_plan:
            int8.copy_(tensor)
    updated = [target for (target, _), _ in plan]
    for layer in tied_int8_layers(model, set(updated)):
        assert layer.tied_to is not None  # tied_int8_layers matched it
        layer.update_weight(params[layer.tied_to])
    return updated + [int8.target for int8, _ in int8_plan]
