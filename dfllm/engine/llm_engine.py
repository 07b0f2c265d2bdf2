"""The engine loop: checked requests in, one scheduled step at a time, finished outputs out.

A step reads as four verbs: the scheduler picks the sequences and how many tokens each
computes (:meth:`Scheduler.schedule`), the runner executes the model on them, the sampler
draws the next tokens, and the output processor appends them and decides which sequences
end; the scheduler then frees those. Requests come from
:class:`~dfllm.engine.input_processor.InputProcessor` already checked.

A sequence whose logits are not finite (NaN, +inf, or no finite value: NaN weights, an
overflow) is not sampled: it ends with ``finish_reason="error"`` and a message, and the
other sequences of the batch go on. A step that raises is another matter: the engine's
state is then unknown, so the engine drops every unfinished request and re-runs them from
scratch one *group* at a time (a group is the requests of one ``generate`` call, one
``enqueue`` call, or one dataframe partition; a request without a group is its own). A
group that fails again on its own is the cause: its requests end with
``finish_reason="error"`` and its exception is kept for :meth:`LLMEngine.take_failure`;
the other groups' requests give the outputs they would have had. A caller waiting for
some groups only (``LLM.generate`` while other calls' requests are queued) names them
(``step(rerun=...)``); the others are queued again from scratch for later steps.

A LoRA adapter that cannot be read into a slot (its files broke after its requests were
checked, and it had left the CPU cache) does not make a step raise: its unfinished requests
end with its error, and the step is scheduled again without them, so that the other requests
run as they would have without that adapter (``LLMEngine._schedule``).

With asynchronous scheduling (vLLM's ``async_scheduling=True``; one rank, text models) a
step does not wait for the tokens of the step before it: the scheduler counts each sampled
token as there (a sequence's ``pending_row``), the runner reads those tokens on the device
as the inputs of the next step, and the engine launches that step before it waits for the
tokens to reach the host and applies them (text, stop checks, outputs), so on a GPU that
host work runs while the forward does. The tokens are those of the synchronous loop: the
sampling of a step waits for the tokens before it (penalties, grammars and seeded draws see
the same history), a sequence that those tokens end wastes its row of the next step (dropped
before sampling; one whose token in flight reaches ``max_tokens`` is not scheduled at all),
and step outputs come one call of :meth:`LLMEngine.step` later.

Identical deterministic requests are computed once (``deduplicate_requests``, on by
default): a request whose prompt tokens and sampling parameters equal those of an
unfinished one, and whose output cannot differ from it (greedy, or seeded), follows that
one instead of being scheduled, and gets a copy of its output under its own id, prompt and
metrics, with ``num_cached_tokens`` = prompt length - 1 (everything but the last token
came for free). Unseeded sampled requests are never merged. Aborting the leader hands its
place to its first follower; a step that raises re-runs followers as requests of their own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Hashable, Iterable
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedTokenizerBase

from dfllm.config import EngineConfig
from dfllm.engine.dedupe import dedupe_key
from dfllm.engine.input_processor import EngineRequest, InputProcessor
from dfllm.engine.metrics import EngineMetrics
from dfllm.engine.output_processor import OutputProcessor
from dfllm.engine.runner import lora_manager, make_runner
from dfllm.engine.sampler import SampledStep, Sampler, StepTokens
from dfllm.engine.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from dfllm.engine.sequence import Request, Sequence
from dfllm.engine.step_inputs import StepOutput
from dfllm.errors import InvalidRequestError
from dfllm.lora.adapter import LoRAAdapterError
from dfllm.lora.manager import LoRAManager, LoRASlotError
from dfllm.lora.request import LoRARequest
from dfllm.models.registry import model_class
from dfllm.models.sliding_window import uniform_window
from dfllm.multimodal.processor import image_input_processor
from dfllm.outputs import RequestMetrics, RequestOutput
from dfllm.reasoning import make_reasoning_parser

logger = logging.getLogger("dfllm")


@dataclass
class InFlight:
    """A step launched whose tokens are not yet applied (asynchronous scheduling): its schedule,
    the sequences it samples (row order: each one's ``pending_row``), their sampling under way,
    and the scheduler's counters before it."""

    sched: SchedulerOutput
    seqs: list[Sequence]
    sample: SampledStep
    before: SchedulerStats


class LLMEngine:
    """One generative model on its device(s), with its KV cache, scheduler, sampler and
    input and output processors. Its public methods are what ``LLM`` and the dataframe
    accessors use; nothing outside the engine touches its parts."""

    def __init__(
        self,
        cfg: EngineConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_ids: set[int],
    ):
        """``tokenizer`` is None under vLLM's ``skip_tokenizer_init=True``: prompts are token
        ids, outputs have empty text (see :class:`~dfllm.engine.input_processor.InputProcessor`).
        ``cfg.reasoning_parser`` (a :mod:`dfllm.reasoning` parser's name) splits every output's text
        into reasoning and answer, and structured outputs then constrain the answer only, unless
        ``cfg.enable_in_reasoning`` (see :mod:`dfllm.engine.structured`)."""
        self.cfg = cfg
        self.eos_token_ids = eos_token_ids
        self.runner = make_runner(cfg)
        try:
            num_blocks = self.runner.plan_num_blocks()
            if num_blocks * cfg.block_size < cfg.max_model_len:
                raise ValueError(
                    f"the KV cache holds {num_blocks * cfg.block_size} tokens ({num_blocks} blocks), fewer than "
                    f"max_model_len={cfg.max_model_len}; raise kv_cache_memory_bytes or lower max_model_len"
                )
            self.runner.allocate_kv_cache(num_blocks)
        except BaseException:
            self.shutdown()  # a parallel engine's worker processes go with it
            raise
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, %s) on %s",
            num_blocks,
            cfg.block_size,
            num_blocks * cfg.block_size,
            num_blocks * self.runner.block_bytes / 2**20,
            str(cfg.kv_dtype).removeprefix("torch."),
            cfg.device,
        )
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(
            num_blocks,
            cfg.block_size,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            enable_prefix_caching=cfg.enable_prefix_caching,
            # on CPU, untouched cache memory costs nothing: reuse freed blocks first
            reuse_first=cfg.device.type == "cpu",
            policy=cfg.scheduling_policy,
            prefix_aware=cfg.prefix_aware_scheduling,
            # blocks out of every layer's window are freed (the config refuses a
            # window shorter than max_model_len for a model that does not honour it)
            sliding_window=uniform_window(cfg.model),
            max_loras=cfg.max_loras if cfg.enable_lora else None,
        )
        self.lora = lora_manager(cfg, self.runner)  # LoRA adapters (dfllm.lora)
        images = model_class(cfg.model).image_tokens(cfg.model, tokenizer)  # None: a text-only model
        self.input_processor = InputProcessor(
            tokenizer,
            cfg.model.vocab_size,
            cfg.max_model_len,
            eos_token_ids,
            max_logprobs=cfg.max_logprobs,
            structured_defaults=(cfg.disable_any_whitespace, cfg.disable_additional_properties),
            reasoning_parser=None
            if cfg.reasoning_parser is None
            else make_reasoning_parser(cfg.reasoning_parser, tokenizer),
            mm=image_input_processor(
                cfg.model_path,
                images,
                limit_per_prompt=cfg.limit_mm_per_prompt,
                processor_kwargs=cfg.mm_processor_kwargs,
            ),
        )
        self.enable_in_reasoning = cfg.enable_in_reasoning
        self.metrics = EngineMetrics(cfg.model_path.name)
        self.output_processor = OutputProcessor(
            tokenizer, eos_token_ids, cfg.max_model_len, self.metrics, cfg.logprobs_mode
        )
        self.sampler = Sampler(eos_token_ids, cfg.seed, cfg.logprobs_mode)
        self.requests: dict[str, Request] = {}  # queued or running, or finished by a step that raised
        self.deduplicate = cfg.deduplicate_requests
        self.leaders: dict[Hashable, str] = {}  # dedupe key -> the unfinished request computing it
        self.followers: dict[str, list[Request]] = {}  # leader id -> requests given a copy of its output
        self.following: dict[str, str] = {}  # follower id -> its leader's id
        self.failures: dict[Hashable, BaseException] = {}  # group -> why it failed on its own
        # error outputs of requests whose adapter broke after it was checked (add_request, or the
        # step that had to read it again into a slot), handed back by the next step (or this one)
        self.failed_at_add: list[RequestOutput] = []
        self._last_step_seqs: list[Sequence] = []  # the last step's sequences (last_step_groups)
        # asynchronous scheduling (module docstring): the step launched whose tokens are not yet applied
        self.async_scheduling = cfg.async_scheduling
        self.in_flight: InFlight | None = None
        self.sleep_level = 0  # 0 awake; 1 weights on host, KV freed; 2 weights and KV freed
        self.asleep: set[str] = set()  # which of "weights", "kv_cache" are released

    # ---- requests ----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        request: EngineRequest,
        *,
        group: Hashable = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a checked request under ``request_id`` (unique among unfinished requests);
        its ``params.n`` sequences are scheduled independently. Under the ``"priority"``
        scheduling policy a lower ``priority`` runs earlier (vLLM's convention); under
        ``"fcfs"`` it is ignored. ``lora_request`` runs it with that LoRA adapter
        (``enable_lora``; checked as :meth:`check_lora` does)."""
        if request_id in self.requests or request_id in self.following:
            raise ValueError(f"request id {request_id!r} is already queued or running")
        if lora_request is None:  # a dataframe row's adapter travels with its request
            lora_request = request.lora_request
        failed = None
        if lora_request is not None:
            try:
                self.check_lora(lora_request)
            except InvalidRequestError as exc:
                if not self._checked_before(lora_request):
                    raise
                failed = str(exc)  # checked before, unreadable now (re-read after eviction): this request's error
        req = Request(
            request_id,
            request.prompt,
            list(request.prompt_token_ids),
            request.params,
            RequestMetrics(time.time()),
            group,
            request.grammar,
            request.bad_words_ids,
            priority,
            reasoning=request.reasoning,
            lora_request=lora_request,
        )
        req.mm_inputs = request.mm_inputs
        if failed is not None:  # handed back by the next step, as a request that failed on its own
            self.failed_at_add.append(self.output_processor.error_output(req, failed))
            return
        key = dedupe_key(req) if self.deduplicate else None
        leader = self.leaders.get(key) if key is not None else None
        if leader is not None:
            self.followers.setdefault(leader, []).append(req)
            self.following[request_id] = leader
            self.metrics.deduplicated.inc()
            return
        if key is not None:
            self.leaders[key] = request_id
            req.dedupe_key = key
        self._queue(req)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Drop these requests (unknown or finished ids are ignored) and free their blocks."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if self.failed_at_add:
            self.failed_at_add = [o for o in self.failed_at_add if o.request_id not in ids]
        for rid in ids:
            if rid in self.following:  # a follower: just no copy for it
                leader = self.following.pop(rid)
                self.followers[leader] = [f for f in self.followers[leader] if f.request_id != rid]
                continue
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.abort(req.seqs)
                self._forget_leader(req)
                followers = self.followers.pop(rid, [])
                if followers:  # the first follower computes in its place, the others follow it
                    heir, *rest = followers
                    del self.following[heir.request_id]
                    heir.dedupe_key = req.dedupe_key
                    self.leaders[heir.dedupe_key] = heir.request_id
                    self._queue(heir)
                    if rest:
                        self.followers[heir.request_id] = rest
                        self.following.update((f.request_id, heir.request_id) for f in rest)

    # ---- LoRA adapters (dfllm.lora.manager) -------------------------------------------------
    def check_lora(self, lora_request: LoRARequest) -> None:
        """Raise :class:`~dfllm.errors.InvalidRequestError` unless ``lora_request`` can run: LoRA
        is enabled and its adapter reads and fits the model (read into the CPU cache now)."""
        if self.lora is None:
            raise InvalidRequestError(
                f"Got lora_request {lora_request!r} but LoRA is not enabled! (lora_request: "
                "start the engine with enable_lora=True)",
                parameter="lora_request",
            )
        try:
            self.lora.check(lora_request)
        except LoRAAdapterError as exc:
            raise InvalidRequestError(str(exc), parameter="lora_request") from None

    def _checked_before(self, lora_request: LoRARequest) -> bool:
        """Whether this adapter was checked (read and accepted) before: one that fails now
        (its files changed or went away since) fails its requests, not the caller's batch."""
        return self.lora is not None and self.lora.known.get(lora_request.lora_int_id) == lora_request

    def _lora_manager(self, method: str) -> LoRAManager:
        if self.lora is None:
            raise ValueError(f"{method}: LoRA is not enabled (LLM(enable_lora=True))")
        return self.lora

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter into the CPU cache ahead of its requests (vLLM's)."""
        return self._lora_manager("add_lora").add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter; ``ValueError`` while requests that use it are queued or running."""
        manager = self._lora_manager("remove_lora")
        if any(r.lora_request is not None and r.lora_request.lora_int_id == lora_id for r in self.requests.values()):
            raise ValueError(f"remove_lora: requests with lora_int_id={lora_id} are queued or running")
        return manager.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters in the CPU cache."""
        return self._lora_manager("list_loras").list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        """Never evict this adapter from the CPU cache (and from its slot last)."""
        return self._lora_manager("pin_lora").pin_lora(lora_id)

    def _activate_loras(self, seqs: list[Sequence]) -> None:
        """Put the adapters of a step's sequences into slots; each request learns its slot.
        Raises :class:`~dfllm.lora.manager.LoRASlotError` (no slot changed) if some cannot be read."""
        assert self.lora is not None
        wanted = {
            s.request.lora_request.lora_int_id: s.request.lora_request
            for s in seqs
            if s.request.lora_request is not None
        }
        slots = self.lora.activate(wanted)
        for s in seqs:
            lora = s.request.lora_request
            s.request.lora_slot = -1 if lora is None else slots[lora.lora_int_id]

    def _fail_adapters(self, errors: dict[int, LoRAAdapterError]) -> None:
        """End every unfinished request (and follower) of these adapters with its adapter's
        error, handed back by this step: their files broke after the requests were checked."""
        for req in list(self.requests.values()):
            lora = req.lora_request
            if lora is None or lora.lora_int_id not in errors:
                continue
            why = str(errors[lora.lora_int_id])
            self.scheduler.abort(req.seqs)
            del self.requests[req.request_id]
            self._forget_leader(req)
            self.failed_at_add.append(self.output_processor.error_output(req, why))
            for f in self.followers.pop(req.request_id, []):
                del self.following[f.request_id]
                self.failed_at_add.append(self.output_processor.error_output(f, why))
        logger.warning(
            "LoRA adapters could not be read into slots; their requests end with the error: %s",
            "; ".join(map(str, errors.values())),
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.failed_at_add)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests) + len(self.following) + len(self.failed_at_add)

    @property
    def last_step_groups(self) -> set[Hashable]:
        """The groups (``add_request``'s ``group``) of the last step's sequences, made when asked."""
        return {s.request.group for s in self._last_step_seqs}

    def take_failure(self, group: Hashable) -> BaseException | None:
        """The exception that made ``group`` fail on its own after a failed step (see the
        module docstring), forgotten once taken; None if it did not fail."""
        return self.failures.pop(group, None)

    def stats(self) -> SchedulerStats:
        """Block, queue, preemption and prefix-cache counters."""
        return self.scheduler.stats()

    # ---- the step -------------------------------------------------------------------------
    def step(self, rerun: Collection[Hashable] | None = None) -> list[RequestOutput]:
        """Run one scheduled step; the outputs of the requests it finished.

        If the step raises, the unfinished requests of the groups in ``rerun`` (default: all)
        are re-run from scratch one group at a time (module docstring) and this returns what
        that finished, error outputs of a group that failed on its own included; the other
        groups' requests are queued again from scratch for later steps. With nothing queued
        or running there is nothing to run: ``[]``, as vLLM's engine returns."""
        self.check_awake()
        early, self.failed_at_add = self.failed_at_add, []  # requests whose adapter broke (add_request)
        if not self.scheduler.has_unfinished():
            return early
        try:
            finished = self._step()
        except Exception as exc:
            outputs = self._recover(exc, rerun)
        else:
            outputs = self._outputs(finished)
        late, self.failed_at_add = self.failed_at_add, []  # requests whose adapter broke in a step
        return early + outputs + late

    def _outputs(self, finished: list[Request]) -> list[RequestOutput]:
        """The outputs of finished requests, each followed by its followers' copies."""
        outputs = []
        for req in finished:
            out = self.output_processor.make_output(req)
            outputs.append(out)
            for f in self.followers.pop(req.request_id, []):
                del self.following[f.request_id]
                f.metrics.first_token_time, f.metrics.finished_time = req.metrics.first_token_time, time.time()
                outputs.append(
                    replace(
                        out,
                        request_id=f.request_id,
                        prompt=f.prompt,
                        prompt_token_ids=f.prompt_token_ids,
                        num_cached_tokens=len(f.prompt_token_ids) - 1,
                        metrics=f.metrics,
                        outputs=[replace(c, token_ids=list(c.token_ids)) for c in out.outputs],
                    )
                )
                self.metrics.observe_finish(
                    f.metrics.finished_time - f.metrics.arrival_time,
                    len(f.prompt_token_ids),
                    sum(len(c.token_ids) for c in out.outputs),
                )
        return outputs

    def _step(self) -> list[Request]:
        if self.async_scheduling:
            return self._step_async()
        before = self.scheduler.stats()
        sched = self._schedule()
        if not sched:  # every request left used an adapter that broke (their errors are out)
            return []
        out = self._launch(sched)
        self._computed(sched, out)
        sampled = self._sample(out.logits, out.sample_seqs)
        return self._end(out.sample_seqs, sampled, sched, before)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> StepTokens:
        """A token per row, or what is wrong with a row whose logits cannot be sampled."""
        return self.sampler.launch(logits, seqs).tokens() if seqs else StepTokens([])

    def _step_async(self) -> list[Request]:
        """One step with asynchronous scheduling (module docstring): schedule and launch this
        step while the tokens of the step in flight are still on their way, then finish that
        step (on a GPU, while this one's forward runs), then sample this one, without waiting."""
        prev = self.in_flight
        before = self.scheduler.stats()
        sched = self._schedule(allow_empty=prev is not None)
        finished: list[Request] = []
        if not sched:  # only the step in flight's tokens can free room, or end what is left
            if prev is not None:
                finished = self._finish_in_flight()
            if not self.scheduler.has_unfinished():
                return finished
            prev, before = None, self.scheduler.stats()
            sched = self._schedule()
            if not sched:  # every request left used an adapter that broke
                return finished
        sched.prev_token_ids = None if prev is None else prev.sample.token_ids
        out = self._launch(sched)
        if prev is not None:
            finished = self._finish_in_flight()
        self._computed(sched, out)  # after: the blocks it fills hash tokens now known
        logits, seqs = out.logits, out.sample_seqs
        live = [i for i, s in enumerate(seqs) if not s.is_finished]  # not ended by the last step's tokens
        if len(live) < len(seqs):
            logits, seqs = logits[torch.tensor(live, dtype=torch.long).to(logits.device)], [seqs[i] for i in live]
        if not seqs:
            self._observe(sched, before)
            return finished
        sample = self.sampler.launch(logits, seqs)
        for row, seq in enumerate(seqs):
            seq.pending_row = row
        self.in_flight = InFlight(sched, seqs, sample, before)
        return finished

    def _finish_in_flight(self) -> list[Request]:
        """Wait for the tokens of the step in flight and apply them (as a synchronous step's)."""
        step, self.in_flight = self.in_flight, None
        assert step is not None
        sampled = step.sample.tokens()
        for seq in step.seqs:
            seq.pending_row = -1
        kept = [i for i, seq in enumerate(step.seqs) if not seq.is_finished]  # not aborted meanwhile
        if len(kept) < len(step.seqs):
            return self._end([step.seqs[i] for i in kept], sampled.select(kept), step.sched, step.before)
        return self._end(step.seqs, sampled, step.sched, step.before)

    def _schedule(self, allow_empty: bool = False) -> SchedulerOutput:
        """The scheduler's next step (``allow_empty`` as :meth:`Scheduler.schedule`), its adapters
        in their slots. An adapter that cannot be read into a slot now (its files broke after
        its requests were checked, and the CPU cache no longer held it) ends its requests with
        its error (:meth:`_fail_adapters`); the step is then scheduled again without them, so the
        other requests run as if it had never been asked for. Empty when none is left."""
        preempted = 0
        while True:
            sched = self.scheduler.schedule(allow_empty=True) if allow_empty else self.scheduler.schedule()
            sched.num_preempted += preempted
            if self.lora is None or not sched:
                return sched
            try:
                self._activate_loras(sched.seqs)
                return sched
            except LoRASlotError as exc:
                self._fail_adapters(exc.errors)
            # nothing of this schedule ran: its blocks stay with the sequences that keep them
            preempted = sched.num_preempted
            if not self.scheduler.has_unfinished():
                return SchedulerOutput(num_preempted=preempted)

    def _launch(self, sched: SchedulerOutput) -> StepOutput:
        """Run the model on a scheduled step (its adapters already in their slots: :meth:`_schedule`)."""
        self._last_step_seqs = sched.seqs
        if torch.autograd._profiler_enabled():  # a profiler records: the step as one named range
            with torch.profiler.record_function("dfllm.step"):  # (~0.1 ms cold: not otherwise)
                return self.runner.run(sched)
        return self.runner.run(sched)

    def _computed(self, sched: SchedulerOutput, out: StepOutput) -> None:
        """A step's tokens are in the KV cache (full blocks join the prefix cache); its prompt
        log-probabilities are recorded."""
        self.scheduler.update_from_step(sched)
        for span, logits in out.prompt_logits:
            self.output_processor.add_prompt_logprobs(span.seq, span.start, logits)

    def _end(
        self, seqs: list[Sequence], sampled: StepTokens, sched: SchedulerOutput, before: SchedulerStats
    ) -> list[Request]:
        """Apply a step's sampled tokens; the requests they finished."""
        now = time.time()
        ended = self.output_processor.process(seqs, sampled, now)
        for seq in ended:
            self.scheduler.finish(seq)
        finished = self._finished(ended, now)
        self._observe(sched, before)
        return finished

    def _finished(self, ended: list[Sequence], now: float) -> list[Request]:
        """The requests whose last sequence just ended, each once, timed and forgotten."""
        finished = []
        for seq in ended:
            req = seq.request
            if req.is_finished and req.request_id in self.requests:
                del self.requests[req.request_id]
                self._forget_leader(req)
                req.metrics.finished_time = now
                self.metrics.observe_finish(
                    now - req.metrics.arrival_time,
                    len(req.prompt_token_ids),
                    sum(s.num_output_tokens for s in req.seqs),
                )
                finished.append(req)
        return finished

    def _observe(self, sched: SchedulerOutput, before: SchedulerStats) -> None:
        now = self.scheduler.stats()
        self.metrics.observe_step(
            now.num_running,
            now.num_waiting,
            now.kv_cache_usage,
            sched.num_preempted,
            now.prefix_cache_queries - before.prefix_cache_queries,
            now.prefix_cache_hits - before.prefix_cache_hits,
        )

    # ---- recovery after a step that raised -------------------------------------------------
    def _recover(self, exc: Exception, rerun: Collection[Hashable] | None) -> list[RequestOutput]:
        dropped = self._drop_all()
        logger.warning(
            "an engine step failed (%r): re-running %d unfinished requests, one group at a time", exc, len(dropped)
        )
        groups: dict[Hashable, list[Request]] = {}
        later: list[Request] = []
        for req in dropped:
            if rerun is None or req.group in rerun:
                groups.setdefault(("request", req.request_id) if req.group is None else req.group, []).append(req)
            else:
                later.append(req)
        outputs: list[RequestOutput] = []
        for group, requests in groups.items():
            try:
                self._run_alone(requests, outputs)
            except Exception as failure:
                failed = self._drop_all()
                if requests[0].group is not None:
                    self.failures[group] = failure
                outputs += [
                    self.output_processor.error_output(
                        req, f"the engine failed while serving request {req.request_id}: {failure!r}"
                    )
                    for req in failed
                ]
        for req in later:
            self._requeue(req)
        return outputs

    def _run_alone(self, requests: list[Request], outputs: list[RequestOutput]) -> None:
        """Queue ``requests`` again from scratch in the (emptied) engine and step until they
        are done, adding their outputs to ``outputs`` as they finish. A step that raises
        propagates (the outputs of requests finished before it are kept)."""
        for req in requests:
            self._requeue(req)
        while self.scheduler.has_unfinished():
            outputs += self._outputs(self._step())

    def _drop_all(self) -> list[Request]:
        """Every request not yet returned (queued, running, or finished by a step that raised),
        dropped with its blocks freed, followers as requests of their own; in arrival order."""
        self.scheduler.abort_all()
        self.in_flight = None  # its sequences are dropped too
        dropped = list(self.requests.values()) + [f for fs in self.followers.values() for f in fs]
        dropped.sort(key=lambda r: r.metrics.arrival_time)
        self.requests.clear()
        self.leaders.clear()
        self.followers.clear()
        self.following.clear()
        return dropped

    def _forget_leader(self, req: Request) -> None:
        if req.dedupe_key is not None and self.leaders.get(req.dedupe_key) == req.request_id:
            del self.leaders[req.dedupe_key]

    def _requeue(self, req: Request) -> None:
        """``req`` queued again from scratch, with fresh sequences (and fresh seeded generators,
        so a greedy or seeded request gives the output it would have had)."""
        self._queue(
            Request(
                req.request_id,
                req.prompt,
                req.prompt_token_ids,
                req.params,
                RequestMetrics(req.metrics.arrival_time),
                req.group,
                req.grammar,
                req.bad_words_ids,
                req.priority,
                reasoning=req.reasoning,
                lora_request=req.lora_request,
                mm_inputs=req.mm_inputs,
            )
        )

    def _queue(self, req: Request) -> None:
        params = req.params
        for i in range(params.n):
            # on the device the sampler draws on (where the logits are: rank 0's)
            gen = None if params.seed is None else torch.Generator(self.cfg.device).manual_seed(params.seed + i)
            seq = Sequence(req, i, list(req.prompt_token_ids), len(req.prompt_token_ids), gen)
            seq.logprobs = [] if params.logprobs is not None else None
            if params.prompt_logprobs is not None and i == 0:
                seq.prompt_logprobs = [None]
            if req.grammar is not None:  # engaged after the reasoning, unless it is constrained too
                seq.grammar = req.grammar.matcher(
                    None if self.enable_in_reasoning else req.reasoning, req.prompt_token_ids
                )
            self.output_processor.start(seq)
            req.seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[req.request_id] = req

    # ---- sleep mode and caches -------------------------------------------------------
    def check_awake(self) -> None:
        if self.asleep:
            raise RuntimeError(
                f"the engine is asleep (level {self.sleep_level}, released: "
                f"{', '.join(sorted(self.asleep))}); call wake_up() first"
            )

    def sleep(self, level: int) -> None:
        """Release the KV cache, and the weights (to host memory at level 1, entirely at 2)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.has_unfinished_requests():
            raise RuntimeError("sleep: requests are still queued or running; wait for them first")
        self.scheduler.reset_prefix_cache()
        self.runner.free_kv_cache()
        if "weights" not in self.asleep and level == 1:
            self.runner.offload_weights()
        elif "weights" not in self.asleep:
            self.runner.drop_weights()
        self.sleep_level = max(self.sleep_level, level)
        self.asleep |= {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Restore the released ``tags`` ("weights", "kv_cache"; None means both); whether the
        engine is now fully awake (vLLM's answer). vLLM's "scheduling" tag (resuming from its
        level-0 sleep, which pauses scheduling) is accepted: dfllm never pauses scheduling."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache", "scheduling"}
        if unknown:
            raise ValueError(
                f"wake_up tags must be among 'weights', 'kv_cache' and 'scheduling', got {sorted(unknown)}"
            )
        if "weights" in tags and "weights" in self.asleep:
            if self.sleep_level == 1:
                self.runner.onload_weights()
            else:
                self.runner.reload_weights()
            self.asleep.discard("weights")
            if self.lora is not None:  # the rebuilt model's adapter slots are empty
                self.lora.reset_slots()
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            self.runner.allocate_kv_cache(self.num_blocks)
            self.scheduler.reset_cache()
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.sleep_level = 0
        return not self.asleep

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel engine (nothing to do on one rank)."""
        self.runner.shutdown()

    def reset_mm_cache(self) -> None:
        """Forget the processed images (input side) and image embeddings (runner) cached so far."""
        if self.input_processor.mm is not None:
            self.input_processor.mm.reset()
        runner = getattr(self.runner, "driver", self.runner)  # a parallel engine's rank 0 encodes the images
        cache = getattr(runner, "encoder_cache", None)
        if cache is not None:
            cache.reset()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; refuse (False) while requests are queued or running."""
        if self.has_unfinished_requests():
            return False
        self.scheduler.reset_prefix_cache()
        return True
