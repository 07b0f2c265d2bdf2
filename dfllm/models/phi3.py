"""Phi-3 / Phi-3.5 / Phi-4-mini decoder: Llama's layout, with checkpoints that hold the fused
``qkv_proj`` and ``gate_up_proj`` tensors themselves.

Without tensor parallelism such a tensor fills its fused parameter as it is. Split over
tensor-parallel ranks, a fused tensor is first cut into its parts (q, k, v; gate, up) and each
rank takes its slice of every part, the layout the rank's fused parameter has.

Rotary: ``partial_rotary_factor`` (only the first part of each head rotates) and the
"longrope" (formerly "su") scaling with short and long factors (see ``rope``).
"""

from __future__ import annotations

from typing import cast

import torch

from dfllm.models.llama import LlamaForCausalLM
from dfllm.models.parallel_layers import shard_range
from dfllm.models.spec import ModelSpec

FUSED_SUFFIXES = (".qkv_proj.weight", ".qkv_proj.bias", ".gate_up_proj.weight", ".gate_up_proj.bias")


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: no biases; fused checkpoint tensors split per part under tensor parallelism."""

    @staticmethod
    def biases(spec: ModelSpec) -> tuple[bool, bool]:
        return False, False

    def weight_destination(self, name: str, read) -> tuple[str, torch.Tensor, torch.Tensor] | None:
        """``(parameter key, destination, tensor)`` for a fused checkpoint tensor on a rank of a
        tensor-parallel group (the loader's hook); None leaves the tensor to the loader."""
        if not name.endswith(FUSED_SUFFIXES):
            return None
        try:
            param = self.get_parameter(name)
        except AttributeError:  # not a parameter of this rank's model: the loader decides
            return None
        shard = getattr(param, "tp_shard", None)
        if shard is None:
            return None  # one rank: the fused tensor is copied as it is
        _, rank, size = shard
        # the rank's share of each part (a plain attribute set by the layer's builder)
        sizes = cast(list[int], self.get_submodule(name.rsplit(".", 1)[0]).output_sizes)
        full = read(None)
        parts, start = [], 0
        for per_rank in sizes:
            part = full.narrow(0, start, per_rank * size)
            lo, hi = shard_range(per_rank * size, rank, size)
            parts.append(part[lo:hi])
            start += per_rank * size
        if start != full.shape[0]:
            raise ValueError(f"tensor {name} has {full.shape[0]} rows, expected {start} (the fused parts' sum)")
        return name, param.data, torch.cat(parts)
