"""A row's error names its row and column whatever their labels are.

The pairwise operators (``join``, ``sim_join``, ``dedup``, ``topk``) name a failed row by its
index label and the column at fault by its name. A label of any value (an integer past
Python's 4300-digit limit for ``repr``, a lone surrogate, bytes, a tuple) is written as
:func:`dfllm.errors.value_repr` writes it, and a column of any name (``0``, ``2.5``, ``-2**70``)
as its own: the row's error, never a crash of the whole call (the labels' ``repr`` raised
Python's digit-limit ``ValueError``; a column not named by a string raised ``TypeError``
from ``str.replace`` when one of its rows could not be embedded).
"""

from __future__ import annotations

import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dfllm  # noqa: F401  (registers .llm)
from dfllm.errors import value_repr, value_text

LABELS = st.sampled_from([10**5000, "\ud800", b"\xff", ("a", 1), 2**70, "plain", 7, -1.5])
NAMES = st.sampled_from([0, 2.5, -(2**70), "text", "\u202eevil"])
GOOD_TEXTS = ["late parcel", "great sound"]
BAD_TEXTS = [None, "", "\ud800", b"\xff", ["x"]]
TINY = {"max_model_len": 256, "kv_cache_memory_bytes": 2**24}


def frame(name, values: list, labels: list) -> pd.DataFrame:
    """One column ``name`` holding ``values`` (as they are), its index ``labels``."""
    df = pd.DataFrame({name: pd.Series(values, dtype=object)})
    df.index = pd.Index(labels, dtype=object)
    return df


def texts(draw, n: int) -> list:
    return draw(st.lists(st.sampled_from([*GOOD_TEXTS, *BAD_TEXTS]), min_size=n, max_size=n))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_sim_join_names_failed_rows_by_any_label_and_column(data):
    n, m = data.draw(st.integers(1, 3), label="n"), data.draw(st.integers(1, 3), label="m")
    lname, rname = data.draw(NAMES, label="left column"), data.draw(NAMES, label="right column")
    left = frame(lname, texts(data.draw, n), data.draw(st.lists(LABELS, min_size=n, max_size=n, unique_by=value_repr)))
    right = frame(rname, texts(data.draw, m), data.draw(st.lists(LABELS, min_size=m, max_size=m, unique_by=value_repr)))
    out = left.llm.sim_join(right, lname, rname, 1)
    errors = [e for e in out["llm_error"].tolist() if isinstance(e, str)]
    for side, df, name in (("left", left, lname), ("right", right, rname)):
        for label, value in zip(df.index, df[name]):
            if value not in GOOD_TEXTS:  # a row that cannot be embedded: once, its error naming the column
                mine = [e for e in errors if e.startswith(f"{side} index {value_repr(label)}: ")]
                assert len(mine) == 1, (label, value, errors)
                assert value_repr(name) in mine[0] or f"{{{value_text(name)}}}" in mine[0], mine[0]
    for e in errors:
        e.encode("utf-8")  # a string column holds it


def test_join_names_rows_of_any_label(tiny_judge):
    left = frame("review", ["late parcel", None], [10**5000, "a"])
    right = frame("topic", ["shipping", None], ["b", 10**5000])
    out = left.llm.join(right, "{review} is about {topic}", model=str(tiny_judge), **TINY)
    errors = sorted(e for e in out["llm_error"].tolist() if isinstance(e, str))
    assert errors == [
        "left index 'a': column 'review' is null",
        f"right index {value_repr(10**5000)}: column 'topic' is null",
    ]


def test_dedup_and_topk_name_a_failed_pair_by_any_label(tiny_judge):
    """Both rows' pair prompts are past ``max_model_len``: each row's error names the other row."""
    long_texts = ["word " * 130, "word " * 130 + "again", "tiny"]
    df = frame("review", long_texts, [10**5000, "\ud800", 3])
    out = df.llm.dedup("review", threshold=0.5, confirm=True, model=str(tiny_judge), **TINY)
    assert len(out) == 3
    first, second = out["llm_error"].iloc[0], out["llm_error"].iloc[1]
    assert first.startswith("dedup: the pair with the row of index '\\ud800' could not be judged")
    assert second.startswith(f"dedup: the pair with the row of index {value_repr(10**5000)} could not be judged")

    df = frame("review", long_texts, ["b", 10**5000, "c"])
    out = df.llm.topk("{review} is the best", 2, model=str(tiny_judge), **TINY)
    assert len(out) == 3
    failed = [e for e in out["llm_error"].tolist() if isinstance(e, str)]
    assert failed and all("could not be ranked" in e for e in failed)
    assert any(value_repr(10**5000) in e for e in failed)
