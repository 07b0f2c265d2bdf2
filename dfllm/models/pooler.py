"""Pooling configuration read from a model directory, and the pooling operations.

sentence-transformers directories describe their pipeline in ``modules.json``: a
``Pooling`` module (``1_Pooling/config.json``: mean, CLS or last-token) and optionally a
``Normalize`` module; ``sentence_bert_config.json`` gives the maximum sequence length.
Without them, BERT embedders use CLS pooling and decoder embedders last-token pooling with
normalisation (as vLLM does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass
class PoolerConfig:
    pooling_type: str
    normalize: bool
    max_length: int | None = None


def load_pooler_config(path: Path, is_decoder: bool) -> PoolerConfig:
    """The pooling pipeline of the model directory (sentence-transformers files if present)."""
    default = PoolerConfig("LAST" if is_decoder else "CLS", normalize=is_decoder)
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return default
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "") for m in modules]
    pooling_type, normalize = default.pooling_type, any(t.endswith(".Normalize") for t in types)
    for m in modules:
        if m.get("type", "").endswith(".Pooling"):
            pooling_type = _pooling_type(json.loads((path / m["path"] / "config.json").read_text()))
    return PoolerConfig(pooling_type, normalize, _max_seq_length(path))


def _pooling_type(cfg: dict) -> str:
    if cfg.get("pooling_mode_mean_tokens"):
        return "MEAN"
    if cfg.get("pooling_mode_cls_token"):
        return "CLS"
    if cfg.get("pooling_mode_lasttoken"):
        return "LAST"
    modes = sorted(k for k, v in cfg.items() if k.startswith("pooling_mode") and v)
    raise ValueError(f"unsupported sentence-transformers pooling mode {modes}; dfllm supports mean, cls, lasttoken")


def _max_seq_length(path: Path) -> int | None:
    cfg_file = path / "sentence_bert_config.json"
    if cfg_file.is_file():
        return json.loads(cfg_file.read_text()).get("max_seq_length")
    return None


def pool(hidden: torch.Tensor, valid: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """Pool right-padded ``hidden`` ``[batch, length, h]`` over the ``valid`` ``[batch, length]`` tokens."""
    if pooling_type == "CLS":
        return hidden[:, 0]
    if pooling_type == "LAST":
        last = valid.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    weights = valid.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


def normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, p=2, dim=-1)
