"""The sparse mixture-of-experts feed-forward block (Mixtral, Qwen2-MoE, Qwen3-MoE).

A router (``gate``, one logit per expert) picks each token's ``top_k`` experts from the
softmax of its logits; the experts are SwiGLU MLPs whose weights are stacked into two
tensors (``experts.w13_weight``: gate and up, ``experts.w2_weight``: down) so that one
kernel call (``ops.fused_moe``) runs them all. Qwen2-MoE adds a dense shared expert, scaled
per token by ``sigmoid(shared_expert_gate(x))``.

Under a tensor-parallel group every rank holds all experts and the router, but only its
slice of each expert's intermediate features (like :class:`~dfllm.models.layers.GatedMLP`):
the gate/up rows and the down columns of that slice. The partial outputs are summed over the
group after the down projection.

Checkpoints store the experts one by one (``experts.N.w1/w2/w3`` for Mixtral under
``block_sparse_moe``, ``experts.N.gate_proj/up_proj/down_proj`` for the Qwen families) or
fused as transformers v5 holds them in memory (``experts.gate_up_proj`` of shape
``(E, 2 * I, H)`` and ``experts.down_proj`` of shape ``(E, H, I)``);
:func:`expert_weight_destination` places both layouts.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dfllm.distributed.communication import GroupComm
from dfllm.kernels.backend import KernelOps
from dfllm.kernels.fused_moe import route_topk
from dfllm.models.layers import GatedMLP
from dfllm.models.parallel_layers import check_shard_sizes, shard_range


class FusedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs, stacked: ``w13_weight`` ``(E, 2 * I_rank, H)`` (gate rows
    then up rows) and ``w2_weight`` ``(E, H, I_rank)``, where ``I_rank`` is this rank's share
    of the ``intermediate`` features."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: GroupComm | None = None):
        super().__init__()
        check_shard_sizes([intermediate], tp)
        self.tp_rank, self.tp_size = (0, 1) if tp is None else (tp.rank, tp.size)
        self.intermediate = intermediate
        local = intermediate // self.tp_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * local, hidden))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, local))


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) a gated shared expert; ``renormalize`` rescales each
    token's ``top_k`` routing weights to sum to one (Mixtral always, Qwen ``norm_topk_prob``)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        renormalize: bool,
        ops: KernelOps,
        tp: GroupComm | None = None,
        shared_intermediate: int = 0,
    ):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
        self.top_k, self.renormalize, self.ops, self.tp = top_k, renormalize, ops, tp
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden, intermediate, tp)
        self.shared_expert = GatedMLP(hidden, shared_intermediate, False, ops, tp) if shared_intermediate else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(self.gate(x), self.top_k, self.renormalize)
        out = self.ops.fused_moe(x, self.experts.w13_weight, self.experts.w2_weight, weights, ids)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


# model.layers.N.<block>.experts.E.<projection>.weight (one expert) and
# model.layers.N.<block>.experts.<gate_up_proj|down_proj> (transformers v5's fused layout)
_PER_EXPERT = re.compile(
    r"^(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
    r"\.weight$"
)
_FUSED = re.compile(r"^(.*)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")
_GATE_SIDE = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}

Read = Callable[..., torch.Tensor]


def expert_weight_destination(model: nn.Module, name: str, read: Read) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """``(parameter key, destination view, tensor)`` for a checkpoint tensor of a sparse
    block (an expert's projection, fused experts, or Mixtral's ``block_sparse_moe.gate``),
    reading only this rank's slice of the intermediate features; None for any other tensor.

    ``read(shard)`` returns the tensor, or its slice ``shard = (dim, rank, size)``."""
    if ".block_sparse_moe.gate." in name:
        key = name.replace(".block_sparse_moe.", ".mlp.")
        return key, model.get_parameter(key).data, read(None)
    one, fused = _PER_EXPERT.match(name), _FUSED.match(name)
    if one is None and fused is None:
        return None
    prefix = (one or fused).group(1)  # type: ignore[union-attr]  # one of the two matched
    try:
        experts = model.get_submodule(f"{prefix}.mlp.experts")
    except AttributeError:
        return None  # a dense layer where the checkpoint has experts: reported as unexpected
    if not isinstance(experts, FusedExperts):
        return None
    rank, size, full = experts.tp_rank, experts.tp_size, experts.intermediate
    start, stop = shard_range(full, rank, size)
    local = stop - start
    if one is not None:
        index, proj = int(one.group(2)), one.group(3)
        if proj in _GATE_SIDE:
            rows = experts.w13_weight.data[index].narrow(0, _GATE_SIDE[proj] * local, local)
            return f"{prefix}.mlp.experts.w13_weight", rows, read((0, rank, size))
        return f"{prefix}.mlp.experts.w2_weight", experts.w2_weight.data[index], read((1, rank, size))
    if fused.group(2) == "down_proj":  # type: ignore[union-attr]
        return f"{prefix}.mlp.experts.w2_weight", experts.w2_weight.data, read((2, rank, size))
    tensor = read(None)
    if tensor.dim() == 3 and tensor.shape[1] == 2 * full:  # this rank's gate rows, then its up rows
        tensor = torch.cat([tensor[:, start:stop], tensor[:, full + start : full + stop]], dim=1)
    return f"{prefix}.mlp.experts.w13_weight", experts.w13_weight.data, tensor
