"""Who is who in a parallel engine: sizes, each rank's coordinates, and its process groups.

Global rank ``r`` is pipeline stage ``r // tp`` and tensor-parallel rank ``r % tp``. Each
stage's ``tp`` ranks form a tensor-parallel group; the ranks with the same tensor-parallel
rank form a pipeline group (activations flow along it, and the last stage sends the
logits back to global rank 0, the driver).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dfllm.distributed.communication import GroupComm

# How long a rank waits for its peers in a collective or at start-up before failing.
# A dead peer is noticed at once on CPU (gloo sees the closed socket); this bounds the rest.
DEFAULT_TIMEOUT_S = float(os.environ.get("DFLLM_DIST_TIMEOUT_S", "300"))


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine's model is split: ``tensor_parallel_size`` ranks per pipeline stage,
    ``pipeline_parallel_size`` stages."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def coords(self, rank: int) -> tuple[int, int]:
        """``(pipeline stage, tensor-parallel rank)`` of global ``rank``."""
        return divmod(rank, self.tensor_parallel_size)


@dataclass
class ParallelContext:
    """One rank's place in the engine and its groups (None where a size is 1)."""

    rank: int
    config: ParallelConfig
    tp: GroupComm | None
    pp: GroupComm | None

    @property
    def tp_rank(self) -> int:
        return self.config.coords(self.rank)[1]

    @property
    def tp_size(self) -> int:
        return self.config.tensor_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.config.coords(self.rank)[0]

    @property
    def pp_size(self) -> int:
        return self.config.pipeline_parallel_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def layer_range(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """The layers ``[start, end)`` of pipeline ``stage``: consecutive, sizes differing by at most one."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (stage < extra)


def create_store(world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """The driver's rendezvous store on a free local port (``store.port``)."""
    return dist.TCPStore(
        "127.0.0.1", 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def connect_store(port: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """A worker's connection to the driver's store."""
    return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s))


def init_parallel(
    config: ParallelConfig, rank: int, store: dist.Store, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S
) -> ParallelContext:
    """Build this rank's tensor-parallel and pipeline groups (every rank calls this)."""
    stage, tp_rank = config.coords(rank)
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    tp_comm = _group(store, f"tp{stage}", tp_rank, tp, device, timeout_s) if tp > 1 else None
    pp_comm = _group(store, f"pp{tp_rank}", stage, pp, device, timeout_s) if pp > 1 else None
    return ParallelContext(rank, config, tp_comm, pp_comm)


def _group(store: dist.Store, name: str, rank: int, size: int, device: torch.device, timeout_s: float) -> GroupComm:
    prefixed = dist.PrefixStore(name, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    pg: dist.ProcessGroupNCCL | dist.ProcessGroupGloo
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg, deterministic = dist.ProcessGroupNCCL(prefixed, rank, size, opts), False
    else:
        pg, deterministic = dist.ProcessGroupGloo(prefixed, rank, size, timeout), True
    # A backend has the collectives GroupComm calls (allreduce, allgather, send, recv), but
    # torch's stubs declare them on ProcessGroup only.
    return GroupComm(pg, rank, size, deterministic=deterministic)  # type: ignore[arg-type]
