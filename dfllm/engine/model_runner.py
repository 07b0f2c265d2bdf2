"""Runs the model for one scheduled step: builds inputs, owns the weights and the KV cache."""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from dfllm.distributed.parallel_state import ParallelContext, layer_range
from dfllm.engine import kv_memory
from dfllm.engine.scheduler import SchedulerOutput
from dfllm.engine.sequence import Sequence
from dfllm.kernels.backend import KernelOps
from dfllm.kernels.metadata import AttentionMetadata, DecodeGroup, PrefillSpan
from dfllm.models.llama import head_dim_of
from dfllm.models.loader import load_weights
from dfllm.models.registry import model_class

logger = logging.getLogger("dfllm")


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor
    sample_seqs: list[Sequence]


class ModelRunner:
    """Holds the model and the KV cache on one device and executes engine steps.

    With a ``parallel`` context it holds one rank's share of a split model: its pipeline
    stage's layers and its tensor-parallel slice of them, and the KV cache of those (the
    ``dfllm.engine.executor`` drives such runners).
    """

    def __init__(self, config: PretrainedConfig, path: Path, *, dtype: torch.dtype, device: torch.device,
                 ops: KernelOps, max_model_len: int, block_size: int, parallel: ParallelContext | None = None):
        self.config, self.path = config, path
        self.dtype, self.device, self.ops = dtype, device, ops
        self.block_size = block_size
        self.parallel = parallel
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        if parallel is not None:
            start, end = layer_range(self.num_layers, parallel.pp_rank, parallel.pp_size)
            self.num_layers = end - start
            self.num_kv_heads //= parallel.tp_size
        self.head_dim = head_dim_of(config)
        self.max_model_len = max_model_len
        self.model = self._build_model()
        self.kv: torch.Tensor | None = None

    def _build_model(self) -> torch.nn.Module:
        cls = model_class(self.config, self.max_model_len)
        extra = {} if self.parallel is None else {"parallel": self.parallel}
        with torch.device(self.device):
            model = cls(self.config, self.ops, self.max_model_len, **extra)
        model.to(self.dtype)
        model.model.rotary_emb.float()
        load_weights(model, self.path)
        return model.eval()

    # ---- sleep mode -----------------------------------------------------------------
    def offload_weights(self) -> None:
        """Move the weights to host memory (a no-op on a CPU device)."""
        self.model.to("cpu")
        _release_device_memory(self.device)

    def onload_weights(self) -> None:
        self.model.to(self.device)

    def drop_weights(self) -> None:
        """Release the model entirely; ``reload_weights`` rebuilds it from the model files."""
        self.model = None
        _release_device_memory(self.device)

    def reload_weights(self) -> None:
        self.model = self._build_model()
        if self.kv is not None:
            self._attach(self.kv)

    # ---- KV cache -------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        return kv_memory.bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    def plan_num_blocks(self, kv_cache_memory_bytes: int | None, gpu_memory_utilization: float,
                        max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """How many KV blocks to allocate for the given budget (or free memory)."""
        if kv_cache_memory_bytes is not None:
            budget = kv_cache_memory_bytes
        elif self.device.type == "cuda":
            self.profile_run(max_num_batched_tokens)
            budget = kv_memory.cuda_kv_budget(self.device, gpu_memory_utilization)
        else:
            most = max_num_seqs * (self.max_model_len + self.block_size) * self.block_bytes // self.block_size
            ranks = 1 if self.parallel is None else self.parallel.config.world_size
            budget = kv_memory.cpu_kv_budget(most * ranks) // ranks  # the ranks share the host's memory
        return max(0, budget // self.block_bytes)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv = kv_memory.allocate(num_blocks, self.num_layers, self.block_size, self.num_kv_heads,
                                    self.head_dim, self.dtype, self.device)
        self._attach(self.kv)

    def zero_blocks(self, block_ids: list[int]) -> None:
        kv_memory.zero_blocks(self.kv, block_ids)

    def free_kv_cache(self) -> None:
        if self.model is not None:
            self._attach(None)
        self.kv = None
        _release_device_memory(self.device)

    def _attach(self, kv: torch.Tensor | None) -> None:
        for i, layer in enumerate(self.model.model.stage_layers):
            layer.self_attn.k_cache = None if kv is None else kv[0, i]
            layer.self_attn.v_cache = None if kv is None else kv[1, i]

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """One forward pass of ``num_tokens`` fresh tokens, to measure peak activation memory."""
        num_tokens = min(num_tokens, self.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        self.allocate_kv_cache(num_blocks)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, device=self.device)
        meta = _metadata(torch.arange(num_tokens), [PrefillSpan(0, num_tokens, num_tokens, None)], [],
                         [0, num_tokens], [num_tokens], [list(range(num_blocks))], self.block_size, self.device)
        if self.parallel is not None:
            from dfllm.engine.worker import execute_step

            execute_step(self, [StepInputs(ids, pos, meta, torch.tensor([num_tokens - 1], device=self.device), [])])
        else:
            hidden = self.model(ids, pos, meta)
            self.model.compute_logits(hidden[-1:])
        self.free_kv_cache()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- steps ------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Compute one step; return the logits (float32, on CPU) of the rows that sample."""
        inputs = self.prepare(sched)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if not inputs.sample_seqs:
            return torch.empty(0), []
        logits = self.model.compute_logits(hidden[inputs.logit_rows])
        return logits.float().cpu(), inputs.sample_seqs

    def prepare(self, sched: SchedulerOutput, device: torch.device | None = None) -> StepInputs:
        """Flatten the step's tokens and describe where their keys live (on ``device``,
        by default the runner's)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSpan] = []
        dec_rows: list[int] = []
        dec_seqs: list[Sequence] = []
        logit_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        qsl = [0]
        for seq, n in zip(sched.seqs, sched.num_new_tokens):
            start, end, row = seq.num_computed_tokens, seq.num_computed_tokens + n, len(ids)
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1:
                dec_rows.append(row)
                dec_seqs.append(seq)
            else:
                kv_slots = None if start == 0 else _slots(table, end, bs)
                prefills.append(PrefillSpan(row, n, end, kv_slots))
            if end == seq.num_tokens:
                logit_rows.append(row + n - 1)
                sample_seqs.append(seq)
            qsl.append(len(ids))
        seq_lens = [s.num_computed_tokens + n for s, n in zip(sched.seqs, sched.num_new_tokens)]
        tables = [s.block_table for s in sched.seqs]
        groups = _decode_groups(dec_rows, dec_seqs, bs)
        dev = self.device if device is None else device
        meta = _metadata(torch.tensor(slots), prefills, groups, qsl, seq_lens, tables, bs, dev)
        return StepInputs(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta,
                          torch.tensor(logit_rows, device=dev), sample_seqs)


