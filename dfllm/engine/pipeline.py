"""One rank's part of a parallel step, pipelined over micro-batches.

Every rank runs :func:`execute_step` on the same micro-batches. Under pipeline
parallelism a stage receives each micro-batch's hidden states from the stage before,
runs its layers and sends them on without waiting, so while one stage works on
micro-batch ``i`` the previous one already computes ``i + 1``; the last stage sends the
logits of the sampled rows back to rank 0 (the driver), which samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from dfllm.engine.step_inputs import StepInputs, move_inputs

if TYPE_CHECKING:  # for annotations only
    from dfllm.distributed.communication import GroupComm
    from dfllm.distributed.parallel_state import ParallelContext
    from dfllm.models.llama import LlamaForCausalLM
    from dfllm.models.spec import ModelSpec


class Stage(Protocol):
    """What a step reads off a rank's runner (a :class:`~dfllm.engine.model_runner.ModelRunner`)."""

    parallel: ParallelContext | None
    model: LlamaForCausalLM | None
    spec: ModelSpec
    dtype: torch.dtype
    device: torch.device


LOGITS_TAG = 1_000_000  # pipeline tags: 2i and 2i + 1 carry micro-batch i's hidden states and residual


@torch.inference_mode()
def execute_step(runner: Stage, micro: list[StepInputs]) -> torch.Tensor | None:
    """This rank's part of one step over its micro-batches; on rank 0 the logits (float32,
    on rank 0's device) of the sampled rows of all micro-batches, in order; None elsewhere."""
    ctx = runner.parallel
    assert ctx is not None  # a parallel runner
    pending: list = []  # sends in flight, with the tensors they read (kept alive until done)
    logits: list[torch.Tensor] = []
    for i, mb in enumerate(micro):
        mb = move_inputs(mb, runner.device)
        assert runner.model is not None  # its weights loaded
        out = runner.model(mb.input_ids, mb.positions, mb.meta, _receive_hidden(runner, mb, i), **mb.mm)
        if not ctx.is_last_stage:
            for k, t in enumerate(out):
                t = t.contiguous()
                pending.append((_pipeline(ctx).send(t, ctx.pp_rank + 1, 2 * i + k), t))
            continue
        part = _logits(runner, out, mb.logit_rows)
        if ctx.is_driver:
            logits.append(part)
        elif ctx.tp_rank == 0 and part.numel():  # the last stage's first rank answers rank 0
            pending.append((_pipeline(ctx).send(part, 0, LOGITS_TAG + i), part))
    if ctx.is_driver and not ctx.is_last_stage:
        logits = [_receive_logits(runner, mb, i) for i, mb in enumerate(micro)]
    for work, _ in pending:
        work.wait()
    if not ctx.is_driver:
        return None
    if not logits:
        return torch.empty(0, runner.spec.vocab_size, device=runner.device)
    return logits[0] if len(logits) == 1 else torch.cat(logits)


def _receive_hidden(runner: Stage, mb: StepInputs, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Micro-batch ``i``'s hidden states and residual from the previous stage (None on the first)."""
    ctx = runner.parallel
    assert ctx is not None
    if ctx.is_first_stage:
        return None
    shape = (mb.input_ids.numel(), runner.spec.hidden_size)
    pp, src = _pipeline(ctx), ctx.pp_rank - 1
    return (
        pp.recv(shape, runner.dtype, runner.device, src, 2 * i),
        pp.recv(shape, runner.dtype, runner.device, src, 2 * i + 1),
    )


def _logits(runner: Stage, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    if rows.numel() == 0:
        return torch.empty(0, runner.spec.vocab_size, device=runner.device)
    assert runner.model is not None
    return runner.model.compute_logits(hidden[rows]).float()


def _receive_logits(runner: Stage, mb: StepInputs, i: int) -> torch.Tensor:
    rows, vocab = mb.logit_rows.numel(), runner.spec.vocab_size
    if rows == 0:
        return torch.empty(0, vocab, device=runner.device)
    ctx = runner.parallel
    assert ctx is not None
    return _pipeline(ctx).recv((rows, vocab), torch.float32, runner.device, ctx.pp_size - 1, LOGITS_TAG + i)


def _pipeline(ctx: ParallelContext) -> GroupComm:
    """The pipeline group, which exists wherever stages send to one another (``pp_size > 1``)."""
    assert ctx.pp is not None
    return ctx.pp
