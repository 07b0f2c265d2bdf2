"""The detokenizer decodes a step's sequences together and gives, token by token, the text and
window offsets that decoding each sequence alone with ``tokenizer.decode`` gives; with a
byte-level vocabulary's bytes, the text of ``tokenizer.decode`` of the output ids; with a
SentencePiece vocabulary's (byte fallback; Llama 2's leading-space strip or Gemma's none),
``tokenizer.decode`` of the prompt and the output less that of the prompt."""

from __future__ import annotations

import copy
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders
from transformers import AutoTokenizer

from dfllm import LLM
from dfllm.engine.detokenizer import Detokenizer
from dfllm.sampling_params import SamplingParams

from helpers import build_tiny_model, make_seq, sentencepiece_tokenizer

WINDOW = 5


def reference_step(tokenizer, seq, state: dict) -> None:
    """The incremental step decoded with ``tokenizer.decode``, one sequence at a time."""
    skip = seq.params.skip_special_tokens
    ids = seq.token_ids
    prefix = tokenizer.decode(ids[state["prefix"] : state["read"]], skip_special_tokens=skip)
    full = tokenizer.decode(ids[state["prefix"] :], skip_special_tokens=skip)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        return
    state["text"] += full[len(prefix) :]
    state["prefix"], state["read"] = state["read"], len(ids)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def smollm2_windows(smollm2_dir):
    """SmolLM2's tokenizer with its ByteLevel decoder inside a ``Sequence``: the same decode,
    but not a bare ``ByteLevel``, so its windows decode through the Rust tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteLevel()])
    return tokenizer


@pytest.fixture(scope="module")
def minilm_tokenizer():
    from dfllm.models.bundled import resolve_model

    # WordPiece with transformers' space clean-up after the Rust decode: decoded through tokenizer.decode
    return AutoTokenizer.from_pretrained(resolve_model("all-minilm-l6-v2"), clean_up_tokenization_spaces=True)


def _steps(draw, vocab: int):
    ids = st.one_of(st.integers(0, 20), st.integers(0, vocab - 1))  # special tokens often
    seqs = draw(
        st.lists(
            st.tuples(st.lists(ids, min_size=1, max_size=12), st.lists(ids, max_size=16), st.booleans()),
            min_size=1,
            max_size=6,
        )
    )
    return seqs, draw(st.randoms(use_true_random=False))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), which=st.sampled_from(["smollm2", "minilm"]))
def test_batched_steps_equal_one_sequence_decodes(data, which, smollm2_windows, minilm_tokenizer):
    """Random prompts and outputs (special tokens, byte pieces that leave characters incomplete,
    ``skip_special_tokens`` either way), some sequences stepping in each step: the same text and
    offsets after every step. SmolLM2's byte-level BPE (its decoder wrapped, so that it has no
    byte table) decodes through the Rust tokenizer in one call; MiniLM's WordPiece cleans up
    spaces, so it decodes through ``tokenizer.decode``."""
    tokenizer = smollm2_windows if which == "smollm2" else minilm_tokenizer
    det = Detokenizer(tokenizer)
    assert det.batches
    assert (det._rust is not None) == (which == "smollm2")
    specs, rng = _steps(data.draw, len(tokenizer))
    seqs, refs, outs = [], [], []
    for prompt, out, skip in specs:
        seq = make_seq(prompt)
        seq.request.params = SamplingParams(skip_special_tokens=skip)
        det.start(seq)
        seqs.append(seq)
        refs.append({"text": "", "prefix": seq.prefix_offset, "read": seq.read_offset})
        outs.append(list(out))
    while any(outs):
        left = [i for i, o in enumerate(outs) if o]
        stepping = [i for i in left if rng.random() < 0.7] or left[:1]
        for i in stepping:
            seqs[i].token_ids.append(outs[i].pop(0))
        ready = det.prepare([seqs[i] for i in stepping])
        for i, r in zip(stepping, ready):
            det.apply(seqs[i], r)
            reference_step(tokenizer, seqs[i], refs[i])
            assert (seqs[i].text, seqs[i].prefix_offset, seqs[i].read_offset) == (
                refs[i]["text"],
                refs[i]["prefix"],
                refs[i]["read"],
            )


def test_step_alone_equals_prepare_and_apply(smollm2_tokenizer):
    det = Detokenizer(smollm2_tokenizer)
    a, b = make_seq([1, 2, 3]), make_seq([1, 2, 3])
    for seq in (a, b):
        det.start(seq)
    for token in smollm2_tokenizer.encode(" naïve café, 東京 🙂 done", add_special_tokens=False):
        a.token_ids.append(token)
        b.token_ids.append(token)
        det.step(a)
        det.apply(b, det.prepare([b])[0])
        assert (a.text, a.read_offset) == (b.text, b.read_offset)
    assert a.text == " naïve café, 東京 🙂 done"


def _unfinished(tail: bytes) -> bool:
    """Whether ``tail`` is the start of one UTF-8 character, not yet complete."""
    return tail == b"" or (len(tail) <= 3 and tail.decode("utf-8", "ignore") == "" and tail[0] >= 0xC2)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_byte_level_text_is_the_decode_of_the_output(data, smollm2_tokenizer):
    """SmolLM2's bare ByteLevel decoder: the detokenizer reads its tokens' bytes. Random prompts
    and outputs (special tokens, ids of single bytes that cut characters, ids past the
    vocabulary, ``skip_special_tokens`` either way), several tokens between some steps: after
    every step the text, with the unfinished character held back, is ``tokenizer.decode`` of
    the output ids; the text only grows; the step reads every token appended."""
    tokenizer = smollm2_tokenizer
    det = Detokenizer(tokenizer)
    assert not det.batches
    vocab = len(tokenizer)
    ids = st.one_of(st.integers(0, 20), st.integers(0, 600), st.integers(0, vocab - 1), st.just(vocab + 7))
    prompt = data.draw(st.lists(ids, min_size=1, max_size=8))
    out = data.draw(st.lists(st.lists(ids, min_size=1, max_size=3), max_size=16))
    skip = data.draw(st.booleans())
    seq = make_seq(prompt)
    seq.request.params = SamplingParams(skip_special_tokens=skip)
    det.start(seq)
    together = data.draw(st.booleans())  # prepare + apply, or step
    for chunk in out:
        before = seq.text
        seq.token_ids.extend(chunk)
        delta = det.apply(seq, det.prepare([seq])[0]) if together else det.step(seq)
        assert seq.text == before + delta
        assert seq.read_offset == len(seq.token_ids)
        assert _unfinished(seq.utf8_tail), seq.utf8_tail
        expected = tokenizer.decode(seq.output_token_ids, skip_special_tokens=skip)
        assert seq.text + seq.utf8_tail.decode("utf-8", "replace") == expected


def test_byte_level_equals_windows_on_text(smollm2_tokenizer, smollm2_windows):
    """Valid text, characters of one to four bytes, after a prompt: token by token the windows'
    text is the byte reading's, or held behind it (a window that ends inside a character holds
    back its complete characters too; the bytes only that character's); at the end the same."""
    text = " naïve café, 東京 🙂 done\n\tΩ≈ç√ — ok! <|im_end|> 𝔘𝔫𝔦"
    tokens = smollm2_tokenizer.encode(text, add_special_tokens=False)
    a, b = bytes_beside_windows(Detokenizer(smollm2_tokenizer), Detokenizer(smollm2_windows), [1, 9, 600], tokens)
    assert a.text == b.text == smollm2_tokenizer.decode(tokens, skip_special_tokens=True)


