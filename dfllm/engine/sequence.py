"""A sequence: one completion being generated, and the request that owns it."""

from __future__ import annotations

import io
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from dfllm.outputs import Logprob, RequestMetrics
from dfllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dfllm.engine.structured import Grammar, SequenceGrammar
    from dfllm.lora.request import LoRARequest
    from dfllm.multimodal.inputs import MultiModalInputs
    from dfllm.reasoning import ReasoningParser


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_seq_counter = itertools.count()

# the member itself: an Enum member looked up on its class costs ~70 ns, and is_finished is asked
# of every running sequence several times a step
_FINISHED = SequenceStatus.FINISHED


# Sequence, Request (and RequestMetrics) have __slots__: every step reads a few attributes of each
# running sequence in several passes, right after the forward has pushed them out of the CPU's
# caches; a slotted object keeps them in its own memory, without an instance dict and its values
# array to fetch too (a 256-sequence pass ~20 µs faster cold, on a 2-core EPYC)
@dataclass(eq=False, slots=True)
class Sequence:
    """Token ids of one completion plus everything the scheduler tracks about it.

    ``num_computed_tokens`` counts the tokens whose keys and values are in the KV cache;
    the scheduler feeds ``token_ids[num_computed_tokens:]`` (or a chunk of it) next.
    """

    request: Request
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    block_table: list[int] = field(default_factory=list)
    table_row: int = -1  # its row in the block manager's BlockTableArray while it holds blocks (-1: none)
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix cache
    block_hashes: list[int] = field(default_factory=list)  # hash chain of its full blocks (prefix-aware admission)
    waiting_since: int = 0  # the scheduler's admission count at which first come, first served would admit it
    # asynchronous scheduling (dfllm.engine.llm_engine): the row of the step in flight whose sampled
    # token, still on the device, is this sequence's next one (not yet in token_ids); -1: none
    pending_row: int = -1
    # Detokenizer state: the text so far (``text``), held in a StringIO that appends in place (a
    # str grown by += is copied whole at every token: at 256 sequences of 40,000 characters
    # ~0.5 ms a step), and the window offsets into token_ids.
    text_buffer: io.StringIO = field(default_factory=io.StringIO)
    prefix_offset: int = 0
    stop_offset: int = 0  # stop strings are looked for from here (after the first min_tokens tokens' text)
    read_offset: int = 0
    utf8_tail: bytes = b""  # a byte-level vocabulary's bytes read but not yet text (an unfinished character)
    utf8_lstrip: bool = False  # its first text loses a leading space (SentencePiece's Strip, a prompt without bytes)
    text_marks: list[int] = field(default_factory=list)  # len(text) before each output token (stop groups only)
    logprobs: list[dict[int, Logprob]] | None = None
    # prompt_logprobs: None first (the first prompt token has no context), then one dict per
    # prompt token computed so far; only sequence 0 of a request that asks keeps it
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why it ended with finish_reason "error" (non-finite logits)
    grammar: SequenceGrammar | None = None  # structured outputs: this sequence's matcher

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    # ---- the text: written only through these (the buffer's position stays at its end) ----
    @property
    def text(self) -> str:
        """The completion's text so far."""
        return self.text_buffer.getvalue()

    @property
    def text_len(self) -> int:
        """``len(self.text)``, without making the text."""
        return self.text_buffer.tell()

    def append_text(self, delta: str) -> None:
        """Append ``delta`` to the text."""
        self.text_buffer.write(delta)

    def text_from(self, start: int) -> str:
        """``self.text[start:]`` (``start`` >= 0), reading only that part."""
        buffer = self.text_buffer
        if start >= buffer.tell():
            return ""
        buffer.seek(start)
        return buffer.read()  # back at the end

    def cut_text(self, length: int) -> None:
        """Keep the first ``length`` characters of the text (``length`` at most its length)."""
        buffer = self.text_buffer
        buffer.seek(length)
        buffer.truncate()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Its tokens, the one sampled by the step in flight (not yet in ``token_ids``) included."""
        return len(self.token_ids) + (self.pending_row >= 0)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while some prompt token's log-probability is still to be computed."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens


@dataclass(eq=False, slots=True)
class Request:
    """One prompt with its sampling parameters and its ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    group: Hashable = None  # requests re-run together after a failed step (one call, one partition)
    grammar: Grammar | None = None  # structured outputs: the compiled constraint of its sequences
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # token sequences its sequences may not complete
    priority: int = 0  # under the "priority" policy, lower values are scheduled first
    dedupe_key: Hashable = None  # set on a request identical deterministic ones may follow
    reasoning: ReasoningParser | None = None  # splits its outputs' text (and gates its grammar): dfllm.reasoning
    seqs: list[Sequence] = field(default_factory=list)
    # LoRA (dfllm.lora): the request's adapter (None: the base model) and the slot it runs in this step
    lora_request: LoRARequest | None = None
    lora_slot: int = -1
    # images (dfllm.multimodal): their pixels and placeholder positions in the prompt (None: text only)
    mm_inputs: MultiModalInputs | None = None

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def num_cached_tokens(self) -> int:
        return max(0, self.seqs[0].num_cached_tokens) if self.seqs else 0
