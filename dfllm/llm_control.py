"""Engine control for :class:`dfllm.LLM`: profiling, sleep mode, caches, metrics, weight
updates for RL loops, and RPC to the workers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from dfllm.config import EngineConfig
from dfllm.engine.llm_engine import LLMEngine
from dfllm.engine.metrics import Metric, snapshot
from dfllm.engine.model_runner import call_with_timeout, rpc_target
from dfllm.engine.pooling_engine import PoolingEngine
from dfllm.models.loader import update_weights as apply_weight_update

WEIGHT_TRANSFER_BACKENDS = ("inprocess",)


class EngineControl:
    """vLLM's engine control methods (same names and arguments) over the engine of a
    generative model (``engine``) or of a pooling one (``pooling_engine``; only
    ``collective_rpc``/``apply_model`` and the profiler serve it)."""

    def __init__(
        self,
        cfg: EngineConfig,
        engine: LLMEngine | None,
        pooling_engine: PoolingEngine | None,
    ):
        self.cfg = cfg
        self.engine = engine
        self.pooling_engine = pooling_engine
        self.profiler_dir = Path(cfg.profiler_dir)
        self._profiler: torch.profiler.profile | None = None
        self._profile_prefix: str | None = None
        self._weight_backend: str | None = None
        self._updating_weights = False
        self._weight_version: Any = None

    # ---- profiling ----------------------------------------------------------------------
    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Start the PyTorch profiler around the engine's steps (CPU, and CUDA when used)."""
        if self._profiler is not None:
            raise RuntimeError("start_profile: the profiler is already running")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cfg.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.start()
        self._profile_prefix = profile_prefix or "dfllm"

    def stop_profile(self) -> Path:
        """Stop the profiler and write a Chrome trace into ``profiler_dir``; return its path."""
        if self._profiler is None:
            raise RuntimeError("stop_profile: start_profile was not called")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self.profiler_dir.mkdir(parents=True, exist_ok=True)
        path = self.profiler_dir / f"{self._profile_prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{id(profiler):x}.json"
        profiler.export_chrome_trace(str(path))
        return path

    # ---- sleep mode and caches ------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Release device memory: level 1 moves the weights to host memory and frees the KV
        cache; level 2 frees both (weights are reloaded from the model files on wake-up).
        The prefix cache is reset. On a CPU device the weights already live in host memory,
        so level 1 releases the KV cache only."""
        self.require_generative("sleep").sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Restore what :meth:`sleep` released: ``tags`` among "weights" and "kv_cache" (None:
        both); whether the engine is now fully awake. (``LLM.wake_up`` calls its ``llm_engine``
        directly, as vLLM's does.)"""
        return self.require_generative("wake_up").wake_up(tags)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; returns False (and does nothing) while requests are running."""
        return self.require_generative("reset_prefix_cache").reset_prefix_cache()

    def reset_mm_cache(self) -> None:
        """Forget the processed images and image embeddings cached by a vision-language model
        (keyed by image hash and processor settings); nothing to do for a text-only model."""
        if self.engine is not None:
            self.engine.reset_mm_cache()
        else:
            reset = getattr(self.pooling_engine, "reset_mm_cache", None)
            if reset is not None:
                reset()

    def get_metrics(self) -> list[Metric]:
        """A snapshot of the engine's Prometheus metrics (``dfllm_*``) as Counter, Gauge and
        Histogram objects, each with its name and labels; those vLLM also has are reported a
        second time under vLLM's names (``vllm:num_requests_running``, ``vllm:prompt_tokens``,
        ``vllm:request_generation_tokens``...)."""
        return snapshot(self.require_generative("get_metrics").metrics.registry, vllm_names=True)

    # ---- weight updates ------------------------------------------------------------------
    def init_weight_transfer_engine(self, config: dict | None = None) -> None:
        """Choose how new weights arrive: ``{"backend": "inprocess"}`` (the default) hands
        tensors over directly in this process."""
        backend = (config or {}).get("backend", "inprocess")
        if backend not in WEIGHT_TRANSFER_BACKENDS:
            raise NotImplementedError(
                f"weight transfer backend {backend!r} is not supported "
                f"(available: {', '.join(WEIGHT_TRANSFER_BACKENDS)})"
            )
        self.require_generative("init_weight_transfer_engine")
        self._weight_backend = backend

    def start_weight_update(self) -> None:
        """Begin an update: no request may be queued or running, and none is accepted until
        :meth:`finish_weight_update`."""
        if self._weight_backend is None:
            raise RuntimeError("call init_weight_transfer_engine() before start_weight_update()")
        engine = self.require_generative("start_weight_update")
        engine.check_awake()
        if engine.has_unfinished_requests():
            raise RuntimeError("start_weight_update: requests are still queued or running")
        self._updating_weights = True

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(name, tensor)`` pairs, in the checkpoint's naming, into the model. All are
        checked first: an unknown name or a wrong shape raises before anything changes."""
        if not self._updating_weights:
            raise RuntimeError("call start_weight_update() before update_weights()")
        self.collective_rpc(_update_runner_weights, args=(list(weights),))

    def finish_weight_update(self, weight_version: Any = None) -> None:
        """End the update: the prefix cache (computed with the old weights) is invalidated and
        requests are served again; ``weight_version`` is recorded if given."""
        if not self._updating_weights:
            raise RuntimeError("finish_weight_update: no weight update is in progress")
        self.require_generative("finish_weight_update").reset_prefix_cache()
        self._updating_weights = False
        if weight_version is not None:
            self._weight_version = weight_version

    def update_weight_version(self, version: Any) -> None:
        """Record the version of the weights being served."""
        self._weight_version = version

    def get_weight_version(self) -> Any:
        """The version recorded by :meth:`finish_weight_update` or :meth:`update_weight_version`."""
        return self._weight_version

    # ---- RPC ----------------------------------------------------------------------------------
    def collective_rpc(
        self, method: str | Callable, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list:
        """Run ``method`` on every worker and return one result per worker.

        A worker is the object holding the model (or one rank's share of it) on one device:
        the model runner, one per rank of ``tensor_parallel_size * pipeline_parallel_size``,
        rank 0 (in this process) first; a pooling model has one, its engine. ``method`` is
        the name of one of its methods, or a callable taking the worker first (sent to the
        other ranks with cloudpickle; results come back the same way). ``timeout`` (seconds)
        raises ``TimeoutError`` if the call has not returned by then.
        """
        if self.engine is not None:
            return self.engine.runner.collective_rpc(method, timeout, args, kwargs)
        assert self.pooling_engine is not None
        return [call_with_timeout(rpc_target(self.pooling_engine, method), timeout, args, kwargs or {})]

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list:
        """``func(model)`` on the model of every worker; one result each."""
        return self.collective_rpc(lambda worker: func(worker.model))

    # ---- checks -------------------------------------------------------------------------------
    def require_generative(self, method: str) -> LLMEngine:
        """The generation engine; ``ValueError`` naming ``method`` for a pooling model."""
        if self.engine is None:
            raise ValueError(
                f"{method}: {self.cfg.model_path.name} is loaded as a pooling model; "
                "use embed, classify, score or encode"
            )
        return self.engine

    def check_can_serve(self) -> None:
        """Raise ``RuntimeError`` during a weight update or while the engine is asleep."""
        if self._updating_weights:
            raise RuntimeError("a weight update is in progress; call finish_weight_update() first")
        if self.engine is not None:
            self.engine.check_awake()


def _update_runner_weights(runner, weights: list) -> list[str]:
    """Copy checkpoint-named tensors into one rank's model (its slice of each, when split)."""
    return apply_weight_update(runner.model, weights)
