"""Runs the model on one device (or one rank's share of it): owns the weights and the KV cache."""

from __future__ import annotations

import concurrent.futures
import ctypes
import gc
import logging
import sys
from collections.abc import Callable

import torch

from dfllm.config import EngineConfig
from dfllm.distributed.parallel_state import ParallelContext, layer_range
from dfllm.engine import kv_memory
from dfllm.engine.cuda_graphs import CudaGraphRunner, unsupported_reason
from dfllm.engine.host_pack import HostPack
from dfllm.engine.pipeline import execute_step
from dfllm.engine.scheduler import SchedulerOutput
from dfllm.engine.step_inputs import StepInputs, StepOutput, attention_metadata, prepare_inputs
from dfllm.kernels.backend import select_ops
from dfllm.kernels.metadata import PrefillSpan
from dfllm.models.cpu_linear import pack_linears, repack_linears
from dfllm.models.decode_stack import enable_decode_stacks
from dfllm.models.llama import LlamaForCausalLM
from dfllm.models.loader import load_weights
from dfllm.models.quantization import quantize_model
from dfllm.models.registry import model_class
from dfllm.multimodal.encoder import EncoderCache, step_mm_kwargs

logger = logging.getLogger("dfllm")


class ModelRunner:
    """Holds the model and the KV cache on one device and executes engine steps.

    With a ``parallel`` context it holds one rank's share of a split model (on ``device``,
    by default the config's): its pipeline stage's layers and its tensor-parallel slice of
    them, and the KV cache of those (``dfllm.engine.executor`` drives such runners).
    """

    def __init__(
        self, cfg: EngineConfig, *, device: torch.device | None = None, parallel: ParallelContext | None = None
    ):
        self.cfg, self.spec = cfg, cfg.model
        self.dtype = cfg.dtype
        self.device = cfg.device if device is None else device
        self.ops = select_ops(cfg.attention_backend, self.device)
        self.block_size = cfg.block_size
        self.max_model_len = cfg.max_model_len
        self.parallel = parallel
        self.num_layers = self.spec.num_hidden_layers
        if parallel is not None:
            start, end = layer_range(self.num_layers, parallel.pp_rank, parallel.pp_size)
            self.num_layers = end - start
        self.kv_layout = model_class(self.spec).kv_cache_layout(self.spec, 1 if parallel is None else parallel.tp_size)
        self.lora_slots: dict = {}  # LoRA: {layer: {projection: LoRASlots}} (dfllm.lora.layers), when enabled
        self.num_kv_heads, self.head_dim = self.kv_layout.heads, self.kv_layout.head_dim
        self.model: LlamaForCausalLM | None = self._build_model()  # None while dropped
        self.kv: torch.Tensor | None = None
        # CUDA graphs of decode steps (dfllm.engine.cuda_graphs): set up on the first step after
        # the weights or the KV cache last moved; None where the step runs eagerly
        self.decode_graphs: CudaGraphRunner | None = None
        self._graphs_set_up = False
        # a vision-language model's image embeddings, by image (dfllm.multimodal.encoder)
        self.encoder_cache = EncoderCache()

    # ---- what vLLM's workers expose to collective_rpc callables ----------------------------------
    @property
    def rank(self) -> int:
        """This rank's index in the engine (0 on one rank)."""
        return 0 if self.parallel is None else self.parallel.rank

    @property
    def local_rank(self) -> int:
        """The rank's index on its machine: all ranks run on this one."""
        return self.rank

    @property
    def model_runner(self) -> ModelRunner:
        """The runner itself: vLLM's callables reach the model as ``worker.model_runner.model``."""
        return self

    def _build_model(self) -> LlamaForCausalLM:
        with torch.device(self.device):
            model = model_class(self.spec)(self.spec, self.ops, self.max_model_len, self.parallel)
        model.to(self.dtype)
        model.model.rotary_emb.float()
        load_weights(model, self.cfg.model_path)
        if self.cfg.quantization is not None:
            quantize_model(model, self.cfg.quantization)
        else:
            # packed weights on CPU (dfllm.models.cpu_linear): oneDNN's, or dfllm's own bfloat16
            # GEMM's where the CPU kernels run
            pack_linears(model, own_gemm=self.ops.name == "cpu")
            if self.ops.name == "cpu":  # a decode step's layers in one kernel call, where they allow it
                enable_decode_stacks(model)
        if self.cfg.enable_lora:  # empty adapter slots beside the adapted projections
            from dfllm.lora.layers import attach_lora

            self.lora_slots = attach_lora(
                model,
                self.cfg.max_loras,
                self.cfg.max_lora_rank,
                None if self.parallel is None else self.parallel.tp,
                triton=self.ops.name == "triton",
            )
        return model.eval()

    # ---- LoRA adapters (dfllm.lora) ----------------------------------------------------
    def set_lora_slot(self, slot: int, adapter) -> None:
        """Copy a :class:`~dfllm.lora.adapter.LoRAAdapter` (None: zeros) into adapter slot
        ``slot`` of this rank's layers, each sharded as its base layer."""
        for layer, projections in self.lora_slots.items():
            for slots in projections.values():
                weights = (
                    {}
                    if adapter is None
                    else {p: adapter.weights[(layer, p)] for p in slots.parts if (layer, p) in adapter.weights}
                )
                slots.set_slot(slot, weights)

    def lora_modules(self) -> set[str]:
        """The checkpoint modules (q_proj ... down_proj) LoRA adapters may target in this model."""
        from dfllm.lora.layers import supported_modules

        return supported_modules(self.lora_slots)

    # ---- sleep mode -----------------------------------------------------------------
    def offload_weights(self) -> None:
        """Move the weights to host memory (a no-op on a CPU device)."""
        assert self.model is not None
        self._drop_graphs()
        self.model.to("cpu")
        _release_device_memory(self.device)

    def onload_weights(self) -> None:
        assert self.model is not None
        self._drop_graphs()
        self.model.to(self.device)

    def drop_weights(self) -> None:
        """Release the model entirely; ``reload_weights`` rebuilds it from the model files."""
        self._drop_graphs()
        self.model = None
        _release_device_memory(self.device)

    def reload_weights(self) -> None:
        self._drop_graphs()
        self.model = self._build_model()
        if self.kv is not None:
            self._attach(self.kv)

    # ---- KV cache -------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        return kv_memory.bytes_per_block(
            self.num_layers,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.cfg.kv_dtype,
            self.kv_layout.num_tensors,
        )

    def plan_num_blocks(self) -> int:
        """How many KV blocks to allocate: ``kv_cache_memory_bytes`` of them when configured,
        else what free memory allows (on CUDA after a profiling pass of a full token budget)."""
        cfg = self.cfg
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            self.profile_run(cfg.max_num_batched_tokens)
            budget = kv_memory.cuda_kv_budget(self.device, cfg.gpu_memory_utilization)
        else:
            most = cfg.max_num_seqs * (self.max_model_len + self.block_size) * self.block_bytes // self.block_size
            ranks = cfg.world_size
            budget = kv_memory.cpu_kv_budget(most * ranks) // ranks  # the ranks share the host's memory
        return max(0, budget // self.block_bytes)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._drop_graphs()
        self.kv = kv_memory.allocate(
            num_blocks,
            self.num_layers,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.cfg.kv_dtype,
            self.device,
            self.kv_layout.num_tensors,
        )
        self._attach(self.kv)

    def free_kv_cache(self) -> None:
        self._drop_graphs()
        if self.model is not None:
            self._attach(None)
        self.kv = None
        _release_device_memory(self.device)

    def _attach(self, kv: torch.Tensor | None) -> None:
        assert self.model is not None
        values = self.kv_layout.values
        for i, layer in enumerate(self.model.model.stage_layers):
            layer.self_attn.k_cache = None if kv is None else kv[0, i]
            layer.self_attn.v_cache = None if kv is None or not values else kv[1, i]

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """One forward pass of ``num_tokens`` fresh tokens, to measure peak activation memory."""
        num_tokens = min(num_tokens, self.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        self.allocate_kv_cache(num_blocks)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, device=self.device)
        meta = attention_metadata(
            torch.arange(num_tokens),
            [PrefillSpan(0, num_tokens, num_tokens, None)],
            [],
            [0, num_tokens],
            [num_tokens],
            [list(range(num_blocks))],
            self.block_size,
            self.device,
        )
        if self.parallel is not None:
            execute_step(self, [StepInputs(ids, pos, meta, torch.tensor([num_tokens - 1], device=self.device), [])])
        else:
            assert self.model is not None
            hidden = self.model(ids, pos, meta)
            self.model.compute_logits(hidden[-1:])
        self.free_kv_cache()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- steps ------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, sched: SchedulerOutput) -> StepOutput:
        """Compute one step: the logits (float32, on this runner's device) of the rows that
        sample, and of the prompt positions whose log-probabilities were asked for."""
        model = self.model
        assert model is not None  # not while the weights are dropped
        if not self._graphs_set_up:
            self.setup_decode_graphs()
        graphs = self.decode_graphs
        # a vision-language model's image embeddings (and Qwen2-VL's 3-D positions) for this step
        mm = {} if self.spec.multimodal is None else step_mm_kwargs(model, sched, self.encoder_cache, self.device)
        if graphs is not None and graphs.fits(sched) and not mm:
            return self._run_graph(graphs, sched)
        inputs = prepare_inputs(sched, self.block_size, self.device)
        hidden = model(inputs.input_ids, inputs.positions, inputs.meta, **mm)
        if not inputs.logit_rows.numel():
            return StepOutput(torch.empty(0, device=self.device), [])
        logits = model.compute_logits(hidden if inputs.every_row else hidden[inputs.logit_rows])
        return StepOutput.split(logits.float(), [inputs])

    def _run_graph(self, graphs: CudaGraphRunner, sched: SchedulerOutput) -> StepOutput:
        """A pure decode step through the static buffers (a graph replay); the logits of the
        sequences that sample (all of them, but for a one-token prompt chunk not yet at its end)."""
        model = self.model
        assert model is not None
        hidden, rows = graphs.forward(sched.seqs, sched.prev_token_ids, sched.tables)
        if not len(rows):
            return StepOutput(torch.empty(0, device=self.device), [])
        seqs = sched.seqs
        if len(rows) < len(seqs):
            pack = HostPack()
            pack.add(rows, torch.long)
            hidden = hidden[pack.send(self.device)[0]]
            seqs = [seqs[i] for i in rows.tolist()]
        logits = model.compute_logits(hidden)
        return StepOutput(logits.float(), list(seqs))

    # ---- CUDA graphs ------------------------------------------------------------------------
    @torch.inference_mode()
    def setup_decode_graphs(self, capture: bool = True) -> CudaGraphRunner | None:
        """Capture the decode graphs (``dfllm.engine.cuda_graphs``) where they apply: a model on
        CUDA with the Triton kernels, on one rank, not ``enforce_eager``; None elsewhere (or if
        the capture fails: a warning, and the steps run eagerly). ``run`` calls it on the first
        step after the weights or the KV cache moved. ``capture=False`` sets up the same static
        buffers and padding without graphs, on any device, for checking that path."""
        self._drop_graphs()
        self._graphs_set_up = True
        model = self.model
        if model is None or self.kv is None:
            return None
        sizes = self.cfg.cudagraph_capture_sizes
        if capture and (self.cfg.enforce_eager or not sizes or self.cfg.enable_lora):  # LoRA steps run eagerly
            return None
        reason = unsupported_reason(
            model,
            device=self.device if capture else None,
            ops_name=self.ops.name,
            parallel=self.parallel,
            quantization=self.cfg.quantization,
        )
        sizes = sizes or (1,)
        if reason is not None:
            if self.device.type == "cuda" and capture:
                logger.info("CUDA graphs off: %s; decode steps run eagerly", reason)
            return None
        try:
            self.decode_graphs = CudaGraphRunner(
                model, sizes, self.block_size, self.max_model_len, self.device, capture=capture
            )
        except Exception as exc:  # noqa: BLE001  (a failed capture costs speed, not results)
            logger.warning("CUDA graph capture failed, decode steps run eagerly: %s: %s", type(exc).__name__, exc)
            _release_device_memory(self.device)
        return self.decode_graphs

    def _drop_graphs(self) -> None:
        """Forget the graphs (they hold the addresses of the weights and of the KV cache): the
        next step sets them up again."""
        if self.decode_graphs is not None:
            self.decode_graphs.release()
            self.decode_graphs = None
        self._graphs_set_up = False

    # ---- RPC and lifecycle ------------------------------------------------------------
    def collective_rpc(
        self, method: str | Callable, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list:
        """``method`` (a method name, or a callable taking the runner first) on this runner;
        its one result in a list. ``TimeoutError`` if it has not returned after ``timeout`` s."""
        return [call_with_timeout(rpc_target(self, method), timeout, args, kwargs or {})]

    def shutdown(self) -> None:
        """Nothing to stop on one rank."""


def rpc_target(runner: object, method: str | Callable) -> Callable:
    """``method`` of ``runner``: its method of that name, or a callable taking the runner first.

    A callable may write the weights in place (``update_weights``, vLLM's RLHF recipes writing
    ``param.data``), which no version counter sees: the packed copies of the model's linear
    layers are made again after it returns."""
    if isinstance(method, str):
        return getattr(runner, method)

    def call(*args, **kwargs):
        try:
            return method(runner, *args, **kwargs)
        finally:
            model = getattr(runner, "model", None)
            if isinstance(model, torch.nn.Module):
                repack_linears(model)

    return call


def call_with_timeout(fn: Callable, timeout: float | None, args: tuple, kwargs: dict, where: str = ""):
    """``fn(*args, **kwargs)`` in this process; ``TimeoutError`` past ``timeout`` seconds."""
    if timeout is None:
        return fn(*args, **kwargs)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(fn, *args, **kwargs).result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"collective_rpc did not return within {timeout} s{where}") from None
    finally:
        pool.shutdown(wait=False)


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
