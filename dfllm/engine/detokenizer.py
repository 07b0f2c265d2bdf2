"""Incremental detokenization.

Each new token is decoded in a small window of preceding tokens (starting inside the
prompt), so multi-token characters and leading-space rules come out as a full decode would
give them; text is only emitted once it no longer ends in an incomplete character. What the new text
means (a stop string) is the output processor's to decide.
"""

from __future__ import annotations

from typing import cast

from transformers import PreTrainedTokenizerBase

from dfllm.engine.sequence import Sequence

_WINDOW = 5


class Detokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None):
        """``tokenizer`` is None without one (``skip_tokenizer_init``): then no request
        detokenizes, and :meth:`step` is never called."""
        self.tokenizer = tokenizer

    def start(self, seq: Sequence) -> None:
        """Point the decode window at the end of the prompt."""
        seq.read_offset = seq.num_prompt_tokens
        seq.prefix_offset = max(seq.num_prompt_tokens - _WINDOW, 0)

    def step(self, seq: Sequence) -> str:
        """Append the text of the newest token to ``seq.text``; return what was added."""
        assert self.tokenizer is not None  # requests of an engine without one have detokenize=False
        skip = seq.params.skip_special_tokens
        ids = seq.token_ids
        prefix = _decode(self.tokenizer, ids[seq.prefix_offset : seq.read_offset], skip)
        full = _decode(self.tokenizer, ids[seq.prefix_offset :], skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        seq.text += delta
        return delta


def _decode(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special_tokens: bool) -> str:
    """The text of one sequence of ids (transformers' ``decode`` is annotated ``str | list[str]``
    for batches too)."""
    return cast(str, tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
