"""The adapter slots inside the model: one :class:`LoRASlots` beside each adapted projection.

``attach_lora`` gives every decoder layer of a model (one rank's share of it) a
``qkv_lora``/``o_lora`` on its attention and a ``gate_up_lora``/``down_lora`` on its MLP:
the ``max_loras`` slots' A and B stacked (buffers, not parameters: weight updates and the
checkpoint loader never see them). The layers apply them when the step's metadata carries
:class:`~dfllm.kernels.metadata.LoRAMetadata` (``meta.lora``). Under tensor parallelism each
slot is sharded as its base layer is: a column-parallel projection's B keeps this rank's rows
of each part, a row-parallel projection's A this rank's input columns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dfllm.distributed.communication import GroupComm
from dfllm.kernels.lora import lora_apply
from dfllm.kernels.metadata import LoRAMetadata

# the model's projection -> the checkpoint modules it fuses, and whether it is row-parallel
PROJECTIONS: dict[str, tuple[tuple[str, ...], bool]] = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), False),
    "o_proj": (("o_proj",), True),
    "gate_up_proj": (("gate_proj", "up_proj"), False),
    "down_proj": (("down_proj",), True),
}


class LoRASlots(nn.Module):
    """The adapters of ``max_loras`` slots for one (fused) projection of one layer, on one rank.

    ``a`` is ``[slots, parts * max_rank, in]`` and ``b`` ``[slots, out, parts * max_rank]``;
    a slot's parts are packed one after another from rank 0 (``ranks[slot]`` columns in use),
    each part's B rows at that part's output features; the scaling is folded into B.
    """

    a: torch.Tensor
    b: torch.Tensor

    def __init__(
        self,
        parts: tuple[str, ...],
        in_features: int,
        out_sizes: list[int],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: GroupComm | None = None,
        row_parallel: bool = False,
        triton: bool = False,
    ):
        super().__init__()
        self.parts, self.out_sizes, self.max_rank = parts, out_sizes, max_rank
        width = len(parts) * max_rank
        self.register_buffer(
            "a", torch.zeros(max_loras, width, in_features, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "b", torch.zeros(max_loras, sum(out_sizes), width, dtype=dtype, device=device), persistent=False
        )
        self.ranks = [0] * max_loras
        self.tp, self.row_parallel, self.triton = tp, row_parallel, triton

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` holds these parts' ``(A [r, in], B [out, r] scaled)`` (full, unsharded
        tensors: this rank takes its share); parts not given stay zero."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        rank, size = (0, 1) if self.tp is None else (self.tp.rank, self.tp.size)
        col, row_start = 0, 0
        for part, out in zip(self.parts, self.out_sizes):
            if part in weights:
                a, b = weights[part]
                r = a.shape[0]
                if self.row_parallel:
                    per = self.a.shape[2]
                    a = a[:, rank * per : (rank + 1) * per]
                else:
                    b = b[rank * out : (rank + 1) * out]
                self.a[slot, col : col + r] = a.to(self.a.dtype)
                self.b[slot, row_start : row_start + out, col : col + r] = b.to(self.b.dtype)
                col += r
            row_start += out
        self.ranks[slot] = col

    def forward(self, x: torch.Tensor, y: torch.Tensor, lora: LoRAMetadata) -> torch.Tensor:
        """``y`` (the base projection of ``x``) plus each adapted row's delta."""
        if not any(self.ranks[s] for s in lora.seg_slots):
            return y
        reduce = self.tp.all_reduce if self.row_parallel and self.tp is not None and self.tp.size > 1 else None
        return lora_apply(x, y, self.a, self.b, lora, self.ranks, reduce=reduce, triton=self.triton)


def attach_lora(
    model: nn.Module, max_loras: int, max_rank: int, tp: GroupComm | None = None, triton: bool = False
) -> dict[int, dict[str, LoRASlots]]:
    """Give each decoder layer of ``model`` (a Llama-family model, one rank's share) its adapter
    slots; ``{layer index: {projection: slots}}``."""
    from dfllm.models.layers import GatedMLP, PagedAttention

    dec: Any = model.model
    param = next(model.parameters())
    found: dict[int, dict[str, LoRASlots]] = {}
    for offset, layer in enumerate(dec.stage_layers):
        index = dec.start + offset
        if not isinstance(layer.self_attn, PagedAttention):
            raise ValueError(
                f"enable_lora: layer {index}'s attention ({type(layer.self_attn).__name__}) takes no LoRA adapters"
            )
        attn: Any = layer.self_attn  # Any: its sub-layers' shapes are read through nn.Module attributes
        mlp: Any = layer.mlp

        def slots(name: str, in_features: int, out_sizes: list[int]) -> LoRASlots:
            parts, row = PROJECTIONS[name]
            return LoRASlots(
                parts, in_features, out_sizes, max_loras, max_rank, param.dtype, param.device, tp, row, triton
            )

        h = attn.qkv_proj.weight.shape[1]
        here = {
            "qkv_proj": slots("qkv_proj", h, [attn.q_size, attn.kv_size, attn.kv_size]),
            "o_proj": slots("o_proj", attn.q_size, [attn.o_proj.weight.shape[0]]),
        }
        attn.qkv_lora, attn.o_lora = here["qkv_proj"], here["o_proj"]
        if isinstance(layer.mlp, GatedMLP):
            inter = mlp.gate_up_proj.weight.shape[0] // 2
            here["gate_up_proj"] = slots("gate_up_proj", h, [inter, inter])
            here["down_proj"] = slots("down_proj", inter, [mlp.down_proj.weight.shape[0]])
            mlp.gate_up_lora, mlp.down_lora = here["gate_up_proj"], here["down_proj"]
        found[index] = here
    return found


def supported_modules(slots: dict[int, dict[str, LoRASlots]]) -> set[str]:
    """The checkpoint modules (q_proj, ..., down_proj) every layer of these slots can adapt."""
    per_layer = [{p for name in layer for p in PROJECTIONS[name][0]} for layer in slots.values()]
    return set.intersection(*per_layer) if per_layer else set()
