"""The process that hosts one rank of a parallel engine.

Ranks other than 0 live in processes started (spawn) by ``dfllm.engine.executor``. Such a
process serves commands from its pipe (a step, a method of its ``ModelRunner``, or a
callable) until told to stop, the pipe closes, or its parent dies.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

import cloudpickle
import torch

from dfllm.config import EngineConfig
from dfllm.distributed.parallel_state import (
    ParallelConfig,
    connect_store,
    init_parallel,
)
from dfllm.engine.model_runner import ModelRunner, rpc_target
from dfllm.engine.pipeline import execute_step

PARENT_POLL_S = 1.0
_NUMPY_DTYPES = {torch.int64, torch.int32, torch.bool, torch.float32, torch.float16, torch.float64, torch.uint8}


class _StepPickler(pickle.Pickler):
    """Pickles CPU tensors as numpy arrays: an order of magnitude faster than torch's own
    storage pickling for a step's small index tensors."""

    def reducer_override(self, obj):
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.dtype in _NUMPY_DTYPES:
            return _tensor_from_numpy, (obj.detach().numpy(),)
        return NotImplemented


def _tensor_from_numpy(array) -> torch.Tensor:
    return torch.from_numpy(array)


def dumps_step(obj) -> bytes:
    """The bytes of a command sent to the worker ranks (read back with ``pickle.loads``)."""
    buf = io.BytesIO()
    _StepPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the ``rank``-th GPU after the driver's, or the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", ((device.index or 0) + rank) % torch.cuda.device_count())


def build_runner(cfg: EngineConfig, rank: int, store, device: torch.device) -> ModelRunner:
    """This rank's process groups and its share of the model."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    parallel = init_parallel(ParallelConfig(cfg.tensor_parallel_size, cfg.pipeline_parallel_size), rank, store, device)
    return ModelRunner(cfg, device=device, parallel=parallel)


def worker_main(conn: Connection, cfg: EngineConfig, rank: int, port: int, parent_pid: int, threads: int) -> None:
    """Entry point of a rank's process: build the runner, then serve the driver's commands."""
    _watch_parent(parent_pid)
    if cfg.device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        store = connect_store(port, cfg.world_size)
        _reply(conn, "ok", "connected")  # imports done: the driver may now wait in the rendezvous
        runner = build_runner(cfg, rank, store, rank_device(cfg.device, rank))
    except BaseException:
        _reply(conn, "error", traceback.format_exc())
        sys.exit(1)
    _reply(conn, "ok", os.getpid())
    while True:
        try:
            kind, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the driver is gone
            return
        if kind == "shutdown":
            _reply(conn, "ok", None)
            return
        try:
            result = _serve(runner, kind, payload)
        except BaseException:
            _reply(conn, "error", traceback.format_exc())
            if kind == "step":  # its peers are stuck mid-step: leave, so that they fail at once
                os._exit(1)
            continue
        _reply(conn, "ok", result)


def _serve(runner: ModelRunner, kind: str, payload):
    if kind == "step":
        execute_step(runner, payload)
        return None
    method, args, kwargs = cloudpickle.loads(payload)
    return rpc_target(runner, method)(*args, **kwargs)


def _reply(conn: Connection, status: str, value) -> None:
    try:
        data = cloudpickle.dumps((status, value))
    except Exception as exc:  # an unpicklable result
        data = cloudpickle.dumps(("error", f"the result could not be sent back: {exc!r}"))
    try:
        conn.send_bytes(data)
    except (BrokenPipeError, OSError):
        os._exit(1)


def _watch_parent(parent_pid: int) -> None:
    """Exit as soon as the parent process is gone, whatever the main thread is doing."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="dfllm-parent-watch", daemon=True).start()
