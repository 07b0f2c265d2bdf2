"""The driver of a parallel engine: rank 0 in the calling process, the other ranks in
processes it spawns.

:class:`ParallelExecutor` stands where a single-rank engine has its ``ModelRunner``: the
engine calls the same methods (:class:`dfllm.engine.runner.Runner`) and the executor runs
them on every rank. Each step it splits the scheduled sequences into micro-batches (one per
pipeline stage), prepares their inputs once, sends them to the worker ranks through their
pipes, runs rank 0's part and returns the logits. Failures are bounded in time: a rank
that dies is seen at once (its process sentinel, its pipe, the collectives' closed sockets)
or at the latest after the collectives' timeout, and the executor then raises
``RuntimeError`` naming the rank and stops the others. Worker ranks also exit on their own when the
driver's process dies.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

import cloudpickle
import torch

from dfllm.config import EngineConfig
from dfllm.distributed.parallel_state import create_store
from dfllm.engine.model_runner import ModelRunner, call_with_timeout, rpc_target
from dfllm.engine.pipeline import execute_step
from dfllm.engine.scheduler import SchedulerOutput
from dfllm.engine.step_inputs import StepInputs, StepOutput, prepare_inputs
from dfllm.engine.worker import build_runner, dumps_step, worker_main
from dfllm.multimodal.encoder import move_mm, step_mm_kwargs

logger = logging.getLogger("dfllm")

POLL_S = 0.5  # how often a wait re-checks that the worker processes live
STOP_GRACE_S = 5.0  # how long a worker gets to exit by itself at shutdown


@dataclass
class _Rank:
    """A worker rank's process and the driver's end of its pipe."""

    rank: int
    process: mp.process.BaseProcess
    conn: Connection
    stale: int = 0  # replies still owed to calls that timed out

    def describe(self) -> str:
        code = self.process.exitcode
        state = "is alive" if code is None else f"exited with code {code}"
        return f"rank {self.rank} (pid {self.process.pid}) {state}"


class ParallelExecutor:
    """Runs one engine's model over ``tensor_parallel_size * pipeline_parallel_size`` ranks."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.world_size = cfg.world_size
        self.failure: str | None = None
        _check_devices(cfg.device, self.world_size)
        self.threads = _threads_per_rank(cfg.device, self.world_size)
        store = create_store(self.world_size)
        self.workers = _spawn(cfg, store.port, self.threads, self.world_size)
        self._finalizer = weakref.finalize(self, _stop, self.workers)
        try:
            self._gather_replies()  # every rank started (a rank failing to import fails here, not in a timeout)
            self.driver: ModelRunner = build_runner(cfg, 0, store, cfg.device)
            self._gather_replies()
        except BaseException as exc:
            self._fail(exc, "starting the engine")
        self._store = store  # kept alive: the workers' groups were set up through it
        logger.info(
            "parallel engine: tensor_parallel_size=%d pipeline_parallel_size=%d, worker pids %s",
            cfg.tensor_parallel_size,
            cfg.pipeline_parallel_size,
            [w.process.pid for w in self.workers],
        )

    # ---- what the engine calls on its runner (dfllm.engine.runner.Runner) -------------
    @property
    def model(self) -> torch.nn.Module | None:
        """Rank 0's share of the model."""
        return self.driver.model

    @property
    def block_bytes(self) -> int:
        return self.driver.block_bytes

    def plan_num_blocks(self) -> int:
        """The number of KV blocks every rank can hold (the smallest of the ranks' plans)."""
        return min(self.collective_rpc("plan_num_blocks"))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("allocate_kv_cache", args=(num_blocks,))

    def free_kv_cache(self) -> None:
        self.collective_rpc("free_kv_cache")

    def offload_weights(self) -> None:
        self.collective_rpc("offload_weights")

    def onload_weights(self) -> None:
        self.collective_rpc("onload_weights")

    def drop_weights(self) -> None:
        self.collective_rpc("drop_weights")

    def reload_weights(self) -> None:
        self.collective_rpc("reload_weights")

    def set_lora_slot(self, slot: int, adapter) -> None:
        """Copy a LoRA adapter (None: zeros) into slot ``slot`` on every rank."""
        self.collective_rpc("set_lora_slot", args=(slot, adapter))

    def lora_modules(self) -> set[str]:
        return self.driver.lora_modules()

    def run(self, sched: SchedulerOutput) -> StepOutput:
        """One step on every rank; the logits (float32, on rank 0's device) of the rows that
        sample and of the prompt positions whose log-probabilities were asked for."""
        self._check_alive()
        parts = _micro_batches(sched, self.cfg.pipeline_parallel_size)
        micro = [prepare_inputs(part, self.cfg.block_size, torch.device("cpu")) for part in parts]
        if self.cfg.model.multimodal is not None:  # images: encoded on rank 0 only, their embeddings shipped
            for part, mb in zip(parts, micro):
                mb.mm = move_mm(
                    step_mm_kwargs(self.driver.model, part, self.driver.encoder_cache, self.driver.device),
                    torch.device("cpu"),
                )
        shipped = [StepInputs(mb.input_ids, mb.positions, mb.meta, mb.logit_rows, [], [], mb.mm) for mb in micro]
        try:
            self._send(dumps_step(("step", shipped)))
            logits = execute_step(self.driver, micro)
            self._gather_replies()
        except BaseException as exc:
            self._fail(exc, "a step")
        assert logits is not None  # rank 0 (the driver) gets the logits
        return StepOutput.split(logits, micro)

    # ---- RPC -------------------------------------------------------------------------------
    def collective_rpc(
        self, method: str | Callable, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list:
        """``method`` (a ``ModelRunner`` method name, or a callable taking the runner first) on
        every rank at once; one result per rank, rank 0 first."""
        self._check_alive()
        kwargs = kwargs or {}
        payload = cloudpickle.dumps((method, args, kwargs))
        fn = rpc_target(self.driver, method)
        try:
            self._send(pickle.dumps(("rpc", payload)))
        except BaseException as exc:
            self._fail(exc, f"collective_rpc({method!r})")
        try:
            first = call_with_timeout(fn, timeout, args, kwargs, " (rank 0)")
        except TimeoutError:
            for w in self.workers:
                w.stale += 1
            raise
        except BaseException:
            self._gather_replies(raise_errors=False)  # keep the pipes in step
            raise
        try:
            return [first] + self._gather_replies(timeout=timeout)
        except _RankDied as exc:
            self._fail(exc, f"collective_rpc({method!r})")

    # ---- lifecycle ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the worker processes (idempotent); the executor cannot be used afterwards."""
        if self.failure is None:
            self.failure = "the engine was shut down"
        self._finalizer()

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"the parallel engine is stopped: {self.failure}")

    def _fail(self, exc: BaseException, during: str) -> NoReturn:
        """Stop every worker and raise: a dead rank is named; an error in a rank is passed on."""
        dead = [w for w in self.workers if not _alive(w)]
        if dead:
            message = f"{', '.join(w.describe() for w in dead)} during {during}"
            self.failure = message
            _stop(self.workers)
            raise RuntimeError(f"parallel engine failed: {message}; the other ranks were stopped") from exc
        self.failure = f"{type(exc).__name__} during {during}: {exc}"
        _stop(self.workers)
        raise exc

    def _send(self, data: bytes) -> None:
        for w in self.workers:
            try:
                w.conn.send_bytes(data)
            except (BrokenPipeError, OSError) as exc:
                raise _RankDied(w.describe()) from exc

    def _gather_replies(self, timeout: float | None = None, raise_errors: bool = True) -> list:
        """Each worker's reply to the last command, in rank order."""
        results, errors = [], []
        for w in self.workers:
            while w.stale:  # a reply to a call that timed out
                _receive(w, None)
                w.stale -= 1
            try:
                status, value = _receive(w, timeout)
            except TimeoutError:
                for late in self.workers[self.workers.index(w) :]:
                    late.stale += 1
                raise
            if status == "error":
                errors.append(f"rank {w.rank}:\n{value}")
            results.append(value)
        if errors and raise_errors:
            raise RuntimeError("worker rank failed: " + "\n".join(errors))
        return results


