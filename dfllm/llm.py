"""The offline ``LLM`` class, with vLLM's constructor and methods."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from dfllm.config import (EngineConfig, check_engine_args, resolve_device, resolve_dtype,
                          resolve_max_model_len)
from dfllm.distributed.parallel_state import check_parallel_config
from dfllm.engine.llm_engine import LLMEngine
from dfllm.engine.pooling_engine import PoolingEngine
from dfllm.inputs import (TokenizedPrompt, as_conversation_list, as_prompt_list, check_params_for_model,
                          per_prompt_params, tokenize_prompts)
from dfllm.llm_control import ControlMixin
from dfllm.llm_pooling import PoolingMixin
from dfllm.logger import init_logger
from dfllm.models.bundled import resolve_model
from dfllm.models.loader import load_config
from dfllm.models.pooler import load_pooler_config
from dfllm.models.registry import is_pooling_only
from dfllm.outputs import RequestOutput, raise_for_errors
from dfllm.sampling_params import SamplingParams

logger = init_logger()


RUNNERS = ("auto", "generate", "pooling")


class LLM(PoolingMixin, ControlMixin):
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

    Failures stay with the requests that cause them. A prompt for which the model produces
    non-finite logits (NaN, +inf, or no finite value: NaN weights, an overflow) ends with
    ``finish_reason="error"`` while the rest of the batch goes on; ``generate``/``chat``
    then raise :class:`~dfllm.outputs.RequestFailedError` (a ``RuntimeError``) naming the
    prompt by index, with every output in its ``outputs``. If a step raises, nothing queued
    is lost: the engine drops its batch and re-runs the call's unfinished requests from
    scratch on their own (a ``generate`` call that still fails alone raises that error), and
    re-queues requests of ``enqueue`` from scratch for a later call.
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
        profiler_dir: str | Path = "./dfllm_traces",
    ):
        if runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
        check_engine_args(max_num_seqs, block_size, gpu_memory_utilization, tensor_parallel_size, attention_backend)
        path = resolve_model(model)
        hf_config = load_config(path)
        dev = resolve_device(device)
        max_len = resolve_max_model_len(max_model_len, hf_config)
        self.runner_type = _resolve_runner(runner, hf_config, path)
        _check_parallel(hf_config, self.runner_type, tensor_parallel_size, pipeline_parallel_size)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = _default_token_budget(dev, self.runner_type, max_num_seqs)
        elif max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.config = EngineConfig(
            model_path=path, hf_config=hf_config, dtype=resolve_dtype(dtype, hf_config, dev), device=dev,
            max_model_len=max_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory_bytes=kv_cache_memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
            seed=seed, attention_backend=attention_backend, tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
        )
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(tokenizer or path,
                                                                                trust_remote_code=False)
        self.engine: LLMEngine | None = None
        self.pooling_engine: PoolingEngine | None = None
        if self.runner_type == "pooling":
            pooler = load_pooler_config(path, is_decoder=not is_pooling_only(hf_config))
            self.pooling_engine = PoolingEngine(self.config, pooler)
        else:
            self.engine = LLMEngine(self.config, self.tokenizer, _eos_token_ids(path, self.tokenizer))
        self._request_counter = 0
        self._done: dict[str, RequestOutput] = {}
        self._init_control(profiler_dir)

    # ---- public API -------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine's worker processes (``tensor_parallel_size`` or
        ``pipeline_parallel_size`` above 1); the LLM cannot run afterwards. They also stop
        when the LLM is garbage-collected or the process exits."""
        if self.engine is not None:
            self.engine.shutdown()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer the engine uses (a transformers tokenizer)."""
        return self.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for one prompt or a list of prompts, returned in input order.

        A prompt is a string, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``.
        ``sampling_params`` is one object for all prompts or a list with one per prompt.
        Every prompt is checked (emptiness, vocabulary, ``max_model_len``) before any work
        starts; a bad one raises ``ValueError`` naming its index. A prompt for which the model
        produces non-finite logits makes the call raise
        :class:`~dfllm.outputs.RequestFailedError` (a ``RuntimeError``) naming its index, once
        every other prompt is done; their outputs are in the error's ``outputs``. An exception
        in the engine is raised if these prompts cause it on their own (see the class).
        """
        ids = self._add_requests(*self._tokenize(prompts, sampling_params, "generate"))
        return raise_for_errors(self._run_until_done([ids], use_tqdm), lambda i: f"prompt {i}")

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations.

        Each conversation is a list of ``{"role", "content"}`` messages, rendered with the
        tokenizer's chat template (or ``chat_template``) in transformers' sandboxed Jinja
        environment, then generated like ``generate`` (failures included: an error names the
        conversation by index).
        """
        ids = self._add_requests(*self._render_chats(messages, sampling_params, chat_template,
                                                     add_generation_prompt, continue_final_message))
        return raise_for_errors(self._run_until_done([ids], use_tqdm), lambda i: f"conversation {i}")

    # ---- preparing requests ----------------------------------------------------------
    def _tokenize(self, prompts, sampling_params, method: str) -> tuple[list[TokenizedPrompt], list[SamplingParams]]:
        self._require_generative(method)
        prompt_list = as_prompt_list(prompts)
        params = per_prompt_params(sampling_params, len(prompt_list))
        return tokenize_prompts(prompt_list, self.tokenizer, self.config.hf_config.vocab_size), params

    def _render_chats(self, messages, sampling_params, chat_template: str | None = None,
                      add_generation_prompt: bool = True,
                      continue_final_message: bool = False) -> tuple[list[TokenizedPrompt], list[SamplingParams]]:
        self._require_generative("chat")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
        convs = as_conversation_list(messages)
        params = per_prompt_params(sampling_params, len(convs))
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass chat_template=...")
        tokenized = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(
                [_flatten_content(m) for m in conv], chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)
            tokenized.append(TokenizedPrompt(text, self.tokenizer.encode(text, add_special_tokens=False)))
        return tokenized, params

    def _require_generative(self, method: str) -> LLMEngine:
        if self.engine is None:
            raise ValueError(f"{method}: {self.config.model_path.name} is loaded as a pooling model; "
                             "use embed, classify, score or encode")
        return self.engine

    # ---- running ----------------------------------------------------------------------
    def _add_requests(self, prompts: list[TokenizedPrompt], params: list[SamplingParams]) -> list[str]:
        """Check every prompt against ``max_model_len``, then queue them all; their request ids."""
        self._check_can_serve()
        limit = self.config.max_model_len
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if not p.token_ids:  # e.g. a chat template that rendered nothing
                raise ValueError(f"prompt {i} is empty (no tokens)")
            if len(p.token_ids) > limit:
                raise ValueError(f"prompt {i} has {len(p.token_ids)} tokens, longer than max_model_len={limit}")
            check_params_for_model(sp, i, self.config.hf_config.vocab_size)
        ids = []
        for p, sp in zip(prompts, params):
            ids.append(self._next_id())
            self.engine.add_request(ids[-1], p.prompt, p.token_ids, sp)
        return ids

    def _run_until_done(self, groups: list[list[str]], use_tqdm: bool, *,
                        raise_failures: bool = True) -> list[RequestOutput]:
        """Step the engine until the requests of ``groups`` are done; their outputs in order.

        A group is the requests of one call (``generate``, one ``enqueue``). Other queued
        requests are batched along; their outputs are kept for ``wait_for_completion``. A
        step that raises loses nothing (:meth:`_recover`): a group that fails again on its
        own raises that error (``raise_failures``) or gets error outputs.
        """
        ids = [rid for group in groups for rid in group]
        wanted = set(ids)
        bar = _ProgressBar(len(ids), use_tqdm)
        try:
            while not wanted <= self._done.keys():
                if not self.engine.has_unfinished():  # cannot happen: a bug, not a hang
                    raise RuntimeError(f"requests {sorted(wanted - self._done.keys())} were lost by the engine")
                try:
                    finished = self._step_and_collect()
                except Exception as exc:
                    finished, failures = self._recover(exc, groups)
                    for failure, failed in failures.values():
                        if raise_failures:
                            raise failure
                        for req in failed:
                            self._done[req.request_id] = self.engine.error_output(
                                req, f"the engine failed while serving request {req.request_id}: {failure!r}")
                for req in finished:
                    if req.request_id in wanted:
                        bar.update(req)
        except Exception:
            for rid in ids:
                self._done.pop(rid, None)
            raise
        finally:
            bar.close()
        return [self._done.pop(rid) for rid in ids]

    def _recover(self, exc: Exception, groups: list[list[str]]) -> tuple[list, dict[int, tuple[Exception, list]]]:
        """After a step that raised: drop every unfinished request from the engine, re-run
        those of ``groups`` (one call's, or one dataframe partition's, requests each) from
        scratch one group at a time (outputs already finished stay), then re-queue the others
        from scratch for a later call.

        Returns the requests finished, and for each group that failed again on its own (the
        cause) its index -> (that error, its unfinished requests, dropped from the engine).
        """
        dropped = {req.request_id: req for req in self.engine.abort_all()}
        logger.warning("an engine step failed (%r): re-running %d unfinished requests, one group at a time",
                       exc, len(dropped))
        finished: list = []
        failures: dict[int, tuple[Exception, list]] = {}
        try:
            for g, group in enumerate(groups):
                requests = [dropped.pop(rid) for rid in group if rid in dropped]
                if not requests:
                    continue
                try:
                    finished += self._run_alone(requests)
                except Exception as failure:
                    failures[g] = (failure, self.engine.abort_all())
        finally:
            for req in dropped.values():  # another call's: from scratch, with the next call's steps
                self.engine.requeue(req)
        return finished, failures

    def _run_alone(self, requests: list) -> list:
        """Queue ``requests`` again from scratch in the (emptied) engine and step until they
        are done; the requests finished. A step that raises propagates (the caller aborts)."""
        for req in requests:
            self.engine.requeue(req)
        finished = []
        while self.engine.has_unfinished():
            finished += self._step_and_collect()
        return finished

    def _step_and_collect(self) -> list:
        """One engine step; the outputs of the requests it finished are kept in ``_done``."""
        finished = self.engine.step()
        for req in finished:
            self._done[req.request_id] = self.engine.make_output(req)
        return finished


class _ProgressBar:
    """tqdm bar over prompts, showing input and output tokens per second."""

    def __init__(self, total: int, enabled: bool):
        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, disable=not enabled)
        self.start = time.perf_counter()
        self.tokens_in = self.tokens_out = 0

    def update(self, req) -> None:
        self.tokens_in += len(req.prompt_token_ids)
        self.tokens_out += sum(s.num_output_tokens for s in req.seqs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"in: {self.tokens_in / elapsed:.0f} tok/s, out: {self.tokens_out / elapsed:.0f} tok/s",
                                 refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _default_token_budget(device: torch.device, runner: str, max_num_seqs: int) -> int:
    """Tokens per step: 8192 on CUDA; on CPU 2048 for generation and 1024 padded tokens for
    pooling (smaller encoder batches stay in cache and measured faster there)."""
    if device.type == "cuda":
        return max(8192, max_num_seqs)
    return 1024 if runner == "pooling" else max(2048, max_num_seqs)


def _check_parallel(hf_config, runner: str, tp: int, pp: int) -> None:
    """Sizes the model splits by; pooling runs on one rank only."""
    if runner == "pooling" and (tp, pp) != (1, 1):
        raise NotImplementedError("pooling models (embed, classify, score, encode) run on one rank: "
                                  "tensor_parallel_size and pipeline_parallel_size must be 1")
    check_parallel_config(hf_config, tp, pp)


def _resolve_runner(runner: str, hf_config, path: Path) -> str:
    """"auto" -> pooling for encoders and sentence-transformers directories, else generate."""
    pooling_only = is_pooling_only(hf_config)
    if runner == "generate" and pooling_only:
        raise ValueError(f"{path.name} ({', '.join(hf_config.architectures)}) cannot generate text; "
                         "use runner='pooling' (embed, classify, score, encode)")
    if runner == "auto":
        return "pooling" if pooling_only or (path / "modules.json").is_file() else "generate"
    return runner


def _flatten_content(msg: dict) -> dict:
    content = msg["content"]
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    return {**msg, "content": content}


def _eos_token_ids(path: Path, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """End-of-sequence ids: the generation config's (it may list several) and the tokenizer's."""
    ids: set[int] = set()
    if (path / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
