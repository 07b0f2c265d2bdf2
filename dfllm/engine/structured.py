"""Structured outputs in the engine: compiled grammars, one matcher per sequence, token masks.

Grammars come from xgrammar (vLLM's default backend). Each engine builds xgrammar's view of
its tokenizer once, on the first constrained request, and compiles each distinct constraint
once (keyed by its canonical form); every constrained sequence gets its own
``GrammarMatcher`` over the shared compiled grammar.

The matcher advances only on tokens appended to its sequence (``accept``), never on prompt
chunks: a sequence still prefilling is not sampled. A sequence preempted by recomputation
keeps its generated tokens and its matcher, which is therefore already where it should be;
the recompute feeds the model, not the matcher.

Each step, ``apply_masks`` fills one bitmask row per constrained sequence of the batch (on
the host, where the matchers are), moves it to the logits' device, and sets every disallowed
logit to ``-inf`` there (xgrammar's CPU kernel, or its Triton kernel on CUDA); unconstrained
rows are not touched.

With a reasoning parser (``LLM(reasoning_parser=...)``, :mod:`dfllm.reasoning`) the grammar
constrains the answer, not the reasoning, as vLLM's structured outputs do: a sequence's
grammar is *engaged* from the start only if its prompt already ends the reasoning (the
parser's ``is_reasoning_end`` on the prompt: Qwen3's template with ``enable_thinking=False``
closes ``</think>`` there); otherwise its steps are unconstrained and its matcher idle until
the token that ends the reasoning (``</think>``), which the matcher does not see either; the
grammar engages from the next token on. vLLM's ``enable_in_reasoning=True`` (in
``structured_outputs_config``) passes no parser here: the grammar then constrains every token.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from dfllm.reasoning import ReasoningParser
from dfllm.structured_outputs import StructuredOutputsParams, structural_tag_grammar

_CACHE_SIZE = 256
#: Why a constrained output cannot go on where its grammar allows no token at all (the engine's
#: error for such a row, and beam search's for a prompt none of whose beams can go on).
GRAMMAR_DEAD_END = (
    "the grammar allows no token there (its language is empty, or needs characters this model's tokenizer cannot spell)"
)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary, caching compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        import xgrammar as xgr

        self._xgr = xgr
        self.stop_token_ids = sorted(stop_token_ids)
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.cache: OrderedDict[tuple[str, str, bool], object] = OrderedDict()
        self.lock = threading.Lock()
        self.num_compiled = 0

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params``, compiled on first use (LRU of 256); ``ValueError``
        with vLLM's message for a grammar that does not parse."""
        key = params.key
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        kind = params.kind
        if kind == "grammar":  # checked here, per request, as vLLM does (the other kinds when built)
            params.check()
        if kind in ("json", "json_object"):
            compiled = self.compiler.compile_json_schema(key[1], any_whitespace=params.any_whitespace)
        elif kind == "structural_tag":
            assert params.structural_tag is not None
            compiled = structural_tag_grammar(params.structural_tag, self.compiler)
        elif kind == "regex":
            assert params.regex is not None  # kind names the one field that is set
            compiled = self.compiler.compile_regex(params.regex)
        else:
            grammar = params.grammar if kind == "grammar" else params.to_ebnf()
            assert grammar is not None  # a grammar, or a choice as EBNF
            compiled = self.compiler.compile_grammar(grammar)
        with self.lock:
            self.cache[key] = compiled
            self.num_compiled += 1
            while len(self.cache) > _CACHE_SIZE:
                self.cache.popitem(last=False)
        return compiled

    def prepare(self, params: StructuredOutputsParams) -> Grammar:
        """``params`` compiled (raising now on a bad constraint), ready to start matchers."""
        return Grammar(self._xgr, self.compile(params), self.stop_token_ids, self.vocab_size)


