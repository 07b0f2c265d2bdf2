"""A sequence's text (``dfllm.engine.sequence``: appended in place, read in part, cut) is what a
str grown by ``+=``, sliced and cut would be, whatever its characters (line breaks, a BOM, NUL,
lone surrogates, astral ones); and the stop-string search, which reads only the text it can
find a stop string in, finds and cuts what a search of the whole text does."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dfllm import SamplingParams
from dfllm.engine.output_processor import _cut_at_stop_string

from helpers import make_seq

# a small alphabet, so that stop strings occur; every awkward kind of character among them
CHARS = st.sampled_from(
    ["a", "b", "ab", " ", "\n", "\r\n", "\r", "\ufeff", "\x00", "\ud800", "\udfff", "é", "日", "😀"]
)


def texts(min_size: int = 0, max_size: int = 12) -> st.SearchStrategy[str]:
    return st.lists(CHARS, min_size=min_size, max_size=max_size).map("".join)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), texts()),
        st.tuples(st.just("from"), st.integers(0, 80)),
        st.tuples(st.just("cut"), st.integers(0, 80)),
        st.tuples(st.just("read"), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_the_text_is_a_str_appended_read_and_cut(ops):
    seq, model = make_seq([1]), ""
    for op, arg in ops:
        if op == "append":
            seq.append_text(arg)
            model += arg
        elif op == "from":
            assert seq.text_from(arg) == model[arg:]
        elif op == "cut":
            seq.cut_text(min(arg, len(model)))
            model = model[: min(arg, len(model))]
        else:
            assert seq.text == model
        assert seq.text_len == len(model)
    assert seq.text == model


def whole_text_cut(text: str, stop_offset: int, new_len: int, stops: list[str], include: bool):
    """The stop-string search over the whole text (vLLM's, and dfllm's before it read only the
    tail): the earliest stop string starting at or after ``stop_offset`` that the last
    ``new_len`` characters completed; the text cut there, and that string (None: no cut)."""
    best = None
    for stop in stops:
        idx = text.find(stop, max(stop_offset, len(text) - new_len - len(stop) + 1))
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return text, None
    idx, stop = best
    return text[: idx + len(stop)] if include else text[:idx], stop


@settings(max_examples=400, deadline=None)
@given(
    before=texts(max_size=20),
    new=texts(min_size=1, max_size=6),
    stops=st.lists(texts(min_size=1, max_size=4), min_size=1, max_size=3),
    offset=st.integers(0, 40),
    include=st.booleans(),
)
def test_the_stop_string_search_reads_the_tail_and_finds_what_the_whole_text_gives(before, new, stops, offset, include):
    seq = make_seq([1])
    seq.request.params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    seq.append_text(before)
    seq.append_text(new)
    seq.stop_offset = min(offset, len(before + new))
    want = whole_text_cut(before + new, seq.stop_offset, len(new), stops, include)
    stop = _cut_at_stop_string(seq, len(new))
    assert (seq.text, stop) == want
    seq.append_text("z")  # the text goes on from the cut
    assert seq.text == want[0] + "z"
