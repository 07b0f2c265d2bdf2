"""A dataframe's cells nested past ``dfllm.errors.MAX_NESTING_DEPTH``, and past Python's
recursion limit, are their rows' errors naming the column and the field, never the
partition's failure: a chat message's field, a row's chat template variables, its token
ids, its sort key, its images, its LoRA adapter, its structured-output schema with a
response cache. Every input row comes out exactly once, with its output or its error. A
Polars column Arrow cannot hold (a ``List`` nested past Arrow's 64 levels) is refused naming
it, whatever it holds.

Before: "chat template: maximum recursion depth exceeded" for a message's field or a template
variable; ``RecursionError`` failing the whole call for a token id list, a sort key, an image
dict chain, a LoRA cell, a schema 33 to 990 levels deep reaching the response cache's key,
and a Polars column too deep for Python to write its type.

Real parts: the tiny random Llama (conftest's ``tiny_llama``), the real engine.
"""

from __future__ import annotations

import functools

import pandas as pd
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nesting_data import DEPTHS, FAR, WRAPS, deep, far_nested, nested
from semantic_data import ENGINE as SEMANTIC_ENGINE

import dfllm  # noqa: F401  (registers the accessors)
from dfllm import LLM, SamplingParams
from dfllm.errors import MAX_NESTING_DEPTH, InvalidRequestError
from dfllm.multimodal import ImageLoadError, load_image
from dfllm.tasks.runners import run_task
from dfllm.tasks.task import make_task

pytestmark = pytest.mark.timeout(600)

SP = {"temperature": 0.0, "max_tokens": 2}
ENGINE = {"max_model_len": 64, "kv_cache_memory_bytes": 2**22}
OUT = "out"
LIMIT = f"must be nested at most {MAX_NESTING_DEPTH} levels deep"
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def objects(values: list) -> pd.Series:
    return pd.Series(values, dtype=object)


def run(df: pd.DataFrame, model, kind: str = "generate", inputs=("q",), **kwargs) -> pd.DataFrame:
    """``run_task`` of a task built as an accessor builds it (the arguments the accessors
    leave to the batch processor: chat template variables, a token id column)."""
    columns = list(df.columns)
    task = make_task(
        kind, inputs, columns, output_column=OUT, model=str(model), sampling_params=SP, engine_kwargs=ENGINE, **kwargs
    )
    return run_task(df, task)


def assert_rows(out: pd.DataFrame, rows: int, errors: dict[int, str], output: str = OUT) -> None:
    """Each of the ``rows`` input rows once: those in ``errors`` with exactly that error, the
    others with their generated text in ``output``."""
    assert len(out) == rows
    for i, (error, text) in enumerate(zip(out["llm_error"], out[output])):
        if i in errors:
            assert error == errors[i], (i, error)
        else:
            assert pd.isna(error) and isinstance(text, str), (i, error)


# ---- chat: a message's field, a row's template variables ------------------------------------------------
@SETTINGS
@given(
    field=st.sampled_from(["extra", "name", "tool_calls", "role", "content"]),
    depth=DEPTHS,
    wrap=st.sampled_from(WRAPS),
    at=st.integers(0, 2),
)
def test_a_message_field_nested_too_deep_is_its_rows_error(tiny_llama, field, depth, wrap, at):
    convs = [[{"role": "user", "content": f"hello {i}"}] for i in range(3)]
    convs[at] = [{"role": "user", "content": "hi", field: deep(depth, wrap)}]
    out = pd.DataFrame({"c": objects(convs)}).llm.chat("c", model=str(tiny_llama), sampling_params=SP, **ENGINE)
    assert len(out) == 3
    want = f"messages: the conversation, message 0: field {field!r} {LIMIT}"
    for i, error in enumerate(out["llm_error"]):
        assert (error == want) if i == at else (pd.isna(error) and isinstance(out["generated_text"][i], str))


def test_template_variables_nested_too_deep_are_refused_by_name(tiny_llama):
    """A row's variables (a column): its error naming the column and the variable; the task's
    and ``LLM.chat``'s: refused when given."""
    far = far_nested("dict")
    df = pd.DataFrame({"q": ["a", "b", "c"], "v": objects([{"x": far}, None, {"ok": 1, "y": nested(40, "list", 1)}])})
    out = run(df, tiny_llama, "chat", ("{q}",), chat_template_kwargs="v")
    assert_rows(
        out, 3, {k: f"chat_template_kwargs: column 'v': variable {n!r} {LIMIT}" for k, n in ((0, "x"), (2, "y"))}
    )
    with pytest.raises(ValueError, match=f"^chat_template_kwargs: variable 'x' {LIMIT}"):
        make_task("chat", ("{q}",), ["q"], output_column="out", chat_template_kwargs={"x": far})
    llm = LLM(str(tiny_llama), **ENGINE)
    with pytest.raises(InvalidRequestError, match=f"^chat_template_kwargs: variable 'x' {LIMIT}"):
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(**SP), chat_template_kwargs={"x": far})
    with pytest.raises(InvalidRequestError, match=f"^conversation 0, message 0: field 'role' {LIMIT}"):
        llm.chat([{"role": far, "content": "hi"}], SamplingParams(**SP))


