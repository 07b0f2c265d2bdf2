"""Incremental detokenization and stop-string detection.

Each new token is decoded in a small window of preceding tokens (starting inside the
prompt), so multi-token characters and leading-space rules come out as a full decode would
give them; text is only emitted once it no longer ends in an incomplete character. Stop
strings are searched in the region the new text could complete, so a stop string split
across tokens is found and cut exactly.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from dfllm.engine.sequence import Sequence

_WINDOW = 5


class Detokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer

    def start(self, seq: Sequence) -> None:
        """Point the decode window at the end of the prompt."""
        seq.read_offset = seq.num_prompt_tokens
        seq.prefix_offset = max(seq.num_prompt_tokens - _WINDOW, 0)

    def step(self, seq: Sequence) -> str:
        """Append the text of the newest token to ``seq.text``; return what was added."""
        skip = seq.params.skip_special_tokens
        ids = seq.token_ids
        prefix = self.tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        seq.text += delta
        return delta

    @staticmethod
    def find_stop(seq: Sequence, new_len: int) -> str | None:
        """Cut ``seq.text`` at the first stop string the last ``new_len`` chars completed."""
        params = seq.params
        best: tuple[int, str] | None = None
        for stop in params.stop_strings:
            start = max(0, len(seq.text) - new_len - len(stop) + 1)
            idx = seq.text.find(stop, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        seq.text = seq.text[: idx + len(stop)] if params.include_stop_str_in_output else seq.text[:idx]
        return stop
