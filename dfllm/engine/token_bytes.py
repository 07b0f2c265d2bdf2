"""A byte-level BPE vocabulary as the bytes each token stands for.

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

An id's bytes (:class:`TokenBytes`) follow the Rust decoder's own rule: a token all of whose
characters are byte characters is those bytes, any other (an added token with a character
outside the 256, an id with no token) its text's UTF-8 (nothing); with ``skip_special_tokens``
a special token is nothing. They are worked out the first time an id is read (a 150,000-token
vocabulary would take a tenth of a second up front, for every engine) and checked then
against the tokenizer's own decode of that id alone; a tokenizer whose decoder is anything
but a bare ``ByteLevel`` has none (:func:`token_bytes`).
"""

from __future__ import annotations

import functools
import logging

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
    read is worked out (and checked) on first use."""

    def __init__(self, rust_tokenizer, special: frozenset[int], skip_special_tokens: bool):
        super().__init__()
        self._rust = rust_tokenizer
        self._special = special
        self._skip = skip_special_tokens

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
            else:
                byte_of = _byte_of_char()
                try:
                    piece = bytes([byte_of[c] for c in token])
                except KeyError:  # not all byte characters: the decoder leaves the text as it is
                    piece = token.encode()
        text = self._rust.decode([token_id], skip_special_tokens=self._skip)
        if text != piece.decode("utf-8", "replace"):  # never seen: the decoder is not what this module reads
            logger.warning("token %d decodes to %r, not as its bytes %r: read as that text", token_id, text, piece)
            return text.encode()
        return piece


def token_bytes(rust_tokenizer) -> tuple[TokenBytes, TokenBytes] | None:
    """The bytes of a ``tokenizers.Tokenizer``'s ids, with special tokens kept and skipped,
    where its decoder is ``ByteLevel`` alone; None for any other."""
    from tokenizers import decoders

    if type(getattr(rust_tokenizer, "decoder", None)) is not decoders.ByteLevel:
        return None
    special = frozenset(i for i, t in rust_tokenizer.get_added_tokens_decoder().items() if t.special)
    return TokenBytes(rust_tokenizer, special, False), TokenBytes(rust_tokenizer, special, True)
