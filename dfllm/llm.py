"""The offline ``LLM`` class, with vLLM's constructor and methods.

``LLM`` owns one engine (generative or pooling), its tokenizer, the requests of its
calls, and two components it composes: :class:`~dfllm.llm_pooling.PoolingFrontend`
(``embed``, ``classify``, ``score``, ``encode``) and :class:`~dfllm.llm_control.EngineControl`
(profiling, sleep mode, caches, metrics, weight updates, RPC), whose methods it exposes
under vLLM's names. Generation (``generate``, ``chat``, ``enqueue``, ``wait_for_completion``)
is its own: it checks inputs with the engine's input processor, adds them as one group per
call and steps the engine until they are done.
"""

from __future__ import annotations

import functools
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from dfllm.beam_search import NO_SEQUENCE, BeamSearchError, BeamSearchOutput, BeamSearchParams, BeamStep, beam_search
from dfllm.config import EngineConfig
from dfllm.engine.input_processor import NO_TOKENIZER, EngineRequest
from dfllm.engine.llm_engine import LLMEngine
from dfllm.engine.pooling_engine import PoolingEngine
from dfllm.engine_args import EngineArgs
from dfllm.errors import InvalidRequestError, invalid_request
from dfllm.inputs import as_prompt_list
from dfllm.llm_control import EngineControl
from dfllm.llm_pooling import PoolingFrontend, check_pooling_task, not_pooling_error
from dfllm.logger import init_logger
from dfllm.lora.request import LoRARequest, per_prompt
from dfllm.models.pooler import load_pooler_config
from dfllm.models.registry import is_pooling_only
from dfllm.outputs import PoolingRequestOutput, RequestOutput, raise_for_errors
from dfllm.sampling_params import SamplingParams

init_logger()


