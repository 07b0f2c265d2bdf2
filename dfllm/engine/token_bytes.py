"""A vocabulary as the bytes each token stands for, where its decoder allows that.

A byte-level tokenizer (GPT-2's scheme: Llama 3, Qwen, SmolLM2, Mistral's Tekken...) writes
every byte as one printable character, and its decoder (``tokenizers.decoders.ByteLevel``)
maps each token's characters back to bytes, joins the bytes of all the tokens and reads them
as UTF-8, an invalid or cut-off sequence becoming U+FFFD (Rust's ``from_utf8_lossy``). So a
token's text depends on its neighbours only where a character's bytes are split between
tokens, and the text of any ids is the UTF-8 of their bytes joined: knowing each id's bytes,
the detokenizer appends one token's bytes and reads the new complete characters
(``codecs.utf_8_decode``, which replaces what is invalid as Rust does) instead of asking the
tokenizer to decode windows of ids twice per token (about 2 µs a call: at 256 sequences,
1 ms of host work per step).

SentencePiece's BPE with byte fallback (Llama 2, Mistral, Gemma, Phi-3) decodes the same way
in other words: its decoder (``Replace("▁", " ")``, ``ByteFallback``, ``Fuse``, and for Llama 2
and Mistral ``Strip(" ", 1, 0)``) writes each ``▁`` as a space, reads a token ``<0xHH>`` as
that byte, joins everything and reads it as UTF-8, then (with ``Strip``) drops one leading
space of the whole text. So its tokens have bytes too, and that one space is the only
context: a sequence's text loses it where nothing before the output has any bytes (the
detokenizer's ``Sequence.utf8_lstrip``; ``tokenizer.decode`` of the prompt and the output,
less the prompt's). One difference: ``ByteFallback`` makes every byte token of a run that is
not valid UTF-8 a U+FFFD, where these bytes give one U+FFFD per invalid subsequence, as a
byte-level decoder does (on valid text the two agree).

An id's bytes (:class:`TokenBytes`) follow the Rust decoder's own rule: a token all of whose
characters are byte characters (byte-level; in SentencePiece a token ``<0xHH>``) is those
bytes, any other (an added token with a character outside the 256, an id with no token) its
text's UTF-8, ``▁`` read as a space in SentencePiece (nothing for an id with no token); with
``skip_special_tokens`` a special token is nothing. They are worked out the first time an id
is read (a 150,000-token vocabulary would take a tenth of a second up front, for every
engine) and checked then against the tokenizer's own decode of that id alone; a tokenizer
whose decoder is neither of these exactly has none (:func:`token_bytes`).
"""

from __future__ import annotations

import functools
import json
import logging
from typing import NamedTuple

logger = logging.getLogger("dfllm")


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: the byte each of the 256 byte characters stands for."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes(dict):
    """Id -> the bytes it stands for, for one ``skip_special_tokens`` setting; an id not yet
    read is worked out (and checked) on first use. ``sentencepiece``: the vocabulary is
    SentencePiece's (``▁`` for a space, ``<0xHH>`` byte tokens), else byte-level BPE's;
    ``strips``: its decoder drops one leading space of a text."""

    def __init__(
        self,
        rust_tokenizer,
        special: frozenset[int],
        skip_special_tokens: bool,
        sentencepiece: bool = False,
        strips: bool = False,
    ):
        super().__init__()
        self._rust = rust_tokenizer
        self._special = special
        self._skip = skip_special_tokens
        self._sentencepiece = sentencepiece
        self._strips = strips

    def __missing__(self, token_id: int) -> bytes:
        piece = self._bytes_of(token_id)
        self[token_id] = piece
        return piece

    def _bytes_of(self, token_id: int) -> bytes:
        if self._skip and token_id in self._special:
            piece = b""
        else:
            token = self._rust.id_to_token(token_id)
            if token is None:
                piece = b""
            elif self._sentencepiece:
                piece = _sentencepiece_bytes(token)
            else:
                byte_of = _byte_of_char()
                try:
                    piece = bytes([byte_of[c] for c in token])
                except KeyError:  # not all byte characters: the decoder leaves the text as it is
                    piece = token.encode()
        text = self._rust.decode([token_id], skip_special_tokens=self._skip)
        alone = piece.decode("utf-8", "replace")
        if self._strips:
            alone = lstrip_space(alone)
        if text != alone:  # never seen: the decoder is not what this module reads
            logger.warning("token %d decodes to %r, not as its bytes %r: read as that text", token_id, text, piece)
            return text.encode()
        return piece


def lstrip_space(text: str) -> str:
    """``text`` less one leading space (SentencePiece's ``Strip(" ", 1, 0)`` decoder)."""
    return text[1:] if text[:1] == " " else text


def _sentencepiece_bytes(token: str) -> bytes:
    """A SentencePiece token's bytes: ``<0xHH>`` is byte HH (``ByteFallback``), any other its
    text with each ``▁`` a space."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:  # not hexadecimal: an ordinary token
            pass
    return token.replace("\u2581", " ").encode()


class VocabularyBytes(NamedTuple):
    """A tokenizer's ids as bytes, with special tokens kept and skipped, and whether its
    decoder drops one leading space of a text."""

    keep: TokenBytes
    skip: TokenBytes
    strips_space: bool


# SentencePiece's decoder with byte fallback (Gemma's), then Llama 2's and Mistral's with the strip
_SENTENCEPIECE = [
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
]
_STRIP = {"type": "Strip", "content": " ", "start": 1, "stop": 0}


def token_bytes(rust_tokenizer) -> VocabularyBytes | None:
    """The bytes of a ``tokenizers.Tokenizer``'s ids, where its decoder is ``ByteLevel`` alone
    or SentencePiece's with byte fallback exactly (see the module's docstring); None for any other."""
    from tokenizers import decoders

    decoder = getattr(rust_tokenizer, "decoder", None)
    special = frozenset(i for i, t in rust_tokenizer.get_added_tokens_decoder().items() if t.special)
    if type(decoder) is decoders.ByteLevel:
        keep, skip = TokenBytes(rust_tokenizer, special, False), TokenBytes(rust_tokenizer, special, True)
        return VocabularyBytes(keep, skip, False)
    if type(decoder) is not decoders.Sequence:
        return None
    try:
        parts = json.loads(decoder.__getstate__()).get("decoders")
    except (AttributeError, TypeError, ValueError):  # a decoder whose state is not JSON: read as windows
        return None
    if parts not in (_SENTENCEPIECE, [*_SENTENCEPIECE, _STRIP]):
        return None
    strips = len(parts) == 4
    return VocabularyBytes(
        TokenBytes(rust_tokenizer, special, False, sentencepiece=True, strips=strips),
        TokenBytes(rust_tokenizer, special, True, sentencepiece=True, strips=strips),
        strips,
    )