def bytes_beside_windows(by_bytes: Detokenizer, by_windows: Detokenizer, prompt: list[int], tokens: list[int]):
    """Two sequences of ``prompt`` fed ``tokens`` one at a time, one read by bytes and one by
    windows; at every step the bytes' text is the windows' or ahead of it."""
    a, b = make_seq(prompt), make_seq(prompt)
    by_bytes.start(a)
    by_windows.start(b)
    for token in tokens:
        a.token_ids.append(token)
        b.token_ids.append(token)
        by_bytes.step(a)
        by_windows.step(b)
        assert a.text.startswith(b.text)
    return a, b


@settings(max_examples=40, deadline=None)
@given(data=st.data(), which=st.sampled_from(["smollm2", "smollm2_windows", "minilm", "llama2", "gemma"]))
def test_token_texts_are_single_id_decodes(data, which, smollm2_tokenizer, smollm2_windows, minilm_tokenizer, sp):
    """A log-probability's text: each id decoded alone (special tokens kept), from the byte
    table or the tokenizer, for ids of single bytes, special ids and ids past the vocabulary."""
    tokenizer = {"smollm2": smollm2_tokenizer, "smollm2_windows": smollm2_windows, "minilm": minilm_tokenizer, **sp}[
        which
    ]
    vocab = len(tokenizer)
    ids = data.draw(st.lists(st.one_of(st.integers(0, 600), st.integers(0, vocab + 20)), max_size=12))
    assert Detokenizer(tokenizer).token_texts(ids) == tokenizer.batch_decode([[t] for t in ids])


