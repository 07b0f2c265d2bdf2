"""What the engine calls on the object that runs its model, the factory that builds it, and the LoRA
adapters' manager over it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from dfllm.config import EngineConfig
from dfllm.engine.executor import ParallelExecutor
from dfllm.engine.model_runner import ModelRunner
from dfllm.engine.scheduler import SchedulerOutput
from dfllm.engine.step_inputs import StepOutput
from dfllm.lora.manager import LoRAManager


class Runner(Protocol):
    """The model and its KV cache, on one rank (:class:`ModelRunner`) or split over several
    (:class:`ParallelExecutor`, which runs each call on every rank)."""

    @property
    def model(self) -> torch.nn.Module | None:
        """The model (rank 0's share of it); None while its weights are dropped."""

    @property
    def block_bytes(self) -> int:
        """Bytes of keys and values one KV block holds (on one rank)."""

    def plan_num_blocks(self) -> int:
        """How many KV blocks to allocate, from the config's ``kv_cache_memory_bytes``, or
        ``gpu_memory_utilization``/free memory, ``max_num_seqs`` and ``max_num_batched_tokens``."""

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache (left uninitialised) and attach it to the attention layers."""

    def free_kv_cache(self) -> None:
        """Release the KV cache."""

    def offload_weights(self) -> None:
        """Move the weights to host memory."""

    def onload_weights(self) -> None:
        """Move offloaded weights back to the device."""

    def drop_weights(self) -> None:
        """Release the weights entirely."""

    def reload_weights(self) -> None:
        """Rebuild dropped weights from the model files."""

    def set_lora_slot(self, slot: int, adapter) -> None:
        """Copy a LoRA adapter (:class:`~dfllm.lora.adapter.LoRAAdapter`; None: zeros) into
        adapter slot ``slot`` (``enable_lora``), on every rank."""

    def lora_modules(self) -> set[str]:
        """The checkpoint modules LoRA adapters may target in this model (``enable_lora``)."""

    def run(self, sched: SchedulerOutput) -> StepOutput:
        """Compute one step: the logits (float32, on the model's device) of the rows that sample, their
        sequences, and the logits of the prompt positions whose log-probabilities were asked for."""

    def collective_rpc(
        self, method: str | Callable, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list:
        """``method`` (a ``ModelRunner`` method name, or a callable taking the runner first) on
        every rank; one result per rank, rank 0 first."""

    def shutdown(self) -> None:
        """Stop the worker processes, if any; the runner cannot be used afterwards."""


def make_runner(cfg: EngineConfig) -> Runner:
    """The runner of a generative engine: a :class:`ModelRunner` on one rank, or a
    :class:`ParallelExecutor` over ``tensor_parallel_size * pipeline_parallel_size`` ranks."""
    if cfg.world_size > 1:
        return ParallelExecutor(cfg)
    return ModelRunner(cfg)


def lora_manager(cfg: EngineConfig, runner: Runner) -> LoRAManager | None:
    """The LoRA adapters' CPU cache and the model's slots on ``runner`` (``enable_lora``), else None."""
    if not cfg.enable_lora:
        return None
    return LoRAManager(
        cfg.model,
        cfg.max_loras,
        cfg.max_lora_rank,
        cfg.max_cpu_loras,
        runner.set_lora_slot,
        runner.lora_modules(),
        dtype=cfg.dtype,
    )