class Grammar:
    """A compiled constraint: each sequence under it gets its own matcher (:meth:`matcher`)."""

    def __init__(self, xgr, compiled, stop_token_ids: list[int], vocab_size: int):
        self._xgr, self.compiled = xgr, compiled
        self.stop_token_ids, self.vocab_size = stop_token_ids, vocab_size

    def matcher(
        self, reasoning: ReasoningParser | None = None, prompt_token_ids: list[int] | None = None
    ) -> SequenceGrammar:
        """A new sequence's matcher; with ``reasoning``, engaged once the reasoning ends (at
        once if ``prompt_token_ids`` end it)."""
        return SequenceGrammar(
            self._xgr.GrammarMatcher(self.compiled, override_stop_tokens=self.stop_token_ids),
            self.vocab_size,
            reasoning,
            prompt_token_ids,
        )

    def allowed_after(self, token_ids: list[int]) -> list[int] | None:
        """The tokens this constraint allows after ``token_ids`` (a continuation, from its first
        generated token), for beam search (:mod:`dfllm.beam_search`): None when the grammar
        rejects them or has terminated (nothing may follow); ``[]`` where it has not
        terminated but allows no token (:data:`GRAMMAR_DEAD_END`)."""
        matcher = self._xgr.GrammarMatcher(self.compiled, override_stop_tokens=self.stop_token_ids)
        for token in token_ids:
            if not matcher.accept_token(token):
                return None
        if matcher.is_terminated():
            return None
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        ids = torch.arange(self.vocab_size)
        allowed = (bitmask[0][ids >> 5] >> (ids & 31)) & 1
        return ids[allowed.bool()].tolist()


class SequenceGrammar:
    """The grammar state of one sequence: which tokens may come next, and whether it is done.

    ``terminated``: the grammar is complete and a stop token was accepted (the sequence
    ends with ``finish_reason="stop"``). ``completed``: the text so far is a complete match
    (true once terminated; may be true earlier, e.g. a regex that allows more).
    ``engaged``: the grammar constrains the next token (always, without a reasoning parser;
    with one, once the reasoning has ended: see the module docstring).
    """

    def __init__(
        self,
        matcher,
        vocab_size: int,
        reasoning: ReasoningParser | None = None,
        prompt_token_ids: list[int] | None = None,
    ):
        self.matcher = matcher
        self.vocab_size = vocab_size  # logits past it (a padded head) are never allowed
        self.rejected: int | None = None
        self.reasoning = reasoning
        self.engaged = reasoning is None or reasoning.is_reasoning_end(prompt_token_ids or [])

    def accept(self, token_id: int, token_ids: list[int] | None = None) -> bool:
        """Advance on ``token_id``, the newest of the sequence's ``token_ids`` (prompt
        included); False if the grammar rejects it. Before the reasoning ends the matcher
        stays where it is: the token that ends it engages the grammar for the next one."""
        if not self.engaged:
            assert self.reasoning is not None  # engaged from the start without a parser
            self.engaged = self.reasoning.is_reasoning_end_streaming(
                token_ids if token_ids is not None else [token_id], [token_id]
            )
            return True
        ok = self.matcher.accept_token(token_id)
        if not ok:
            self.rejected = token_id
        return ok

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    @property
    def completed(self) -> bool:
        return self.matcher.is_terminated() or self.matcher.is_completed()


_bitmasks: dict[int, torch.Tensor] = {}  # vocabulary size -> the largest bitmask used so far
_bitmask_lock = threading.Lock()


def apply_masks(logits: torch.Tensor, grammars: list[SequenceGrammar | None]) -> None:
    """Set to ``-inf``, in place, every logit the row's grammar forbids (None rows, and rows
    whose grammar is not engaged yet: untouched)."""
    active = [(i, g) for i, g in enumerate(grammars) if g is not None and g.engaged and not g.terminated]
    rows = [i for i, _ in active]
    if not rows:
        return
    import xgrammar as xgr

    batch, vocab = logits.shape
    with _bitmask_lock:
        bitmask = _bitmasks.pop(vocab, None)
    if bitmask is None or bitmask.shape[0] < batch:
        bitmask = xgr.allocate_token_bitmask(batch, vocab)
    for i, g in active:
        g.matcher.fill_next_token_bitmask(bitmask, i)
    mask = bitmask[:batch] if logits.device.type == "cpu" else bitmask[:batch].to(logits.device, non_blocking=True)
    known = min(vocab, min(g.vocab_size for _, g in active))
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=known, indices=rows)
    if known < vocab:  # an index moved without waiting (a list index would wait for the device)
        logits[torch.tensor(rows).to(logits.device, non_blocking=True), known:] = float("-inf")
    with _bitmask_lock:
        _bitmasks[vocab] = bitmask