# ---- SentencePiece with byte fallback (Llama 2, Mistral, Gemma) ---------------------------------------
@pytest.fixture(scope="module")
def sp():
    """Llama 2's decoder (the leading-space strip) and Gemma's (none), on one small vocabulary."""
    return {"llama2": sentencepiece_tokenizer(strip=True), "gemma": sentencepiece_tokenizer(strip=False)}


def _windows_twin(tokenizer):
    """The same tokenizer with its decoder wrapped in a ``Sequence``: the same decode, no byte table."""
    twin = copy.deepcopy(tokenizer)
    twin.backend_tokenizer.decoder = decoders.Sequence([tokenizer.backend_tokenizer.decoder])
    return twin


TEXT = st.text(st.characters(blacklist_categories=("Cs",), max_codepoint=0x1FFFF), max_size=12)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), which=st.sampled_from(["llama2", "gemma"]))
def test_sentencepiece_text_is_the_decode_of_prompt_and_output(data, which, sp):
    """Prompts of text, of special tokens only (no bytes: Llama 2's decoder drops the output's
    leading space), or empty text; outputs of text (characters the vocabulary lacks as byte
    tokens, characters cut between steps) with special tokens between words,
    ``skip_special_tokens`` either way, several tokens between some steps: the text only
    grows, and at the end it is the decode of prompt and output less the prompt's."""
    tokenizer = sp[which]
    det = Detokenizer(tokenizer)
    assert not det.batches and det._bytes is not None and det._bytes.strips_space == (which == "llama2")
    special = st.sampled_from(tokenizer.all_special_ids)
    words = st.lists(
        st.one_of(TEXT.map(lambda t: tokenizer.encode(t, add_special_tokens=False)), special.map(lambda i: [i]))
    )
    prompt = [t for w in data.draw(words) for t in w] or [tokenizer.bos_token_id]
    out = [t for w in data.draw(words) for t in w]
    skip = data.draw(st.booleans())
    full = tokenizer.decode(prompt + out, skip_special_tokens=skip)
    head = tokenizer.decode(prompt, skip_special_tokens=skip)
    assert full.startswith(head)
    seq = make_seq(prompt)
    seq.request.params = SamplingParams(skip_special_tokens=skip)
    det.start(seq)
    together = data.draw(st.booleans())  # prepare + apply, or step
    while out:
        n = data.draw(st.integers(1, 3))
        chunk, out = out[:n], out[n:]
        before = seq.text
        seq.token_ids.extend(chunk)
        delta = det.apply(seq, det.prepare([seq])[0]) if together else det.step(seq)
        assert seq.text == before + delta and seq.read_offset == len(seq.token_ids)
        assert full[len(head) :].startswith(seq.text)
    assert seq.text == full[len(head) :] and seq.utf8_tail == b""


