"""Incremental detokenization.

Each new token is decoded in a small window of preceding tokens (starting inside the
prompt), so multi-token characters and leading-space rules come out as a full decode would
give them; text is only emitted once it no longer ends in an incomplete character. What the new text
means (a stop string) is the output processor's to decide.

A step's sequences are decoded together (:meth:`Detokenizer.prepare`): their windows go
straight to the Rust tokenizer's ``decode`` instead of through ``tokenizer.decode``
(transformers' Python around each decode cost ~9 µs: at 256 sequences, ~4.6 ms of host time
per step), one window after another: ``decode_batch`` hands a batch to the tokenizer's thread
pool, whose threads wake on cores that the model's threads hold, and cost 2.2 ms a step at 64
sequences on a 2-core CPU where the same windows decoded one by one took 0.19 ms (measured
alternately in the engine). Each window is decoded exactly as
``tokenizer.decode`` decodes it: by the Rust tokenizer itself where transformers' ``decode``
is only that (a fast tokenizer that does not clean up spaces), else by ``tokenizer.decode``.

A byte-level BPE tokenizer, or SentencePiece's with byte fallback (Llama 2, Mistral, Gemma),
whose ``decode`` is the Rust one decodes no windows: its tokens'
bytes (:mod:`dfllm.engine.token_bytes`) are appended to the bytes not yet read as text
(``Sequence.utf8_tail``, at most the first three bytes of a character) and the complete
characters among them become the new text, an invalid byte U+FFFD, as the tokenizer's own
decoder reads them. The text after every step is then exactly ``tokenizer.decode`` of the
output ids less an unfinished last character (which the window too holds back); where the
output's bytes are not valid UTF-8 the window's text can differ from that decode (a
character cut between the window's two decodes), this one cannot. About 0.5 µs a sequence
instead of two 2 µs decodes. A SentencePiece decoder that drops one leading space of a text
(Llama 2's, Mistral's) drops it from the output's first text where the prompt has no bytes
(``Sequence.utf8_lstrip``): the text is ``tokenizer.decode`` of the prompt and the output less
that of the prompt (the windows strip it too where the prompt's last five tokens have none).
"""

from __future__ import annotations

import codecs
from typing import cast

from transformers import PreTrainedTokenizerBase

from dfllm.engine.sequence import Sequence
from dfllm.engine.token_bytes import lstrip_space, token_bytes

_WINDOW = 5

# transformers' fast tokenizers whose decode is the Rust tokenizer's decode, then an optional clean-up
_RUST_DECODES = {"TokenizersBackend._decode", "PreTrainedTokenizerFast._decode"}

# what step() does to a sequence: (delta, prefix_offset, read_offset) after it, or with a byte table
# (delta, utf8_tail, read_offset, utf8_lstrip); None: nothing yet
Step = tuple[str, int, int] | tuple[str, bytes, int, bool] | None

_utf8_decode = codecs.utf_8_decode


class Detokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None):
        """``tokenizer`` is None without one (``skip_tokenizer_init``): then no request
        detokenizes, and :meth:`step` is never called."""
        self.tokenizer = tokenizer
        rust = getattr(tokenizer, "_tokenizer", None)
        plain = (
            tokenizer is not None
            and getattr(type(tokenizer)._decode, "__qualname__", "") in _RUST_DECODES
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
            and hasattr(rust, "decode")
        )
        self._rust = rust if plain else None  # decodes windows as tokenizer.decode does
        self._bytes = token_bytes(rust) if plain else None  # a byte-level vocabulary's bytes: no windows

    def start(self, seq: Sequence) -> None:
        """Point the decode window at the end of the prompt (no bytes read yet; with a decoder
        that strips a text's leading space, whether the output's first text loses it)."""
        seq.read_offset = seq.num_prompt_tokens
        seq.prefix_offset = max(seq.num_prompt_tokens - _WINDOW, 0)
        seq.utf8_tail = b""
        vocab = self._bytes
        if vocab is not None and vocab.strips_space:
            pieces = vocab.skip if seq.request.params.skip_special_tokens else vocab.keep
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            seq.utf8_lstrip = not any(pieces[t] for t in reversed(prompt))  # the last token's, mostly
        else:
            seq.utf8_lstrip = False

    def prepare(self, seqs: list[Sequence]) -> list[Step]:
        """What :meth:`step` would do to each sequence now (its newest token appended), all
        decoded together; nothing is changed. :meth:`apply` does it."""
        if self._bytes is not None:
            return [self._read_bytes(seq) for seq in seqs]
        windows: dict[bool, list[int]] = {}  # skip_special_tokens -> positions in seqs
        for i, seq in enumerate(seqs):
            windows.setdefault(seq.params.skip_special_tokens, []).append(i)
        out: list[Step] = [None] * len(seqs)
        for skip, members in windows.items():
            group = [seqs[i] for i in members]
            prefixes = self._decode_all([s.token_ids[s.prefix_offset : s.read_offset] for s in group], skip)
            fulls = self._decode_all([s.token_ids[s.prefix_offset :] for s in group], skip)
            for i, seq, prefix, full in zip(members, group, prefixes, fulls):
                out[i] = _step(seq, prefix, full)
        return out

    def apply(self, seq: Sequence, ready: Step) -> str:
        """Do what :meth:`prepare` found for ``seq``: append its new text; return it."""
        if ready is None:
            return ""
        if len(ready) == 4:
            delta, seq.utf8_tail, seq.read_offset, seq.utf8_lstrip = ready
        else:
            delta, seq.prefix_offset, seq.read_offset = ready
        if delta:
            seq.append_text(delta)
        return delta

    def step(self, seq: Sequence) -> str:
        """Append the text of the newest token to ``seq.text``; return what was added."""
        assert self.tokenizer is not None  # requests of an engine without one have detokenize=False
        if self._bytes is not None:
            return self.apply(seq, self._read_bytes(seq))
        return self.apply(seq, self.prepare([seq])[0])

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each id's text on its own, as ``tokenizer.decode([id])`` gives it (special tokens
        kept, as ``tokenizer.batch_decode``): a log-probability's ``decoded_token``. With the
        vocabulary's bytes, those bytes read as UTF-8 (each id checked against that decode
        when first read), not a decode per id (~3 µs each: at 256 sequences with
        ``logprobs=5``, ~5 ms a step)."""
        if self._bytes is None:
            assert self.tokenizer is not None
            return self.tokenizer.batch_decode([[t] for t in ids])
        keep = self._bytes.keep
        if self._bytes.strips_space:
            return [lstrip_space(keep[t].decode("utf-8", "replace")) for t in ids]
        return [keep[t].decode("utf-8", "replace") for t in ids]

    @property
    def batches(self) -> bool:
        """Whether :meth:`prepare` is worth calling for a step's sequences together (it decodes
        their windows in one pass); with the vocabulary's bytes each :meth:`step` costs as much."""
        return self._bytes is None

    def _read_bytes(self, seq: Sequence) -> Step:
        """:meth:`prepare`'s step with the vocabulary's bytes: the sequence's unread tokens'
        bytes after its tail, read as UTF-8 up to an unfinished last character (the new tail);
        the first text less a leading space where ``seq.utf8_lstrip``."""
        assert self._bytes is not None
        pieces = self._bytes.skip if seq.request.params.skip_special_tokens else self._bytes.keep
        ids, read = seq.token_ids, seq.read_offset
        if read == len(ids) - 1:  # one new token: the usual step
            data = seq.utf8_tail + pieces[ids[read]]
        else:
            data = seq.utf8_tail + b"".join([pieces[t] for t in ids[read:]])
        text, used = _utf8_decode(data, "replace", False)
        if seq.utf8_lstrip and text:  # the output's first text, after a prompt without bytes
            return lstrip_space(text), data[used:], len(ids), False
        return text, data[used:], len(ids), seq.utf8_lstrip

    def _decode_all(self, windows: list[list[int]], skip_special_tokens: bool) -> list[str]:
        """Each window's text, as ``tokenizer.decode`` gives it."""
        if self._rust is not None:
            decode = self._rust.decode
            return [decode(ids, skip_special_tokens=skip_special_tokens) for ids in windows]
        assert self.tokenizer is not None
        return [_decode(self.tokenizer, ids, skip_special_tokens) for ids in windows]


def _step(seq: Sequence, prefix: str, full: str) -> Step:
    """The incremental step from the window's two texts: nothing while the new text is empty or
    ends in an incomplete character, else the new text and the window moved past it."""
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return None
    return full[len(prefix) :], seq.read_offset, len(seq.token_ids)


def _decode(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special_tokens: bool) -> str:
    """The text of one sequence of ids (transformers' ``decode`` is annotated ``str | list[str]``
    for batches too)."""
    return cast(str, tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