def _release_device_memory(device: torch.device) -> None:
    """Return freed memory to the system: CUDA's cache, or on CPU glibc's free heap pages."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


def _slots(table: list[int], length: int, bs: int) -> torch.Tensor:
    """Cache slots of the first ``length`` tokens of a block table."""
    blocks = torch.tensor(table[: -(-length // bs)])
    return (blocks.unsqueeze(1) * bs + torch.arange(bs)).flatten()[:length]


DECODE_GROUPS = 8
MIN_DECODE_GROUP = 8


def _decode_groups(rows: list[int], seqs: list[Sequence], bs: int) -> list[DecodeGroup]:
    """Decodes sorted by context length and split into a few groups of similar length.

    A table shorter than its group's is padded with its own last block, never another
    sequence's: the padding is masked out, but still multiplied by a zero attention weight,
    and another sequence's keys could be NaN (its own, when NaN, make it NaN anyway).
    """
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].block_table))
    size = max(MIN_DECODE_GROUP, -(-len(order) // DECODE_GROUPS))
    groups = []
    for start in range(0, len(order), size):
        members = order[start : start + size]
        width = len(seqs[members[-1]].block_table)
        tables = torch.empty(len(members), width, dtype=torch.long)
        for i, m in enumerate(members):
            table = seqs[m].block_table
            tables[i, : len(table)] = torch.tensor(table)
            tables[i, len(table) :] = table[-1]
        lens = torch.tensor([seqs[m].num_computed_tokens + 1 for m in members])
        mask = torch.arange(width * bs).unsqueeze(0) < lens.unsqueeze(1)
        groups.append(DecodeGroup(torch.tensor([rows[m] for m in members]), tables, mask))
    return groups


def _metadata(slot_mapping, prefills, groups, qsl, seq_lens, tables, bs, device):
    width = max(len(t) for t in tables)
    block_tables = torch.full((len(tables), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)

    def to(x):
        return None if x is None else x.to(device)

    for span in prefills:
        span.kv_slots = to(span.kv_slots)
    for g in groups:
        g.rows, g.block_tables, g.mask = to(g.rows), to(g.block_tables), to(g.mask)
    return AttentionMetadata(
        slot_mapping=to(slot_mapping), prefills=prefills, decode_groups=groups,
        query_start_loc=to(torch.tensor(qsl, dtype=torch.int32)),
        seq_lens=to(torch.tensor(seq_lens, dtype=torch.int32)), block_tables=to(block_tables), block_size=bs,
        max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])), max_seq_len=max(seq_lens),
    )
