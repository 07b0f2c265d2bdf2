"""The detokenizer decodes a step's sequences together and gives, token by token, the text and
window offsets that decoding each sequence alone with ``tokenizer.decode`` gives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from dfllm.engine.detokenizer import Detokenizer
from dfllm.sampling_params import SamplingParams

from helpers import make_seq

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
def test_batched_steps_equal_one_sequence_decodes(data, which, smollm2_tokenizer, minilm_tokenizer):
    """Random prompts and outputs (special tokens, byte pieces that leave characters incomplete,
    ``skip_special_tokens`` either way), some sequences stepping in each step: the same text and
    offsets after every step. SmolLM2's byte-level BPE decodes through the Rust tokenizer in one
    call; MiniLM's WordPiece cleans up spaces, so it decodes through ``tokenizer.decode``."""
    tokenizer = smollm2_tokenizer if which == "smollm2" else minilm_tokenizer
    det = Detokenizer(tokenizer)
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