class _RankDied(RuntimeError):
    pass


def _receive(w: _Rank, timeout: float | None) -> tuple[str, Any]:
    """Wait for one reply from ``w``; raise ``_RankDied`` if its process ends first."""
    waited = 0.0
    while True:
        ready = wait([w.conn, w.process.sentinel], POLL_S)
        if w.conn in ready:
            try:
                return cloudpickle.loads(w.conn.recv_bytes())
            except (EOFError, OSError) as exc:
                w.process.join(STOP_GRACE_S)
                raise _RankDied(w.describe()) from exc
        if ready:  # the process ended without replying
            w.process.join(STOP_GRACE_S)
            raise _RankDied(w.describe())
        waited += POLL_S
        if timeout is not None and waited >= timeout:
            raise TimeoutError(f"collective_rpc did not return within {timeout} s (rank {w.rank})")


def _alive(w: _Rank) -> bool:
    if not w.process.is_alive():
        return False
    w.process.join(0.2)  # a rank killed a moment ago may still be exiting
    return w.process.is_alive()


def _spawn(cfg: EngineConfig, port: int, threads: int | None, world_size: int) -> list[_Rank]:
    ctx = mp.get_context("spawn")
    workers = []
    for rank in range(1, world_size):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=worker_main,
            args=(child, cfg, rank, port, os.getpid(), threads or 1),
            name=f"dfllm-rank{rank}",
            daemon=True,
        )
        with _children_allowed():
            proc.start()
        child.close()
        workers.append(_Rank(rank, proc, parent))
    return workers