def _delegate(component: str, method: Callable) -> Callable:
    """An ``LLM`` method that calls ``method`` of the component held in ``self.<component>``
    (its signature and docstring)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        return getattr(self._component(component, method.__name__, kwargs), method.__name__)(*args, **kwargs)

    return call


class LLM:
    """A model with its own engine, for offline batch generation and pooling.

    ``model`` is a Hugging Face style directory (config.json, ``*.safetensors``, tokenizer
    files) or the alias of a bundled model; None gives the default chat model,
    SmolLM2-135M-Instruct. Only safetensors weights are read, and no remote code is run.

    ``device="auto"`` is CUDA when available, else CPU. ``dtype="auto"`` is float32 on CPU
    and the checkpoint's dtype on CUDA (bfloat16 for float32 checkpoints). The KV cache is
    one tensor of ``kv_cache_memory_bytes`` when given, else sized from free memory
    (``gpu_memory_utilization`` of the GPU, or on CPU a quarter of the available RAM up to
    4 GiB, capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens could use).
    ``tensor_parallel_size``/``pipeline_parallel_size`` split a generative model over that
    many ranks: this process is rank 0, the others are processes it spawns (one GPU each on
    CUDA; gloo collectives on CPU); :meth:`shutdown` stops them.
    ``max_num_batched_tokens`` (the per-step token budget) defaults to 8192 on CUDA and
    2048 on CPU (never below ``max_num_seqs``); pooling batches on CPU default to 1024
    padded tokens.

    ``runner="auto"`` picks pooling for encoder architectures (BERT embedders, classifiers,
    cross-encoders) and for sentence-transformers directories (``modules.json``), and
    generation otherwise; ``runner="pooling"`` turns a decoder into an embedder
    (last-token pooling unless the directory says otherwise). Pooling models serve
    ``embed``/``classify``/``score``/``encode``; generative models ``generate``/``chat``.

    ``deduplicate_requests`` (default True; dfllm's, not vLLM's) computes identical
    deterministic requests (same prompt tokens and sampling parameters, greedy or seeded)
    once, however many times they are queued: each gets its own copy of the output, with
    ``num_cached_tokens`` = prompt length - 1. ``prefix_aware_scheduling`` (default True)
    admits waiting requests longest cached prefix first when prefix caching is on and the
    policy is "fcfs", so that rows sharing a document run while its blocks are cached (see
    :mod:`dfllm.engine.scheduler`).

    Requests are checked before any work starts: one dfllm refuses (an empty prompt, a token
    id out of the vocabulary, a prompt longer than ``max_model_len``, more logprobs than
    ``max_logprobs``, a ``best_of`` above ``n``...) raises
    :class:`~dfllm.errors.InvalidRequestError`, a ``ValueError`` (vLLM's
    ``VLLMValidationError``), whose message starts with vLLM's words and then names the prompt.

    Failures stay with the requests that cause them. A prompt for which the model produces
    non-finite logits (NaN, +inf, or no finite value: NaN weights, an overflow) ends with
    ``finish_reason="error"`` while the rest of the batch goes on; ``generate``/``chat``
    then raise :class:`~dfllm.outputs.RequestFailedError` (a ``RuntimeError``) naming the
    prompt by index, with every output in its ``outputs``. If a step raises, nothing queued
    is lost: the engine drops its batch and re-runs the call's unfinished requests from
    scratch on their own (a ``generate`` call that still fails alone raises that error), and
    re-queues requests of ``enqueue`` from scratch for a later call.

    vLLM's common engine arguments are accepted too, with vLLM's defaults, so that vLLM
    examples run unchanged: each is mapped (``enforce_eager``, ``max_logprobs``,
    ``scheduling_policy``, ``tokenizer_mode="slow"``, ``skip_tokenizer_init``...), a no-op
    (``swap_space``, ``disable_log_stats``...) or, for a value dfllm cannot honour
    (``trust_remote_code=True``, a ``revision``...), refused with a ``ValueError`` naming the
    argument and value. :class:`dfllm.engine_args.EngineArgs` defines every argument of this
    signature (docs/from_vllm.md tables the vLLM ones); unknown names raise ``TypeError``.

    ``reasoning_parser`` (vLLM's engine argument: ``"qwen3"``, ``"deepseek_r1"``; see
    :mod:`dfllm.reasoning`) splits a thinking model's output: each completion's reasoning goes
    to ``CompletionOutput.reasoning_content`` and only the answer stays in ``text``, and
    structured outputs constrain the answer, engaging after the end of the reasoning
    (``structured_outputs_config={"enable_in_reasoning": True}`` constrains the reasoning
    too). An unknown name, a tokenizer without the parser's tokens or ``skip_tokenizer_init``
    raise ``ValueError`` here.

    Vision-language models (LLaVA) take images as vLLM does: ``{"prompt": ..., "multi_modal_data":
    {"image": image_or_list}}`` prompts and chat messages with ``image_url``/``image_pil`` parts
    (see docs/images.md). ``limit_mm_per_prompt={"image": n}`` refuses a prompt with more images;
    ``mm_processor_kwargs`` go to the model's image processor (a prompt's own override them);
    :meth:`reset_mm_cache` forgets the processed images and image embeddings cached so far.

    ``enable_lora=True`` (with ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``, as vLLM)
    serves PEFT LoRA adapters: ``lora_request=`` on ``generate``/``chat``/``enqueue``, requests
    of different adapters sharing every step (docs/lora.md).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        tokenizer: str | Path | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        attention_backend: str = "auto",
        runner: str = "auto",
        deduplicate_requests: bool = True,
        prefix_aware_scheduling: bool = True,
        profiler_dir: str | Path = "./dfllm_traces",
        # vLLM engine arguments, with vLLM's defaults: the table of docs/from_vllm.md
        enforce_eager: bool = False,
        compilation_config: Any = None,
        max_seq_len_to_capture: int | None = 8192,
        disable_log_stats: bool = True,
        max_logprobs: int | None = 20,
        logprobs_mode: str = "raw_logprobs",
        enable_chunked_prefill: bool | None = None,
        swap_space: float = 4,
        enable_sleep_mode: bool = False,
        disable_custom_all_reduce: bool = False,
        tokenizer_mode: str = "auto",
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        load_format: str = "auto",
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        download_dir: str | None = None,
        kv_cache_dtype: str = "auto",
        quantization: str | None = None,
        cpu_offload_gb: float = 0,
        structured_outputs_config: dict | None = None,
        reasoning_parser: str | None = "",
        scheduling_policy: str = "fcfs",
        hf_overrides: dict[str, Any] | Callable | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        distributed_executor_backend: str | None = None,
        async_scheduling: bool | None = None,
        attention_config: Any = None,
        config_format: str = "auto",
        limit_mm_per_prompt: dict[str, int] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ):
        # the signature is EngineArgs' fields, one for one (tests/compat/vllm/test_engine_args.py)
        self.config = EngineConfig.create(EngineArgs(**{k: v for k, v in locals().items() if k != "self"}))
        path = self.config.model_path
        self.runner_type = self.config.runner_type
        self.tokenizer: PreTrainedTokenizerBase | None = (
            None
            if skip_tokenizer_init
            else AutoTokenizer.from_pretrained(
                self.config.tokenizer_path, trust_remote_code=False, use_fast=self.config.use_fast_tokenizer
            )
        )
        self.engine: LLMEngine | None = None
        self.pooling_engine: PoolingEngine | None = None
        self._pooling: PoolingFrontend | None = None
        self._ids = itertools.count()  # request ids, shared by every kind of call
        self._groups = itertools.count()  # one group per generate/chat/enqueue call
        if self.runner_type == "pooling":
            pooler = load_pooler_config(path, is_decoder=not is_pooling_only(self.config.model))
            self.pooling_engine = PoolingEngine(self.config, pooler, self.tokenizer)
            self._pooling = PoolingFrontend(self.pooling_engine, self._next_id)
        else:
            self.engine = LLMEngine(self.config, self.tokenizer, _eos_token_ids(path, self.tokenizer))
        self._control = EngineControl(self.config, self.engine, self.pooling_engine)
        self._queued: list[tuple[int, list[str]]] = []  # (group, request ids) of enqueue calls not yet waited for
        self._outputs: dict[str, RequestOutput] = {}  # finished, not yet returned

    # ---- generation ----------------------------------------------------------------------
    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: Any = None,
        priority: int | list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for one prompt or a list of prompts, returned in input order.

        A prompt is a string, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``.
        ``sampling_params`` is one object for all prompts or a list with one per prompt.
        Every prompt is checked (emptiness, vocabulary, ``max_model_len``, ``max_logprobs``)
        before any work starts; a bad one raises :class:`~dfllm.errors.InvalidRequestError`
        (a ``ValueError``) naming its index. A prompt for which the model produces non-finite
        logits makes the call raise :class:`~dfllm.outputs.RequestFailedError` (a
        ``RuntimeError``) naming its index, once every other prompt is done; their outputs
        are in the error's ``outputs``. An exception in the engine is raised if these prompts
        cause it on their own (see the class).

        ``priority`` (vLLM's): an int for every prompt or a list with one per prompt (a list of
        another length, or an empty one, raises :class:`~dfllm.errors.InvalidRequestError`);
        under ``LLM(scheduling_policy="priority")`` lower values are scheduled first (together
        with the requests already queued by ``enqueue``), and under the default ``"fcfs"`` any
        priority is accepted and changes nothing (arrival order), as in vLLM.
        ``lora_request`` (vLLM's; ``LLM(enable_lora=True)``): a
        :class:`~dfllm.lora.request.LoRARequest` for every prompt, or a list with one per prompt
        (None: the base model); requests of different adapters share every step. A bad adapter
        (see :mod:`dfllm.lora.adapter`) raises :class:`~dfllm.errors.InvalidRequestError` naming
        it before any work starts.
        """
        requests = self._engine("generate").input_processor.process_prompts(prompts, sampling_params)
        return raise_for_errors(
            self._run([self._add(requests, priority, lora_request)], use_tqdm), lambda i: f"prompt {i}"
        )

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        use_tqdm: bool = True,
        lora_request: Any = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        priority: int | list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations.

        Each conversation is a list of ``{"role", "content"}`` messages, rendered with the
        tokenizer's chat template (or ``chat_template``) in transformers' sandboxed Jinja
        environment, then generated like ``generate`` (failures included: an error names the
        conversation by index; ``priority`` as there, one per conversation).
        ``chat_template_kwargs`` are extra variables for the template (e.g.
        ``{"enable_thinking": False}``). ``lora_request`` as in ``generate``.
        """
        requests = self._engine("chat").input_processor.process_chats(
            messages,
            sampling_params,
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
        )
        return raise_for_errors(
            self._run([self._add(requests, priority, lora_request)], use_tqdm), lambda i: f"conversation {i}"
        )

    def beam_search(
        self,
        prompts,
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: for each prompt (a string, ``{"prompt": str}`` or
        ``{"prompt_token_ids": [...]}``) the ``params.beam_width`` best sequences by
        length-penalised cumulative log-probability, best first (see :mod:`dfllm.beam_search`).

        Each step is one :meth:`generate` call of one token over every live beam, with
        ``logprobs=2 * beam_width`` (so ``beam_width`` up to ``max_logprobs / 2``): the prefix cache
        shares the beams' common prefixes. ``concurrency_limit`` runs that many prompts at a time
        (None: all); ``lora_request`` is one adapter or one per prompt, as in :meth:`generate`.
        ``params.structured_outputs`` constrains every beam's continuation (as vLLM's search does).
        Needs a tokenizer (its end-of-sequence token ends a beam)."""
        tokenizer = self.get_tokenizer()
        processor = self._engine("beam_search").input_processor
        items = as_prompt_list(prompts)
        ids = [
            p["prompt_token_ids"]
            if isinstance(p, dict) and "prompt_token_ids" in p
            else tokenizer.encode(p["prompt"] if isinstance(p, dict) else p)
            for p in items
        ]
        constraints = None
        if params.structured_outputs is not None:  # compiled (and checked) once per prompt by the engine
            constraints = [
                processor.process({"prompt_token_ids": t}, params.check_params(), what=f"prompt {i}").grammar
                for i, t in enumerate(ids)
            ]

        def step(steps: list[BeamStep]) -> list[dict]:
            loras = [s.beam.lora_request for s in steps]
            outs = self.generate(
                [{"prompt_token_ids": s.beam.tokens} for s in steps],
                [s.sampling_params() for s in steps],
                use_tqdm=False,
                lora_request=None if all(lora is None for lora in loras) else loras,
            )
            return [o.outputs[0].logprobs[0] for o in outs]  # type: ignore[index]

        found = beam_search(
            step,
            ids,
            params,
            tokenizer.eos_token_id,
            self.config.max_model_len,
            loras=None if lora_request is None else per_prompt(lora_request, len(ids)),
            concurrency_limit=concurrency_limit,
            use_tqdm=use_tqdm,
            constraints=None if constraints is None else [g.allowed_after if g else None for g in constraints],
        )
        for beams in found:
            for beam in beams:
                beam.text = str(tokenizer.decode(beam.tokens))
        outputs = [BeamSearchOutput(beams) for beams in found]
        failed = [i for i, beams in enumerate(found) if not beams and constraints is not None]
        if failed:  # each beam of these prompts reached a point where the grammar allows no token
            names = ", ".join(f"prompt {i}" for i in failed)
            raise BeamSearchError(f"{names}: {NO_SEQUENCE}", outputs, failed)
        return outputs

    def enqueue(
        self, prompts, sampling_params: Any = None, *, priority: int | list[int] | None = None, lora_request: Any = None
    ) -> list[str]:
        """Queue prompts without running them; return their request ids.

        Each prompt is checked now, as ``generate`` checks it: a bad one raises
        :class:`~dfllm.errors.InvalidRequestError` naming its index and nothing of the call
        is queued. ``priority`` as in ``generate``. Requests queued by several calls are
        scheduled together by :meth:`wait_for_completion` (or by any ``generate`` call in
        between). If a step of a ``generate`` call in between raises, they are re-run from
        scratch (greedy and seeded ones give the outputs they would have had);
        :meth:`wait_for_completion` then returns them, and reports any that fails (see there).

        On a pooling model (an embedder, a classifier) the second argument is a
        :class:`~dfllm.PoolingParams` (one, a list with one per prompt, or None): each
        request computes its params' ``task``, or when that is None the model's own task
        ("embed" for an embedding model, "classify" for a classifier or cross-encoder), and
        waits for :meth:`wait_for_completion` (``embed``/``encode`` calls in between run
        their own prompts only). ``priority`` is checked as above; the queued requests all
        run in that one call, so it changes nothing there.
        """
        if self._pooling is not None:
            with invalid_request():
                self._priorities(priority, len(as_prompt_list(prompts)))
            return self._pooling.enqueue(prompts, sampling_params)
        requests = self._engine("enqueue").input_processor.process_prompts(prompts, sampling_params)
        self._queued.append(self._add(requests, priority, lora_request))
        return self._queued[-1][1]

    def enqueue_chat(
        self,
        messages,
        sampling_params=None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        priority: int | list[int] | None = None,
        lora_request: Any = None,
    ) -> list[str]:
        """Queue conversations like :meth:`chat` (same keyword arguments); return their request ids."""
        requests = self._engine("enqueue_chat").input_processor.process_chats(
            messages,
            sampling_params,
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
        )
        self._queued.append(self._add(requests, priority, lora_request))
        return self._queued[-1][1]

    def wait_for_completion(self, use_tqdm: bool = True) -> list[RequestOutput] | list[PoolingRequestOutput]:
        """Run the engine until every queued request is done; outputs in enqueue order, each
        request's once.

        No queued request is dropped silently: each one's output is returned, or the call
        raises :class:`~dfllm.outputs.RequestFailedError` (a ``RuntimeError``) naming the
        failed ones by request id once all are done, with every output (the failed ones'
        with ``finish_reason="error"`` and the reason) in its ``outputs``. A request fails
        when the model produces non-finite logits for it, or when a step raises and its
        ``enqueue`` call's requests, re-run from scratch on their own, make it raise again.

        On a pooling model the outputs are :class:`~dfllm.outputs.PoolingRequestOutput`
        (the raw tensor of each request's task, as ``encode`` returns), batched by task; see
        :meth:`dfllm.llm_pooling.PoolingFrontend.wait_for_completion` for its failures.
        """
        if self._pooling is not None:
            return self._pooling.wait_for_completion(use_tqdm)
        groups, self._queued = self._queued, []
        outputs = self._run(groups, use_tqdm, raise_failures=False)
        return raise_for_errors(outputs, lambda i: f"request {outputs[i].request_id}")

    @property
    def llm_engine(self) -> LLMEngine | None:
        """The generation engine, under vLLM's name (None for a pooling model)."""
        return self.engine

    @llm_engine.setter
    def llm_engine(self, engine: LLMEngine | None) -> None:
        self.engine = engine

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer the engine uses (a transformers tokenizer); ``ValueError`` under
        ``skip_tokenizer_init=True``, as in vLLM."""
        if self.tokenizer is None:
            raise ValueError(f"{NO_TOKENIZER} (LLM(skip_tokenizer_init=True) loads no tokenizer)")
        return self.tokenizer

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Restore what :meth:`sleep` released: ``tags`` among "weights" and "kv_cache" (None:
        both; vLLM's "scheduling" is accepted and restores nothing, dfllm never pauses
        scheduling). Returns the engine's answer, as vLLM: whether it is now fully awake (False
        after waking only ``["weights"]`` from a sleep that released both).

        As vLLM's, this goes through ``self.llm_engine`` and nothing else.
        """
        engine = self.llm_engine
        if engine is None:
            raise ValueError(
                "wake_up: this LLM is loaded as a pooling model (no generation engine to wake); "
                "sleep mode is for generative models"
            )
        return engine.wake_up(tags)

    def shutdown(self) -> None:
        """Stop the engine's worker processes (``tensor_parallel_size`` or
        ``pipeline_parallel_size`` above 1); the LLM cannot run afterwards. They also stop
        when the LLM is garbage-collected or the process exits."""
        if self.engine is not None:
            self.engine.shutdown()

    # ---- pooling: dfllm.llm_pooling.PoolingFrontend ------------------------------------------
    encode = _delegate("_pooling", PoolingFrontend.encode)
    embed = _delegate("_pooling", PoolingFrontend.embed)
    classify = _delegate("_pooling", PoolingFrontend.classify)
    score = _delegate("_pooling", PoolingFrontend.score)

    # ---- engine control: dfllm.llm_control.EngineControl ----------------------------------------
    start_profile = _delegate("_control", EngineControl.start_profile)
    stop_profile = _delegate("_control", EngineControl.stop_profile)
    sleep = _delegate("_control", EngineControl.sleep)
    reset_prefix_cache = _delegate("_control", EngineControl.reset_prefix_cache)
    reset_mm_cache = _delegate("_control", EngineControl.reset_mm_cache)
    get_metrics = _delegate("_control", EngineControl.get_metrics)
    init_weight_transfer_engine = _delegate("_control", EngineControl.init_weight_transfer_engine)
    start_weight_update = _delegate("_control", EngineControl.start_weight_update)
    update_weights = _delegate("_control", EngineControl.update_weights)
    finish_weight_update = _delegate("_control", EngineControl.finish_weight_update)
    update_weight_version = _delegate("_control", EngineControl.update_weight_version)
    get_weight_version = _delegate("_control", EngineControl.get_weight_version)
    collective_rpc = _delegate("_control", EngineControl.collective_rpc)
    apply_model = _delegate("_control", EngineControl.apply_model)

    # ---- running the calls' requests ---------------------------------------------------------
    def _component(self, name: str, method: str, kwargs: dict) -> Any:
        if name == "_pooling" and self._pooling is None:  # a generative model: name the task asked for
            raise not_pooling_error(check_pooling_task(kwargs.get("pooling_task")) if method == "encode" else method)
        return getattr(self, name)

    def _engine(self, method: str) -> LLMEngine:
        return self._control.require_generative(method)

    def _next_id(self) -> str:
        return str(next(self._ids))

    @staticmethod
    def _priorities(priority: int | list[int] | None, num_requests: int) -> list[int]:
        """vLLM's ``priority`` argument as one int per request: None is all 0, an int is the
        same for every request, a list has one per request (another length, an empty list
        included, is :class:`~dfllm.errors.InvalidRequestError`, as vLLM's validation error).
        Any value is accepted under either scheduling policy, as in vLLM; only "priority"
        schedules by it."""
        if priority is None:
            return [0] * num_requests
        if isinstance(priority, int) and not isinstance(priority, bool):
            priorities = [priority] * num_requests
        elif isinstance(priority, list | tuple):
            priorities = list(priority)
            if len(priorities) != num_requests:
                raise InvalidRequestError(
                    f"The lengths of prompts ({num_requests}) and priority ({len(priorities)}) must be the same. "
                    f"(priority: got {len(priorities)} priorities for {num_requests} prompts)",
                    parameter="priority",
                    value=priority,
                )
        else:
            raise InvalidRequestError(
                f"priority must be an int or a list of ints (one per prompt), got {type(priority).__name__}",
                parameter="priority",
                value=priority,
            )
        for p in priorities:
            if isinstance(p, bool) or not isinstance(p, int):
                raise InvalidRequestError(
                    f"priority: every priority must be an int, got {p!r}", parameter="priority", value=p
                )
        return priorities

    def _loras(self, lora_request: Any, num_requests: int) -> list[LoRARequest | None]:
        """vLLM's ``lora_request`` as one adapter (or None) per request, each checked by the
        engine now (:class:`~dfllm.errors.InvalidRequestError` naming the adapter and why)."""
        if lora_request is None:
            return [None] * num_requests
        loras = per_prompt(lora_request, num_requests)
        engine = self._engine("lora_request")
        given = next((lora for lora in loras if lora is not None), None)
        if engine.lora is None and given is not None:
            raise InvalidRequestError(
                f"Got lora_request {given!r} but LoRA is not enabled! (lora_request: LoRA "
                "adapters are not supported by this engine; start it with "
                "LLM(enable_lora=True))",
                parameter="lora_request",
            )
        checked: set[int] = set()
        for i, lora in enumerate(loras):
            if lora is None or id(lora) in checked:
                continue
            if not isinstance(lora, LoRARequest):
                raise InvalidRequestError(
                    f"lora_request (prompt {i}): expected a LoRARequest or None, got {type(lora).__name__}",
                    parameter="lora_request",
                )
            engine.check_lora(lora)
            checked.add(id(lora))
        return loras

    def _add(
        self, requests: list[EngineRequest], priority: int | list[int] | None = None, lora_request: Any = None
    ) -> tuple[int, list[str]]:
        """Queue one call's checked requests as one group, with the call's ``priority`` (default 0)
        and ``lora_request`` (default none), each checked first; (the group, their request ids)."""
        loras = self._loras(lora_request, len(requests))
        priorities = self._priorities(priority, len(requests))
        self._control.check_can_serve()
        engine = self._control.require_generative("generate")
        group, ids = next(self._groups), [self._next_id() for _ in requests]
        for rid, request, p, lora in zip(ids, requests, priorities, loras):
            engine.add_request(rid, request, group=group, priority=p, lora_request=lora)
        return group, ids

    def _run(
        self, groups: list[tuple[int, list[str]]], use_tqdm: bool, *, raise_failures: bool = True
    ) -> list[RequestOutput]:
        """Step the engine until the requests of ``groups`` are done; their outputs in order.

        Other queued requests are batched along; their outputs are kept for
        ``wait_for_completion``. If a step raises, these groups are re-run at once (the others
        later, from scratch); a group that fails again on its own has its error raised
        (``raise_failures``), or its requests end with error outputs.
        """
        ids = [rid for _, group_ids in groups for rid in group_ids]
        wanted, groups_now = set(ids), {group for group, _ in groups}
        bar = _ProgressBar(len(ids), use_tqdm)
        engine = self._control.require_generative("generate")
        try:
            while not wanted <= self._outputs.keys():
                if not engine.has_unfinished_requests():  # cannot happen: a bug, not a hang
                    raise RuntimeError(f"requests {sorted(wanted - self._outputs.keys())} were lost by the engine")
                for out in engine.step(rerun=groups_now):
                    self._outputs[out.request_id] = out
                    if out.request_id in wanted:
                        bar.update(out)
                for group, _ in groups:
                    failure = engine.take_failure(group)
                    if failure is not None and raise_failures:
                        raise failure
        except BaseException:
            for rid in ids:
                self._outputs.pop(rid, None)
            raise
        finally:
            bar.close()
        return [self._outputs.pop(rid) for rid in ids]


class _ProgressBar:
    """tqdm bar over prompts, showing input and output tokens per second."""

    def __init__(self, total: int, enabled: bool):
        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, disable=not enabled)
        self.start = time.perf_counter()
        self.tokens_in = self.tokens_out = 0

    def update(self, out: RequestOutput) -> None:
        self.tokens_in += len(out.prompt_token_ids)
        self.tokens_out += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"in: {self.tokens_in / elapsed:.0f} tok/s, out: {self.tokens_out / elapsed:.0f} tok/s", refresh=False
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _eos_token_ids(path: Path, tokenizer: PreTrainedTokenizerBase | None) -> set[int]:
    """End-of-sequence ids: the generation config's (it may list several) and the tokenizer's;
    without a tokenizer (``skip_tokenizer_init``), the model config's in its place."""
    ids: set[int] = set()
    if (path / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is None:
        eos = json.loads((path / "config.json").read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    elif tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
