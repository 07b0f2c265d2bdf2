"""``build_processor`` on hostile rows, round two: an engine error names the row it belongs
to (its index label) and its field, never the row's place in the engine call; a column name
that is not text is its row's error; every input row comes out exactly once, in order, and
good rows in the same batch keep their outputs.

- Bad chat messages (a wrong role, an empty conversation, a lone surrogate, text that is
  not a conversation), interleaved with prompt rows (a second engine call) and rows that
  failed in preprocess, under any index labels (text with lone surrogates, ints past 64 bits,
  one past Python's digit limit): the
  error is ``messages: the conversation of row <label>...``, not ``conversation 2``.
- postprocess (or, without one, preprocess) returning a key that is not text (``1`` beside
  ``"1"``) fails that row, naming the key and the function: a written file could not hold
  both columns.
"""

from __future__ import annotations

import re

import dask.dataframe as dd
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dfllm
from dfllm.jobs.processor import RowFailedError, _label_text

SP = dict(temperature=0.0, max_tokens=1, ignore_eos=True)
ENGINE = {"max_model_len": 64, "kv_cache_memory_bytes": 2**22}
GOOD = [{"role": "user", "content": "hi"}]
BAD_MESSAGES = {
    "role": [{"role": "conversation 0", "content": "x"}],  # a role that reads like the engine's wording
    "empty": [],
    "surrogate": [{"role": "user", "content": "a\udc80"}],
    "no_role": [{"content": "x"}],
    "not_a_list": "not a conversation",
    "content_int": [{"role": "user", "content": 5}],
    "message_str": ["hello"],
}
KINDS = ("good", "prompt", "preprocess_fails", *BAD_MESSAGES)
labels_strategy = st.one_of(
    st.text(alphabet=st.characters(codec=None, categories=None), min_size=1, max_size=6),
    st.integers(min_value=-(2**80), max_value=2**80),
)


@pytest.fixture(scope="module")
def config(tiny_llama):
    return dfllm.ProcessorConfig(model_source=str(tiny_llama), engine_kwargs=ENGINE, batch_size=4)


def pre(row):
    kind = row["kind"]
    if kind == "preprocess_fails":
        raise ValueError("no")
    if kind == "prompt":
        return {"prompt": "a prompt", "sampling_params": SP}
    return {"messages": GOOD if kind == "good" else BAD_MESSAGES[kind], "sampling_params": SP}


def frame(kinds: list[str], labels: list) -> pd.DataFrame:
    return pd.DataFrame({"kind": kinds}, index=pd.Index(labels, dtype=object))


def check_rows(out: pd.DataFrame, df: pd.DataFrame) -> None:
    assert list(out.index) == list(df.index) and out["kind"].tolist() == df["kind"].tolist()  # each row once
    texts = out["generated_text"] if "generated_text" in out else [None] * len(out)  # no row got an output
    for label, kind, error, text in zip(out.index, out["kind"], out["llm_error"], texts):
        error = None if pd.isna(error) else error
        if kind in ("good", "prompt"):
            assert error is None and isinstance(text, str), (label, kind, error)
        elif kind == "preprocess_fails":
            assert error == "preprocess: ValueError: no"
        else:
            assert error is not None and pd.isna(text)
            row = f"row {_label_text(label)}"
            assert error.startswith((f"messages: the conversation of {row}", f"messages: in {row}, ")), (label, error)
            assert not re.search(r"(?<!')conversation \d", error), error  # no place in the engine call
            error.encode("utf-8")


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(
        st.tuples(st.sampled_from(KINDS), labels_strategy),
        min_size=1,
        max_size=7,
        unique_by=lambda r: (type(r[1]), r[1]),
    )
)
def test_bad_messages_name_their_row_and_field(config, rows):
    df = frame([k for k, _ in rows], [label for _, label in rows])
    out = dfllm.build_processor(config, preprocess=pre)(df)
    check_rows(out, df)