# ---- generate: token ids, sort keys ---------------------------------------------------------------------
def test_token_ids_and_sort_keys_nested_without_end(tiny_llama):
    far_list, far_dict = far_nested("list"), far_nested("dict")
    df = pd.DataFrame(
        {
            "q": ["a b", "c d", "e f", "g h"],
            "ids": objects([far_list, [5, far_list], None, None]),
            "key": objects([far_list, far_dict, far_list, 3]),
        }
    )
    out = run(df, tiny_llama, prompt_token_ids="ids", sort_by="key")
    bad = f"ids: must hold ints, got a list nested more than {MAX_NESTING_DEPTH} levels deep (list)"
    assert_rows(out, 4, {0: bad, 1: bad})
    out = run(df.drop(columns="ids"), tiny_llama, sort_by=["key", "prompt"])
    assert_rows(out, 4, {})


# ---- images --------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(key=st.sampled_from(["url", "bytes", "path"]), depth=DEPTHS)
def test_an_image_dict_chain_is_no_image(key, depth):
    value = nested(depth, "dict", b"\x89PNG") if depth != FAR else far_chains()[key]
    if depth != FAR:
        value = {key: value}
    with pytest.raises(ImageLoadError, match=f"^an image dict's '{key}' holds a dict, not an image"):
        load_image(value)


@functools.cache
def far_chains() -> dict[str, dict]:
    """Per key, that key's dict chain :data:`FAR` levels deep (``{"url": {"url": ...}}``),
    built once. Shared: never change them."""
    chains = {}
    for key in ("url", "bytes", "path"):
        value: object = "x"
        for _ in range(FAR):
            value = {key: value}
        chains[key] = value
    return chains


def test_image_cells_nested_without_end_are_their_rows_errors(tiny_llama):
    chains = far_chains()
    cells = [None, far_nested("list"), far_nested("dict"), chains["bytes"], chains["url"], chains["path"], None]
    df = pd.DataFrame({"q": [f"hello {i}" for i in range(len(cells))], "img": objects(cells)})
    out = df.llm.generate("q", images="img", model=str(tiny_llama), sampling_params=SP, **ENGINE)
    assert len(out) == len(cells) and out["llm_error"][[0, 6]].isna().all()
    column = "images column 'img': "
    assert out["llm_error"][1].startswith(f"{column}cannot read an image from a value of type list")
    assert out["llm_error"][2] == f"{column}an image dict needs a 'url', 'bytes' or 'path' key, got keys ['a']"
    for i, key in ((3, "bytes"), (4, "url"), (5, "path")):
        assert (
            out["llm_error"][i]
            == f"{column}an image dict's {key!r} holds a dict, not an image (bytes, a path or a URL)"
        )


# ---- LoRA ----------------------------------------------------------------------------------------------
def test_lora_cells_nested_without_end_are_their_rows_errors(tiny_llama):
    cells = [None, far_nested("list"), far_nested("dict"), nested(3, "list", "x")]
    df = pd.DataFrame({"q": ["a", "b", "c", "d"], "ad": objects(cells)})
    out = df.llm.generate("{q}", model=str(tiny_llama), lora="ad", sampling_params=SP, **ENGINE)
    what = "not an adapter's path, URL or name"
    assert_rows(
        out,
        4,
        {
            1: f"lora: column 'ad' holds a list nested more than {MAX_NESTING_DEPTH} levels deep, {what}",
            2: f"lora: column 'ad' holds a dict nested more than {MAX_NESTING_DEPTH} levels deep, {what}",
            3: f"lora: column 'ad' holds [[['x']]], {what}",
        },
        "generated_text",
    )


