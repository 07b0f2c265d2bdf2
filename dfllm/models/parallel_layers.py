"""Linear and embedding layers split over the ranks of a tensor-parallel group.

Each parameter that is split carries ``tp_shard = (dim, rank, size)``: the loader reads
only this rank's slice of the checkpoint tensor along ``dim`` (see :func:`shard_range`).
With no group (``tp=None``) the factories return what a single-rank model has always used,
``nn.Embedding`` and ``nn.Linear`` (as :class:`~dfllm.models.cpu_linear.PackableLinear`, which
can multiply through a oneDNN-packed weight on CPU), so one rank pays nothing for this.

- column-parallel (q/k/v, gate/up): each rank holds a slice of the output features; the
  outputs stay split (attention heads and MLP columns are per rank);
- row-parallel (o_proj, down_proj): each rank holds a slice of the input features and the
  partial products are summed over the group (the bias is added once, after the sum);
- vocabulary-parallel embedding and LM head: each rank holds a slice of the vocabulary;
  lookups outside it give zeros and the group sums; the LM head's logits are gathered.

Either LM head returns float32 logits whatever the model's dtype (``dfllm.kernels.logits``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dfllm.distributed.communication import GroupComm
from dfllm.kernels.backend import exact_top_logits
from dfllm.kernels.logits import MARGIN
from dfllm.models.cpu_linear import PackableLinear


def shard_range(full: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s slice ``[start, stop)`` of ``full`` rows split ``size`` ways (the last
    slice may be short when ``size`` does not divide ``full``)."""
    per = -(-full // size)
    start = min(rank * per, full)
    return start, min(full, start + per)


def _mark(param: nn.Parameter, dim: int, tp: GroupComm, full: int | None = None) -> nn.Parameter:
    """Tag ``param`` as this rank's slice along ``dim``; ``full`` (the unsplit size) marks a
    slice that may be padded past the end (``tp_padded``)."""
    # torch's stubs allow no new attributes on a Parameter (a tensor takes any at run time)
    param.tp_shard = (dim, tp.rank, tp.size)  # type: ignore[attr-defined]
    param.tp_padded = full is not None and full % tp.size != 0  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """This rank's slice of each of ``output_sizes`` (fused projections keep one slice of each)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: GroupComm):
        super().__init__()
        check_shard_sizes(output_sizes, tp)
        self.output_sizes = [n // tp.size for n in output_sizes]
        out = sum(self.output_sizes)
        self.weight = _mark(nn.Parameter(torch.empty(out, in_features)), 0, tp)
        self.bias = _mark(nn.Parameter(torch.zeros(out)), 0, tp) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's slice of the input features; the partial outputs are summed over the group."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: GroupComm):
        super().__init__()
        check_shard_sizes([in_features], tp)
        self.tp = tp
        self.weight = _mark(nn.Parameter(torch.empty(out_features, in_features // tp.size)), 1, tp)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows of this rank's vocabulary slice; the group sums the lookups."""

    def __init__(self, vocab_size: int, hidden: int, tp: GroupComm):
        super().__init__()
        self.tp = tp
        self.start, self.stop = shard_range(vocab_size, tp.rank, tp.size)
        self.weight = _mark(nn.Parameter(torch.zeros(-(-vocab_size // tp.size), hidden)), 0, tp, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        x = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary slice, gathered over the group (full vocabulary)."""

    def __init__(self, vocab_size: int, hidden: int, tp: GroupComm):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.weight = _mark(nn.Parameter(torch.zeros(-(-vocab_size // tp.size), hidden)), 0, tp, vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # each rank's slice float32 where it decides: the true maximum of a row lies within its
        # own slice's margin, so refining slice by slice is refining the whole row
        local = lm_head_logits(hidden, self.weight, lambda h: F.linear(h, self.weight))
        return self.tp.all_gather(local, dim=-1)[..., : self.vocab_size]


def lm_head_logits(
    hidden: torch.Tensor, weight: torch.Tensor, linear: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Float32 logits of ``hidden`` ``[rows, h]`` through an LM head of ``weight`` ``[vocab, h]``
    whose own product is ``linear(hidden)``: in float32 as they are; on CUDA from a GEMM that
    writes float32; on a CPU rounded, then the leading entries of each row recomputed in
    float32 (``dfllm.kernels.logits``)."""
    if weight.dtype not in MARGIN:
        return linear(hidden).float()
    if hidden.device.type == "cuda":
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return exact_top_logits(linear(hidden), hidden, weight)


class LMHead(PackableLinear):
    """A single rank's LM head: float32 logits ``[rows, vocab]`` of hidden states ``[rows, h]``."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_head_logits(hidden, self.weight, super().forward)


def column_linear(in_features: int, output_sizes: list[int], bias: bool, tp: GroupComm | None) -> nn.Module:
    """A (fused, when several ``output_sizes``) projection, split by output features under ``tp``."""
    if tp is not None:
        return ColumnParallelLinear(in_features, output_sizes, bias, tp)
    layer = PackableLinear(in_features, sum(output_sizes), bias=bias)
    if len(output_sizes) > 1:
        # torch's stubs type nn.Module.__setattr__'s value as Tensor | Module (it takes any value)
        layer.output_sizes = list(output_sizes)  # type: ignore[assignment]
    return layer


def row_linear(in_features: int, out_features: int, bias: bool, tp: GroupComm | None) -> nn.Module:
    """A projection split by input features under ``tp``, its outputs summed over the group."""
    if tp is not None:
        return RowParallelLinear(in_features, out_features, bias, tp)
    return PackableLinear(in_features, out_features, bias=bias)


def vocab_embedding(vocab_size: int, hidden: int, tp: GroupComm | None) -> nn.Module:
    return nn.Embedding(vocab_size, hidden) if tp is None else VocabParallelEmbedding(vocab_size, hidden, tp)


def lm_head(vocab_size: int, hidden: int, tp: GroupComm | None) -> nn.Module:
    return LMHead(hidden, vocab_size, bias=False) if tp is None else ParallelLMHead(vocab_size, hidden, tp)


def check_shard_sizes(output_sizes: list[int], tp: GroupComm | None) -> None:
    """Raise ``ValueError`` unless every size splits evenly over the group."""
    if tp is not None and any(n % tp.size for n in output_sizes):
        raise ValueError(f"sizes {output_sizes} do not split evenly over {tp.size} tensor-parallel ranks")