@pytest.mark.parametrize("which", ["llama2", "gemma"])
def test_sentencepiece_equals_windows_on_text(which, sp):
    """Token by token after a prompt of text, the byte reading's text is the windows' or ahead
    of it; at the end the same, and the decode of the output."""
    tokenizer = sp[which]
    text = " naïve café, 東京 🙂 done\n\tΩ≈ç√ — ok! 𝔘𝔫𝔦  two  spaces"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert any(3 <= t < 259 for t in tokens)  # byte tokens among them
    by_bytes, by_windows = Detokenizer(tokenizer), Detokenizer(_windows_twin(tokenizer))
    assert by_bytes._bytes is not None and by_windows._bytes is None and by_windows._rust is not None
    prompt = tokenizer.encode("Hello world", add_special_tokens=False)
    a, b = bytes_beside_windows(by_bytes, by_windows, prompt, tokens)
    assert a.text == b.text == tokenizer.decode(prompt + tokens)[len(tokenizer.decode(prompt)) :]


def test_a_prompt_without_bytes_drops_the_outputs_first_space_once(sp):
    """Llama 2's strip: after a prompt of special tokens skipped, the output's first text loses
    its leading space, even where that text is only the space; nothing after it does. With the
    special tokens kept (they have bytes), or Gemma's decoder, nothing is dropped."""
    ids = sp["llama2"].convert_tokens_to_ids(["\u2581", "\u2581Hello\u2581"])
    assert None not in ids and 0 not in ids  # in the vocabulary (0 is <unk>)
    space, hello = ids
    for which, skip, want in [("llama2", True, " Hello "), ("llama2", False, "  Hello "), ("gemma", True, "  Hello ")]:
        tokenizer = sp[which]
        det = Detokenizer(tokenizer)
        seq = make_seq([tokenizer.bos_token_id])
        seq.request.params = SamplingParams(skip_special_tokens=skip)
        det.start(seq)
        for token in (space, hello):
            seq.token_ids.append(token)
            det.step(seq)
        assert seq.text == want, which
        ids = seq.token_ids
        assert (
            seq.text
            == tokenizer.decode(ids, skip_special_tokens=skip)[
                len(tokenizer.decode(ids[:1], skip_special_tokens=skip)) :
            ]
        )


def test_other_decoders_keep_the_windows(sp):
    """A decoder that is not exactly one of the two read (here a strip of two spaces, or
    Metaspace's) has no byte table: its windows decode it."""
    for decoder in (
        decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 2, 0)]
        ),
        decoders.Metaspace(),
    ):
        tokenizer = copy.deepcopy(sp["llama2"])
        tokenizer.backend_tokenizer.decoder = decoder
        det = Detokenizer(tokenizer)
        assert det._bytes is None and det.batches


@pytest.mark.parametrize("which", ["llama2", "gemma"])
def test_the_engine_reads_sentencepiece_bytes_as_its_windows_read_them(tmp_path, sp, which):
    """A tiny model with the SentencePiece tokenizer, and its twin whose decoder is wrapped (no
    byte table: windows), sampling the same tokens (words only: valid text) after prompts of
    text and after a prompt of ``<s>`` alone: the same texts, each the decode of prompt and
    output less the prompt's."""
    tokenizer = sp[which]
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    path = build_tiny_model(tmp_path / "bytes", tmp_path / "tokenizer")
    twin = tmp_path / "windows"
    shutil.copytree(path, twin)
    _windows_twin(tokenizer).save_pretrained(twin)
    words = [i for i in range(259, len(tokenizer)) if i not in tokenizer.all_special_ids]
    prompts = [
        {"prompt_token_ids": tokenizer.encode("Hello world, the", add_special_tokens=False)},
        {"prompt_token_ids": [tokenizer.bos_token_id]},
        {"prompt_token_ids": tokenizer.encode("東京 🙂 ok", add_special_tokens=False)},
    ]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=16, allowed_token_ids=words, skip_special_tokens=i != 1)
        for i in range(len(prompts))
    ]
    got = {}
    for name, model in (("bytes", path), ("windows", twin)):
        llm = LLM(model, max_model_len=64)
        assert (llm.llm_engine.output_processor.detokenizer._bytes is not None) == (name == "bytes")
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[name] = [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]
    assert got["bytes"] == got["windows"]
    for prompt, (ids, text), p in zip(prompts, got["bytes"], params):
        before = prompt["prompt_token_ids"]
        skip = p.skip_special_tokens
        assert (
            text
            == tokenizer.decode(before + ids, skip_special_tokens=skip)[
                len(tokenizer.decode(before, skip_special_tokens=skip)) :
            ]
        )
