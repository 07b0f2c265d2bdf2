"""One rank of a parallel engine: its part of each step, and the process that hosts a rank.

Every rank runs :func:`execute_step` on the same micro-batches. Under pipeline
parallelism a stage receives each micro-batch's hidden states from the stage before,
runs its layers and sends them on without waiting, so while one stage works on
micro-batch ``i`` the previous one already computes ``i + 1``; the last stage sends the
logits of the sampled rows back to rank 0 (the driver), which samples.

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
from dataclasses import replace
from multiprocessing.connection import Connection

import cloudpickle
import torch

from dfllm.config import EngineConfig
from dfllm.distributed.parallel_state import ParallelConfig, connect_store, init_parallel
from dfllm.engine.model_runner import ModelRunner, StepInputs
from dfllm.kernels.backend import select_ops
from dfllm.kernels.metadata import AttentionMetadata

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


@torch.inference_mode()
def execute_step(runner: ModelRunner, micro: list[StepInputs]) -> torch.Tensor | None:
    """This rank's part of one step over its micro-batches; on rank 0 the logits (float32,
    on CPU) of the sampled rows of all micro-batches, in order; None elsewhere."""
    ctx = runner.parallel
    pending: list = []  # sends in flight, with the tensors they read (kept alive until done)
    logits: list[torch.Tensor] = []
    for i, mb in enumerate(micro):
        mb = move_inputs(mb, runner.device)
        out = runner.model(mb.input_ids, mb.positions, mb.meta, _receive_hidden(runner, mb, i))
        if not ctx.is_last_stage:
            for k, t in enumerate(out):
                t = t.contiguous()
                pending.append((ctx.pp.send(t, ctx.pp_rank + 1, 2 * i + k), t))
            continue
        part = _logits(runner, out, mb.logit_rows)
        if ctx.is_driver:
            logits.append(part)
        elif ctx.tp_rank == 0 and part.numel():  # the last stage's first rank answers rank 0
            pending.append((ctx.pp.send(part, 0, LOGITS_TAG + i), part))
    if ctx.is_driver and not ctx.is_last_stage:
        logits = [_receive_logits(runner, mb, i) for i, mb in enumerate(micro)]
    for work, _ in pending:
        work.wait()
    if not ctx.is_driver:
        return None
    return torch.cat([t.cpu() for t in logits]) if logits else torch.empty(0, runner.config.vocab_size)


LOGITS_TAG = 1_000_000  # pipeline tags: 2i and 2i + 1 carry micro-batch i's hidden states and residual


def _receive_hidden(runner: ModelRunner, mb: StepInputs, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Micro-batch ``i``'s hidden states and residual from the previous stage (None on the first)."""
    ctx = runner.parallel
    if ctx.is_first_stage:
        return None
    shape = (mb.input_ids.numel(), runner.config.hidden_size)
    return tuple(ctx.pp.recv(shape, runner.dtype, runner.device, ctx.pp_rank - 1, 2 * i + k) for k in (0, 1))


def _logits(runner: ModelRunner, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    if rows.numel() == 0:
        return torch.empty(0, runner.config.vocab_size, device=runner.device)
    return runner.model.compute_logits(hidden[rows]).float()


def _receive_logits(runner: ModelRunner, mb: StepInputs, i: int) -> torch.Tensor:
    rows, vocab = mb.logit_rows.numel(), runner.config.vocab_size
    if rows == 0:
        return torch.empty(0, vocab)
    return runner.parallel.pp.recv((rows, vocab), torch.float32, runner.device, runner.parallel.pp_size - 1,
                                   LOGITS_TAG + i)


def move_inputs(inputs: StepInputs, device: torch.device) -> StepInputs:
    """``inputs`` with every tensor on ``device`` (as is when already there)."""
    if inputs.input_ids.device == device:
        return inputs

    def to(x):
        return None if x is None else x.to(device, non_blocking=True)

    m: AttentionMetadata = inputs.meta
    prefills = [replace(p, kv_slots=to(p.kv_slots)) for p in m.prefills]
    groups = [replace(g, rows=to(g.rows), block_tables=to(g.block_tables), mask=to(g.mask)) for g in m.decode_groups]
    meta = replace(m, slot_mapping=to(m.slot_mapping), prefills=prefills, decode_groups=groups,
                   query_start_loc=to(m.query_start_loc), seq_lens=to(m.seq_lens), block_tables=to(m.block_tables))
    return StepInputs(to(inputs.input_ids), to(inputs.positions), meta, to(inputs.logit_rows), inputs.sample_seqs)


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
    return ModelRunner(cfg.hf_config, cfg.model_path, dtype=cfg.dtype, device=device,
                       ops=select_ops(cfg.attention_backend, device), max_model_len=cfg.max_model_len,
                       block_size=cfg.block_size, parallel=parallel)


def worker_main(conn: Connection, cfg: EngineConfig, rank: int, port: int, parent_pid: int, threads: int) -> None:
    """Entry point of a rank's process: build the runner, then serve the driver's commands."""
    _watch_parent(parent_pid)
    if cfg.device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        store = connect_store(port, cfg.tensor_parallel_size * cfg.pipeline_parallel_size)
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
        zero_ids, micro = payload
        runner.zero_blocks(zero_ids)
        execute_step(runner, micro)
        return None
    method, args, kwargs = cloudpickle.loads(payload)
    fn = getattr(runner, method) if isinstance(method, str) else (lambda *a, **k: method(runner, *a, **k))
    return fn(*args, **kwargs)


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
