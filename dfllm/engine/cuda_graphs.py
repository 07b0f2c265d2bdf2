"""CUDA graphs for decode steps, captured per batch-size bucket (vLLM's ``CUDAGraphRunner``).

A decode step launches a few dozen small kernels per layer for a handful of tokens, so on a GPU
its time goes to launching them. :class:`CudaGraphRunner` records the model's forward of a
pure-decode batch once per bucket size (vLLM's default sizes: 1, 2, 4, 8, then multiples of 8
up to ``max_num_seqs``, at most 512), largest first, all graphs sharing one memory pool, and
replays the graph of the smallest bucket that holds the step:

* every graph reads its inputs from the same static buffers: token ids, positions, cache slots,
  ``query_start_loc`` (0, 1, 2, ...: one query per sequence), context lengths and block tables
  ``[bucket, ceil(max_model_len / block_size)]``; a step copies its rows in and pads the rest;
* a padding row writes nothing (cache slot -1, which the KV-cache kernel skips) and attends over
  one key: the first key of the first sequence's first block, real and finite, so its (ignored)
  output is finite too. Every operation of the forward is row-wise but attention, which keeps
  to each row's own keys, so padding never reaches a real row;
* the Triton attention kernel sizes its launch from host-side maxima: they are fixed per graph
  (query length 1, context ``max_model_len``), and the kernel reads each row's real length from
  ``seq_lens`` on the device, so one graph serves every context length;
* the LM head and sampling stay outside the graph (as in vLLM): the graph returns hidden states.

Graphs are used only where replay is exact: a model on CUDA with the Triton kernels, on one rank,
whose class declares ``supports_cuda_graphs`` (plain :class:`~dfllm.models.layers.PagedAttention`
on every layer: Llama, Qwen2/3, Phi-3 and their mixtures of experts) and which has no sliding window.
Everything else, and every step that is not a pure decode batch, runs eagerly. The graphs bake in
the addresses of the weights and of the KV cache: the model runner drops them whenever either
moves (sleep mode) and captures again on the next step.

``capture=False`` keeps the static buffers and the padding but runs the forward eagerly: the same
path a graph replays, checkable on any device (the CPU tests use it).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from dfllm.engine.host_pack import HostPack
from dfllm.engine.step_inputs import decode_arrays, fill_pending
from dfllm.engine_args import CAPTURE_SIZES_FIELD
from dfllm.kernels.metadata import AttentionMetadata

if TYPE_CHECKING:
    from dfllm.engine.block_tables import BlockTableArray
    from dfllm.engine.scheduler import SchedulerOutput
    from dfllm.engine.sequence import Sequence
    from dfllm.models.llama import LlamaForCausalLM

logger = logging.getLogger("dfllm")


def bucket_for(batch: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest of the (sorted) ``sizes`` holding ``batch`` rows; None when none does."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def unsupported_reason(
    model: LlamaForCausalLM,
    *,
    device: torch.device | None = None,
    ops_name: str = "triton",
    parallel: object = None,
    quantization: str | None = None,
) -> str | None:
    """Why the decode forward of ``model`` cannot be captured (None when it can): graphs need
    CUDA (when ``device`` is given), the Triton kernels, one rank, float weights, a model class
    declaring ``supports_cuda_graphs`` and no sliding window."""
    if device is not None and device.type != "cuda":
        return f"the model runs on {device.type}, not CUDA"
    if ops_name != "triton":
        return f"the {ops_name!r} kernels are not captured (CUDA graphs need attention_backend 'triton' or 'auto')"
    if parallel is not None:
        return "the model is split over several ranks"
    if quantization is not None:
        return f"quantization={quantization!r}"
    if not model.supports_cuda_graphs:
        return f"{type(model).__name__} does not declare supports_cuda_graphs"
    if model.sliding_window is not None:
        return "sliding-window attention"
    return None


class CudaGraphRunner:
    """Static decode inputs of ``sizes`` buckets and, with ``capture=True``, a CUDA graph of the
    model's forward over each (see the module docstring). Build it once the KV cache is attached;
    :meth:`forward` runs a step that :meth:`fits`."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        sizes: tuple[int, ...],
        block_size: int,
        max_model_len: int,
        device: torch.device,
        capture: bool = True,
    ):
        if not sizes:
            raise ValueError(f"{CAPTURE_SIZES_FIELD} is empty: no bucket to capture")
        self.model = model
        self.sizes = tuple(sorted(set(sizes)))
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.captured = False
        self.replays = 0  # steps run through the static buffers (graphs, or eagerly)
        top = self.sizes[-1]
        self.table_width = -(-max_model_len // block_size)
        dev = self.device
        self.input_ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.long, device=dev)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(top, self.table_width, dtype=torch.int32, device=dev)
        self.metas = {b: self._meta(b) for b in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self.capture()

    def _meta(self, bucket: int) -> AttentionMetadata:
        """Attention metadata over the first ``bucket`` rows of the buffers, with the host-side
        maxima fixed (one query per sequence, at most ``max_model_len`` keys)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            prefills=[],
            decode_groups=[],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _run(self, bucket: int) -> torch.Tensor:
        return self.model(self.input_ids[:bucket], self.positions[:bucket], self.metas[bucket])

    # ---- capture ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per bucket, largest first, in one shared memory pool.

        The buffers hold padding rows only (no cache write, one finite key read), and each
        bucket is run once eagerly first so that its Triton kernels are compiled and loaded
        before the capture."""
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        start = time.perf_counter()
        self._pad(0, self.sizes[-1])
        pool = None
        try:
            for bucket in reversed(self.sizes):
                self._run(bucket)  # warm-up: compiles this bucket's kernels
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                # thread_local: CUDA calls of other threads (metrics, a dashboard) do not void the capture
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    out = self._run(bucket)
                if pool is None:
                    pool = graph.pool()
                self.graphs[bucket], self.outputs[bucket] = graph, out
            torch.cuda.synchronize(self.device)
        except BaseException:
            self.release()
            raise
        self.captured = True
        logger.info(
            "CUDA graphs: captured the decode forward for batch sizes %s in %.1f s",
            list(self.sizes),
            time.perf_counter() - start,
        )

    def release(self) -> None:
        """Drop the graphs and their memory pool (the caller empties the CUDA cache)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.captured = False

    # ---- steps --------------------------------------------------------------------------------------
    def fits(self, sched: SchedulerOutput) -> bool:
        """A pure decode step (one new token for every sequence, no prompt log-probabilities)
        of at most the largest bucket's sequences, whose block tables fit the buffers."""
        seqs = sched.seqs
        return (
            0 < len(seqs) <= self.sizes[-1]
            and max(sched.num_new_tokens) == 1
            and not any(s.needs_prompt_logprobs or len(s.block_table) > self.table_width for s in seqs)
        )

    def load(
        self, seqs: list[Sequence], prev: torch.Tensor | None = None, tables: BlockTableArray | None = None
    ) -> tuple[int, np.ndarray]:
        """Copy a decode batch into the buffers (rows ``0..len(seqs)``), pad the rest of the
        smallest bucket holding it; that bucket, and the rows that sample (all but a one-token
        prompt chunk not yet at its end). A sequence whose token is still on the device takes it
        from ``prev``, the step in flight's sampled ids (asynchronous scheduling); the block
        tables come from ``tables`` where given (:func:`~dfllm.engine.step_inputs.decode_arrays`)."""
        n = len(seqs)
        bucket = bucket_for(n, self.sizes)
        assert bucket is not None, f"{n} sequences exceed the largest bucket {self.sizes[-1]}"
        arrays = decode_arrays(seqs, self.block_size, tables, in_flight=prev is not None)
        pack = HostPack()  # one copy per dtype, without waiting for the device
        pack.add(np.concatenate([arrays.ids, arrays.positions, arrays.slots]), torch.long, (3, n))
        pack.add(arrays.seq_lens, torch.int32)
        pack.add(arrays.own_tables(), torch.int32, arrays.tables.shape)
        pack.add(np.stack([arrays.fill_rows, arrays.fill_from]), torch.long, (2, len(arrays.fill_rows)))
        rows, seq_lens, sent_tables, fill = pack.send(self.device)
        self.input_ids[:n].copy_(rows[0])
        if fill.shape[1]:
            fill_pending(self.input_ids, fill[0], fill[1], prev)
        self.positions[:n].copy_(rows[1])
        self.slot_mapping[:n].copy_(rows[2])
        self.seq_lens[:n].copy_(seq_lens)
        self.block_tables[:n, : sent_tables.shape[1]].copy_(sent_tables)
        self._pad(n, bucket)
        return bucket, arrays.sampling

    def _pad(self, start: int, stop: int) -> None:
        """Rows ``start..stop`` become padding: token 0 at position 0, no cache write, and one key
        to attend over: the first of row 0's first block (a real key once row 0 is a sequence)."""
        if stop <= start:
            return
        self.input_ids[start:stop].zero_()
        self.positions[start:stop].zero_()
        self.slot_mapping[start:stop].fill_(-1)
        self.seq_lens[start:stop].fill_(1)
        if start == 0:  # no sequence yet (capture): block 0
            self.block_tables[:stop, 0].zero_()
        else:
            self.block_tables[start:stop, 0].copy_(self.block_tables[0, 0])

    def forward(
        self, seqs: list[Sequence], prev: torch.Tensor | None = None, tables: BlockTableArray | None = None
    ) -> tuple[torch.Tensor, np.ndarray]:
        """Hidden states ``[len(seqs), hidden]`` of a decode batch that :meth:`fits`: its graph
        replayed (or, without graphs, the same padded forward run eagerly), and the rows that
        sample. The tensor is the graph's output buffer: use it before the next step."""
        bucket, sampling = self.load(seqs, prev, tables)
        self.replays += 1
        if self.captured:
            self.graphs[bucket].replay()
            return self.outputs[bucket][: len(seqs)], sampling
        return self._run(bucket)[: len(seqs)], sampling