@contextlib.contextmanager
def _children_allowed():
    """Let a daemonic process (a Dask worker under a nanny) start the ranks.

    multiprocessing forbids it because a daemonic parent may be terminated without
    cleaning up its children; dfllm's ranks watch their parent and exit when it is gone.
    """
    config = mp.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        if daemon is None:
            config.pop("daemon", None)
        else:
            config["daemon"] = daemon


def _stop(workers: list[_Rank]) -> None:
    """Ask each worker to exit, then terminate (and kill) any that does not."""
    for w in workers:
        if w.process.is_alive():
            try:
                w.conn.send_bytes(pickle.dumps(("shutdown", None)))
            except (BrokenPipeError, OSError):
                pass
    for w in workers:
        w.process.join(STOP_GRACE_S)
        if w.process.is_alive():
            w.process.terminate()
            w.process.join(STOP_GRACE_S)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.conn.close()


def _check_devices(device: torch.device, world_size: int) -> None:
    """On CUDA each rank needs a GPU of its own, from the engine's device on."""
    if device.type != "cuda":
        return
    available = torch.cuda.device_count() - (device.index or 0)
    if world_size > available:
        raise ValueError(
            f"tensor_parallel_size * pipeline_parallel_size = {world_size} ranks need {world_size} "
            f"GPUs from {device} on; {available} are visible"
        )


def _threads_per_rank(device: torch.device, world_size: int) -> int | None:
    """On CPU the ranks share the cores: each spawned rank gets an equal part of this
    process's threads. Rank 0 keeps the caller's count (changing it around every step
    measured 10 ms a step slower: OpenMP rebuilds its thread team)."""
    if device.type != "cpu":
        return None
    return max(1, torch.get_num_threads() // world_size)


def _micro_batches(sched: SchedulerOutput, stages: int) -> list[SchedulerOutput]:
    """The step's sequences in ``stages`` consecutive groups of about equal tokens (fewer
    when there are fewer sequences), so that every pipeline stage has one in flight."""
    parts = min(stages, len(sched.seqs))
    if parts <= 1:
        return [sched]
    target = sched.total_tokens / parts
    groups: list[SchedulerOutput] = [SchedulerOutput()]
    done = 0
    for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_new_tokens)):
        left_seqs, left_groups = len(sched.seqs) - i, parts - len(groups)
        # a new group once this sequence would end past the group's share more than short of it
        full = groups[-1].seqs and (done + n / 2 >= target * len(groups) or left_seqs <= left_groups)
        if full and len(groups) < parts:
            groups.append(SchedulerOutput())
        groups[-1].seqs.append(seq)
        groups[-1].num_new_tokens.append(n)
        done += n
    return groups