# ---- a structured output's schema reaching the response cache's key ----------------------------------------
@SETTINGS
@given(
    depth=st.one_of(st.integers(MAX_NESTING_DEPTH + 1, 200), st.integers(900, 990)),
    kind=st.sampled_from(["array", "object"]),
)
def test_a_rows_schema_nested_too_deep_with_a_response_cache(tiny_llama, tmp_path, depth, kind):
    """The cache's key walks every field of a request (two frames a level): a schema nested
    33 to 990 levels (which the schema's own JSON round trip read) failed the partition there."""
    schema: dict = {"type": "string"}
    for _ in range(depth if kind == "array" else depth // 2):
        schema = (
            {"type": "array", "items": schema}
            if kind == "array"
            else {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        )
    sp = objects([None, {**SP, "structured_outputs": {"json": schema}}, None])
    df = pd.DataFrame({"q": ["a", "b", "c"], "sp": sp})
    out = df.llm.generate("{q}", model=str(tiny_llama), sampling_params="sp", cache=str(tmp_path), **ENGINE)
    assert_rows(out, 3, {1: f"sampling_params: structured_outputs.json {LIMIT}"}, "generated_text")


# ---- Polars: a column nested past what Arrow holds ----------------------------------------------------------
@pytest.mark.parametrize("depth", [100, 500])
def test_a_polars_column_arrow_cannot_hold_is_refused_by_name(tiny_llama, depth):
    """Arrow (Polars' way to pandas) holds 64 levels; past Python's limit (500 levels: Polars
    is slow to build deeper ones) the column's type has no text (its message raised
    ``RecursionError``), and before that its text ran to thousands of characters: the message
    names the column, briefly."""
    frame = pl.DataFrame({"q": ["a", "b"], "deep": [nested(depth, "list", "x"), None]})
    model = str(tiny_llama)
    calls = [lambda: frame.llm.judge("{q} is true", model=model, **SEMANTIC_ENGINE)]
    if depth < 500:  # the same refusal on the accessor's own path (each call converts the column again)
        calls.append(lambda: frame.llm.generate("{deep}", model=model, sampling_params=SP, **ENGINE))
    for call in calls:
        with pytest.raises(ValueError, match=r"^column\(s\) 'deep' \(") as info:
            call()
        assert "cannot go through Arrow to pandas" in str(info.value) and len(str(info.value)) < 600


def test_a_polars_column_arrow_holds_comes_back_as_it_was(tiny_llama):
    kept = [nested(40, "list", "x"), None]
    frame = pl.DataFrame({"q": ["a", "b"], "deep": kept})
    out = frame.llm.judge("{q} is true", model=str(tiny_llama), **SEMANTIC_ENGINE)
    assert out["deep"].to_list() == kept and out["llm_error"].null_count() == 2


# ---- semantic operators ------------------------------------------------------------------------------------
def test_semantic_operators_with_cells_nested_without_end(tiny_llama):
    """A templated column's deep cell is its row's error naming the column; a deep cell in a
    column no prompt reads comes back as it was."""
    far_list, far_dict = far_nested("list"), far_nested("dict")
    df = pd.DataFrame(
        {
            "id": range(3),
            "review": objects(["late parcel", far_list, far_dict]),
            "extra": objects([far_dict, 1, far_list]),
        }
    )
    topics = pd.DataFrame({"topic_id": [10, 11], "topic": objects(["shipping", far_list])})
    model, holds = str(tiny_llama), "column 'review' holds a"
    judged = df.llm.judge("{review} is about shipping", model=model, **SEMANTIC_ENGINE)
    assert list(judged["id"]) == [0, 1, 2] and judged["extra"][0] is far_dict and judged["extra"][2] is far_list
    assert pd.isna(judged["llm_error"][0]) and judged["llm_error"][1].startswith(f"{holds} list")
    assert judged["llm_error"][2].startswith(f"{holds} dict")
    extracted = df.llm.extract("{review}", {"topic": "str"}, model=model, sampling_params=SP, **SEMANTIC_ENGINE)
    assert list(extracted["id"]) == [0, 1, 2] and extracted["llm_error"][1].startswith(f"{holds} list")
    joined = df.llm.join(topics, "{review} is about {topic}", model=model, **SEMANTIC_ENGINE)
    errors = [e for e in joined["llm_error"] if isinstance(e, str)]
    assert any(e.startswith(f"left index 1: {holds} list") for e in errors)
    assert any(e.startswith("right index 1: column 'topic' holds a list") for e in errors)
    summary = df.llm.agg("Summarise {review}", model=model, max_tokens=2, **SEMANTIC_ENGINE)
    assert len(summary) == 1 and "review" in summary["llm_error"][0]


class _Unreadable(dict):
    """A mapping whose items cannot be read (a user's Mapping subclass that raises)."""

    def keys(self):
        raise RuntimeError("no keys today")

    def __iter__(self):
        raise RuntimeError("no keys today")


def test_a_params_cell_whose_items_cannot_be_read_is_its_rows_error(tiny_llama):
    df = pd.DataFrame({"q": ["a b", "c d"], "sp": objects([_Unreadable(max_tokens=2), {"max_tokens": 2}])})
    task = make_task(
        "generate",
        ("q",),
        list(df.columns),
        output_column=OUT,
        model=str(tiny_llama),
        sampling_params="sp",
        engine_kwargs=ENGINE,
    )
    out = run_task(df, task)
    assert out["llm_error"][0].startswith("sampling_params: a dict of SamplingParams fields that cannot be read")
    assert pd.isna(out["llm_error"][1]) and isinstance(out[OUT][1], str)
