"""Tensor and pipeline parallelism: process groups, ranks and collectives.

An engine with ``tensor_parallel_size * pipeline_parallel_size`` ranks runs rank 0 (the
driver) in the calling process and the others in processes it spawns. Collectives go
through ``torch.distributed`` process groups built directly (NCCL on CUDA, gloo on CPU),
never through the global default group, so several engines can live in one process.
"""

from dfllm.distributed.parallel_state import ParallelConfig, ParallelContext

__all__ = ["ParallelConfig", "ParallelContext"]