def test_bad_messages_name_their_row_not_their_place_in_the_engine_call(config):
    """The known case: the third row's bad conversation was "conversation 2" (and "0" once
    rows before it were prompts, another engine call); it is row 'r2' whatever the batch."""
    kinds = ["good", "prompt", "role", "empty", "good", "not_a_list", "surrogate", "prompt"]
    df = frame(kinds, [f"r{i}" for i in range(len(kinds))])
    out = dfllm.build_processor(config, preprocess=pre)(df)
    check_rows(out, df)
    assert out.loc["r2", "llm_error"].startswith(
        "messages: the conversation of row 'r2', message 0: role must be one of"
    )
    assert out.loc["r3", "llm_error"] == "messages: the conversation of row 'r3' must be a non-empty list of messages"
    assert out.loc["r5", "llm_error"].startswith("messages: in row 'r5', the conversation is a string")
    assert out.loc["r6", "llm_error"].startswith("messages: the conversation of row 'r6', message 0: content")


def test_on_dask_and_when_a_row_fails_the_job_the_error_names_the_row(config):
    df = frame(["good", "prompt", "good", "empty"], ["a", "b", "c", "d"])
    ddf = dd.from_pandas(df, npartitions=2, sort=False)
    out = dfllm.build_processor(config, preprocess=pre)(ddf).compute()
    check_rows(out, df)
    df.index = pd.Index(["a", "b", "c", "d\ud800"], dtype=object)  # (Dask's from_pandas cannot take this label)
    strict = dfllm.ProcessorConfig(
        model_source=config.model_source, engine_kwargs=ENGINE, batch_size=4, should_continue_on_error=False
    )
    with pytest.raises(RowFailedError, match=re.escape("messages: the conversation of row 'd\\ud800' must be")) as info:
        dfllm.build_processor(strict, preprocess=pre)(df)
    assert info.value.row == "d\ud800"


def test_a_huge_int_label_is_named_without_failing(config):
    big = 10**5000
    out = dfllm.build_processor(config, preprocess=pre)(frame(["empty", "good"], [big, 1]))
    expected = "messages: the conversation of row an int that cannot be written as text"
    assert out["llm_error"].iloc[0].startswith(expected)
    assert pd.isna(out["llm_error"].iloc[1])


def test_non_text_column_names_fail_their_row_and_the_write_reads_back(config, tmp_path):
    def prompt(row):
        return {"prompt": f"item {row['id']}", "sampling_params": SP}

    def post(row):
        return {"id": row["id"], "text": row["generated_text"], **({1: "a", "1": "b"} if row["id"] == 2 else {})}

    df = pd.DataFrame({"id": range(4)})
    out = dfllm.build_processor(config, preprocess=prompt, postprocess=post)(df)
    assert list(out.columns) == ["id", "text", "llm_error"] and out["id"].tolist() == [0, 1, 2, 3]
    assert out["llm_error"].notna().tolist() == [False, False, True, False]
    assert out.loc[2, "llm_error"] == "postprocess returned column name(s) that are not text: 1 (int)"
    # on Dask, a row's int key decided a column, and the written parts could not be read
    every = dfllm.build_processor(config, preprocess=prompt, postprocess=lambda r: {"id": r["id"], 1: "a", "1": "b"})
    lazy = every(dd.from_pandas(df, npartitions=2), meta={"id": "int64", "1": "string"})
    dfllm.write_parquet(lazy, str(tmp_path / "out"))
    back = pd.read_parquet(tmp_path / "out").sort_values("id")
    assert back["id"].tolist() == [0, 1, 2, 3] and back["llm_error"].str.contains("1 \\(int\\)").all()


def test_preprocess_keys_without_postprocess_are_named_as_preprocess(config):
    def prompt(row):
        extra = {1: "x"} if row["id"] == 0 else {"\udc80": 1} if row["id"] == 1 else {}
        return {"prompt": "hi", "sampling_params": SP, **extra}

    out = dfllm.build_processor(config, preprocess=prompt)(pd.DataFrame({"id": range(3)}))
    assert out["id"].tolist() == [0, 1, 2] and 1 not in out.columns
    assert out.loc[0, "llm_error"] == "preprocess returned column name(s) that are not text: 1 (int)"
    assert out.loc[1, "llm_error"].startswith("preprocess returned column(s) ['\\udc80']")
    assert pd.isna(out.loc[2, "llm_error"]) and isinstance(out.loc[2, "generated_text"], str)
