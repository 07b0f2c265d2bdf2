"""The engine loop: requests in, scheduled steps, sampled tokens, finished requests out.

A sequence whose logits are not finite (NaN, +inf, or no finite value: NaN weights, an
overflow) is not sampled: it ends with ``finish_reason="error"`` and a message, and the
other sequences of the batch go on. A step that raises is another matter: the engine's
state is then unknown, so the caller aborts everything (:meth:`LLMEngine.abort_all`) and
re-queues what it still wants from scratch (:meth:`LLMEngine.requeue`).
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import PreTrainedTokenizerBase

from dfllm.config import EngineConfig
from dfllm.engine.block_manager import BlockManager
from dfllm.engine.detokenizer import Detokenizer
from dfllm.engine.metrics import EngineMetrics
from dfllm.engine.model_runner import ModelRunner
from dfllm.engine.sampler import SampledToken, Sampler
from dfllm.engine.scheduler import Scheduler
from dfllm.engine.sequence import Request, Sequence
from dfllm.kernels.backend import select_ops
from dfllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from dfllm.sampling_params import SamplingParams

logger = logging.getLogger("dfllm")


class LLMEngine:
    """One model on one device with its KV cache, scheduler, sampler and detokenizer."""

    def __init__(self, cfg: EngineConfig, tokenizer: PreTrainedTokenizerBase, eos_token_ids: set[int]):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        ops = select_ops(cfg.attention_backend, cfg.device)
        if cfg.tensor_parallel_size * cfg.pipeline_parallel_size > 1:  # ranks in worker processes
            from dfllm.engine.executor import ParallelExecutor

            self.runner = ParallelExecutor(cfg)
        else:
            self.runner = ModelRunner(cfg.hf_config, cfg.model_path, dtype=cfg.dtype, device=cfg.device, ops=ops,
                                      max_model_len=cfg.max_model_len, block_size=cfg.block_size)
        try:
            num_blocks = self.runner.plan_num_blocks(cfg.kv_cache_memory_bytes, cfg.gpu_memory_utilization,
                                                     cfg.max_num_seqs, cfg.max_num_batched_tokens)
            if num_blocks * cfg.block_size < cfg.max_model_len:
                raise ValueError(
                    f"the KV cache holds {num_blocks * cfg.block_size} tokens ({num_blocks} blocks), fewer than "
                    f"max_model_len={cfg.max_model_len}; raise kv_cache_memory_bytes or lower max_model_len"
                )
            self.runner.allocate_kv_cache(num_blocks)
        except BaseException:
            self.shutdown()  # a parallel engine's worker processes go with it
            raise
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, %s) on %s", num_blocks,
                    cfg.block_size, num_blocks * cfg.block_size, num_blocks * self.runner.block_bytes / 2**20,
                    str(cfg.dtype).removeprefix("torch."), cfg.device)
        self.block_manager = self._new_block_manager(num_blocks)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.sampler = Sampler(eos_token_ids, cfg.seed)
        self.detokenizer = Detokenizer(tokenizer)
        self.metrics = EngineMetrics(cfg.model_path.name)
        self.num_generated_tokens = 0
        self.requests: dict[str, Request] = {}  # queued or running, or finished by a step that raised
        self.last_step_requests: list[str] = []  # the request ids of the last scheduled step's sequences
        self.sleep_level = 0  # 0 awake; 1 weights on host, KV freed; 2 weights and KV freed
        self.asleep: set[str] = set()  # which of "weights", "kv_cache" are released

    def _new_block_manager(self, num_blocks: int) -> BlockManager:
        # On CPU, untouched cache memory costs nothing: reuse freed blocks before new ones.
        return BlockManager(num_blocks, self.cfg.block_size, self.cfg.enable_prefix_caching,
                            reuse_first=self.cfg.device.type == "cpu")

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> Request:
        """Queue a prompt; its ``params.n`` sequences are scheduled independently."""
        structured = params.structured_outputs
        if structured is not None:
            self._grammar_compiler().compile(structured)  # before queuing: an error leaves nothing behind
        req = Request(request_id, prompt, list(prompt_token_ids), params, RequestMetrics(time.time()))
        for i in range(params.n):
            gen = None if params.seed is None else torch.Generator().manual_seed(params.seed + i)
            seq = Sequence(req, i, list(prompt_token_ids), len(prompt_token_ids), gen)
            seq.logprobs = [] if params.logprobs is not None else None
            if structured is not None:
                seq.grammar = self._grammar_compiler().matcher(structured)
            self.detokenizer.start(seq)
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = req
        return req

    def abort_all(self) -> list[Request]:
        """Drop every request not yet returned by :meth:`step` (queued, running, or finished
        by a step that raised) and free its blocks, so the engine stays usable after a failed
        step; the dropped requests, in arrival order."""
        self.scheduler.abort_all()
        dropped = list(self.requests.values())
        self.requests.clear()
        return dropped

    def requeue(self, req: Request) -> Request:
        """Queue ``req`` again from scratch, under its id, with fresh sequences (and fresh
        seeded generators, so a greedy or seeded request gives the output it would have had)."""
        new = self.add_request(req.request_id, req.prompt, req.prompt_token_ids, req.params)
        new.metrics.arrival_time = req.metrics.arrival_time
        return new

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _grammar_compiler(self):
        """The structured-outputs compiler for this tokenizer and vocabulary, built on first use."""
        compiler = getattr(self, "_grammars", None)
        if compiler is None:
            from dfllm.engine.structured import GrammarCompiler

            compiler = self._grammars = GrammarCompiler(self.tokenizer, self.cfg.hf_config.vocab_size,
                                                        self.eos_token_ids)
        return compiler

    def step(self) -> list[Request]:
        """Run one scheduled step; return the requests it finished."""
        self.check_awake()
        bm = self.block_manager
        queries, hits = bm.prefix_queries, bm.prefix_hits
        sched = self.scheduler.schedule()
        preempted = sched.num_preempted
        if not sched:  # a step that only preempted admits nothing; the next one will
            sched = self.scheduler.schedule()
            preempted += sched.num_preempted
        if not sched:
            raise RuntimeError("the scheduler could not schedule any waiting sequence")
        self.last_step_requests = [s.request.request_id for s in sched.seqs]
        self.runner.zero_blocks(bm.drain_to_zero())
        with torch.profiler.record_function("dfllm.step"):
            finished = self._execute(sched)
        for req in finished:
            self.requests.pop(req.request_id, None)
        self.metrics.observe_step(len(self.scheduler.running), len(self.scheduler.waiting), bm.usage, preempted,
                                  bm.prefix_queries - queries, bm.prefix_hits - hits)
        return finished

    def _execute(self, sched) -> list[Request]:
        logits, sample_seqs = self.runner.run(sched)
        for seq, n in zip(sched.seqs, sched.num_new_tokens):
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        finished: list[Request] = []
        if not sample_seqs:
            return finished
        now = time.time()
        bad = non_finite_rows(logits)
        if bad:
            for i, what in bad.items():
                seq = sample_seqs[i]
                seq.error = (f"the model produced non-finite logits ({what}) at output token "
                             f"{seq.num_output_tokens} (0-based)")
                logger.warning("request %s: %s", seq.request.request_id, seq.error)
                self._finish(seq, "error", None)
                self._note_if_finished(seq, now, finished)
            keep = [i for i in range(len(sample_seqs)) if i not in bad]
            logits, sample_seqs = logits[keep], [sample_seqs[i] for i in keep]
        if sample_seqs:
            for seq, tok in zip(sample_seqs, self.sampler(logits, sample_seqs)):
                self._append(seq, tok, now)
                self._note_if_finished(seq, now, finished)
        return finished

    def _note_if_finished(self, seq: Sequence, now: float, finished: list[Request]) -> None:
        if seq.is_finished and seq.request.is_finished:
            seq.request.metrics.finished_time = now
            self.metrics.observe_finish(now - seq.request.metrics.arrival_time)
            finished.append(seq.request)

    def _append(self, seq: Sequence, tok: SampledToken, now: float) -> None:
        token = tok.token_id
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
        m = seq.request.metrics
        first = m.first_token_time is None
        self.metrics.observe_token(first, len(seq.request.prompt_token_ids),
                                   now - (m.arrival_time if first else m.last_token_time))
        if first:
            m.first_token_time = now
        m.last_token_time = now
        if tok.logprob is not None:
            seq.cumulative_logprob += tok.logprob
            seq.logprobs.append(self._logprob_dict(tok))
        p = seq.params
        if seq.grammar is not None:
            if not seq.grammar.accept(token):  # the mask allows only accepted tokens: a bug if reached
                logger.error("structured outputs: the grammar rejected token %d of request %s", token,
                             seq.request.request_id)
                return self._finish(seq, "stop", None)
            if seq.grammar.terminated:  # complete, and a stop token accepted: done whatever ignore_eos says
                return self._finish(seq, "stop", None)
        stops_allowed = seq.num_output_tokens >= p.min_tokens
        if stops_allowed and not p.ignore_eos and token in self.eos_token_ids:
            return self._finish(seq, "stop", None)
        delta = self.detokenizer.step(seq)
        if stops_allowed and token in p.stop_token_ids:
            return self._finish(seq, "stop", token)
        if stops_allowed and delta and p.stop_strings:
            stop = self.detokenizer.find_stop(seq, len(delta))
            if stop is not None:
                return self._finish(seq, "stop", stop)
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return self._finish(seq, "length", None)
        if seq.num_tokens >= self.cfg.max_model_len:
            return self._finish(seq, "length", None)

    # ---- sleep mode and caches -------------------------------------------------------
    def check_awake(self) -> None:
        if self.asleep:
            raise RuntimeError(f"the engine is asleep (level {self.sleep_level}, released: "
                               f"{', '.join(sorted(self.asleep))}); call wake_up() first")

    def sleep(self, level: int) -> None:
        """Release the KV cache, and the weights (to host memory at level 1, entirely at 2)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.has_unfinished():
            raise RuntimeError("sleep: requests are still queued or running; wait for them first")
        self.block_manager.reset_prefix_cache()
        self.runner.free_kv_cache()
        if "weights" not in self.asleep and level == 1:
            self.runner.offload_weights()
        elif "weights" not in self.asleep:
            self.runner.drop_weights()
        self.sleep_level = max(self.sleep_level, level)
        self.asleep |= {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore the released ``tags`` ("weights", "kv_cache"; None means both)."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags must be among 'weights' and 'kv_cache', got {sorted(unknown)}")
        if "weights" in tags and "weights" in self.asleep:
            if self.sleep_level == 1:
                self.runner.onload_weights()
            else:
                self.runner.reload_weights()
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            num_blocks = self.block_manager.num_blocks
            self.runner.allocate_kv_cache(num_blocks)
            self.block_manager = self._new_block_manager(num_blocks)
            self.scheduler.bm = self.block_manager
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.sleep_level = 0

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel engine (nothing to do on one rank)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; refuse (False) while requests are queued or running."""
        if self.has_unfinished():
            return False
        self.block_manager.reset_prefix_cache()
        return True

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)

    def _logprob_dict(self, tok: SampledToken) -> dict[int, Logprob]:
        texts = self.tokenizer.batch_decode([[t] for t, _, _ in tok.top])
        return {t: Logprob(lp, rank, text) for (t, lp, rank), text in zip(tok.top, texts)}

    @staticmethod
    def make_output(req: Request) -> RequestOutput:
        """The ``RequestOutput`` of a (finished) request."""
        outs = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=s.output_token_ids,
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                structured_output_complete=None if s.grammar is None else (
                    s.grammar.rejected is None and s.grammar.completed and not isinstance(s.stop_reason, str)
                    and s.finish_reason != "error"),
                error=s.error,
            )
            for s in req.seqs
        ]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.is_finished,
                             req.num_cached_tokens, req.metrics)

    @staticmethod
    def error_output(req: Request, message: str) -> RequestOutput:
        """The ``RequestOutput`` of a request that failed as a whole: each of its ``n``
        completions empty, with ``finish_reason="error"`` and ``message``."""
        outs = [CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                                 finish_reason="error", error=message) for i in range(req.params.n)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, True, 0, req.metrics)


def non_finite_rows(logits: torch.Tensor) -> dict[int, str]:
    """Rows of ``logits`` that cannot be sampled, with what is wrong: any NaN, any +inf, or
    no finite value at all. One pass (a row's max is NaN, +inf or -inf exactly then)."""
    top = logits.amax(dim=-1)
    bad = (~torch.isfinite(top)).nonzero().flatten().tolist()
    if not bad:
        return {}
    return {i: "NaN" if bool(logits[i].isnan().any()) else "+inf" if bool(logits[i].isposinf().any())
            else "no finite value" for i in bad}
