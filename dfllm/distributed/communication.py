"""Collectives over one process group, with the few operations the model layers need."""

from __future__ import annotations

import torch
import torch.distributed as dist


class GroupComm:
    """One process group seen from one of its ranks (``rank`` is the rank inside the group).

    On CPU (gloo) ``all_reduce`` gathers every rank's tensor and sums them in rank order, so
    that every rank gets bit-identical results whatever the group size; on CUDA it is
    NCCL's all-reduce.
    """

    def __init__(self, pg: dist.ProcessGroup, rank: int, size: int, deterministic: bool):
        self.pg, self.rank, self.size = pg, rank, size
        self.deterministic = deterministic

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the group's ranks."""
        if self.deterministic:
            parts = self.all_gather_list(t)
            out = parts[0]
            for p in parts[1:]:
                out = out + p
            return out
        t = t.contiguous()
        self.pg.allreduce([t]).wait()
        return t

    def all_gather_list(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape on all ranks), in rank order."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.pg.allgather([parts], [t]).wait()
        return parts

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``t`` concatenated along ``dim`` in rank order."""
        return torch.cat(self.all_gather_list(t), dim=dim)

    def send(self, t: torch.Tensor, dst: int, tag: int):
        """Start sending ``t`` to group rank ``dst``; the returned work must be waited on
        (and ``t`` kept alive) before the step ends."""
        return self.pg.send([t.contiguous()], dst, tag)

    def recv(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int, tag: int
    ) -> torch.Tensor:
        """Receive a tensor of known ``shape`` and ``dtype`` from group rank ``src``."""
        t = torch.empty(shape, dtype=dtype, device=device)
        self.pg.recv([t], src, tag).wait()
        return t
