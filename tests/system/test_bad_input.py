"""Bad input, catalogued: every kind of bad input dfllm is expected to meet, and what it does.

Two behaviours only:

- a bad *row* gets a null output and a message in ``llm_error`` naming the problem, and
  costs no other row anything: the good rows of the same frame get exactly the output they
  get when run alone, and the frame keeps its row count, order and index;
- a bad *call* (argument, template, sampling params, model directory) raises a clear
  exception before any row is generated.

Row cases run through pandas and Dask (synchronous scheduler; one test on a real
LocalCluster), a few through Polars, and the LLM methods are checked directly.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import threading
from dataclasses import dataclass, field

import dask
import dask.dataframe as dd
import pandas as pd
import polars as pl
import pyarrow as pa
import pytest

import dfllm  # noqa: F401  (registers the accessors)
from dfllm import LLM, SamplingParams

SP = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
ENGINE = dict(max_model_len=64, kv_cache_memory_bytes=2**22)  # as tests/accessors/test_accessors.py: one shared engine
GOOD = ["What is 2+2?", "Name a colour."]
GOOD_CONV = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
]
BINARY = pd.ArrowDtype(pa.binary())


@pytest.fixture(scope="module")
def kw(tiny_llama):
    return dict(model=str(tiny_llama), **ENGINE)


@pytest.fixture(scope="module")
def alone(tiny_llama):
    """Greedy texts of good prompts/conversations run on their own, in a separate engine."""
    llm = LLM(tiny_llama, **ENGINE)
    cache: dict = {}

    def run(kind: str, item) -> str:
        key = (kind, json.dumps(item))
        if key not in cache:
            call = llm.generate if kind == "generate" else llm.chat
            cache[key] = call([item], SamplingParams(**SP), use_tqdm=False)[0].outputs[0].text
        return cache[key]

    return run


# ---- the catalogue: bad rows ------------------------------------------------------------------------------
@dataclass
class RowCase:
    """A frame ``[good, bad, good]``: the bad row gets ``error`` (a substring) in llm_error."""

    id: str
    bad: object
    error: str
    kind: str = "generate"  # generate (text column), binary (binary column), template, chat, sampling
    extra: dict = field(default_factory=dict)


LONG = "word " * 400  # ~400 tokens, far past max_model_len=64

ROW_CASES = [
    # text column
    RowCase("null-None", None, "column 'q' is null"),
    RowCase("null-NaN", math.nan, "column 'q' is null"),
    RowCase("null-pd.NA", pd.NA, "column 'q' is null"),
    RowCase("empty-string", "", "column 'q' is empty"),
    RowCase("whitespace-only", " \t\n  ", "column 'q' is empty"),
    RowCase("int", 42, "column 'q' is not a string (int)"),
    RowCase("float", 3.5, "column 'q' is not a string (float)"),
    RowCase("bool", True, "column 'q' is not a string (bool)"),
    RowCase("list", ["a", "b"], "column 'q' is not a string (list)"),
    RowCase("dict", {"text": "hi"}, "column 'q' is not a string (dict)"),
    RowCase("lone-high-surrogate", "abc\ud800def", "not valid Unicode: lone surrogate '\\ud800' at character 3"),
    RowCase("lone-low-surrogate", "\udfff", "not valid Unicode: lone surrogate '\\udfff' at character 0"),
    RowCase("past-context-length", LONG, "tokens, longer than max_model_len=64"),
    # binary column (bytes are read as UTF-8)
    RowCase("binary-invalid-utf8", b"\xff\xfe bad", "not valid UTF-8: byte 0xff at offset 0", "binary"),
    RowCase("binary-truncated-utf8", b"caf\xc3", "not valid UTF-8: byte 0xc3 at offset 3", "binary"),
    RowCase("binary-encoded-surrogate", b"x\xed\xa0\x80", "not valid UTF-8: byte 0xed at offset 1", "binary"),
    RowCase("binary-null", None, "column 'q' is null", "binary"),
    RowCase("binary-empty", b"", "column 'q' is empty", "binary"),
    # template "Q: {q} ({topic})": a bad cell in any column it names
    RowCase("template-null-cell", None, "column 'topic' is null", "template"),
    RowCase("template-list-cell", [1, 2], "column 'topic' holds a list; templates format text, numbers", "template"),
    RowCase("template-nan-cell", math.nan, "column 'topic' is null", "template"),
    RowCase("template-format-spec-misfit", "x" * 3, "template 'Q: {q:>{topic}}': ", "template-width"),
    # chat: a column of conversations
    RowCase("chat-missing-role", [{"content": "hi"}], "message 0: role must be one of", "chat"),
    RowCase("chat-unknown-role", [{"role": "wizard", "content": "hi"}], "got 'wizard'", "chat"),
    RowCase(
        "chat-content-int",
        [{"role": "user", "content": 5}],
        "content must be a str or a list of text parts, got int",
        "chat",
    ),
    RowCase("chat-content-null", [{"role": "user", "content": None}], "content must be a str", "chat"),
    RowCase(
        "chat-content-image-part",
        [{"role": "user", "content": [{"type": "image", "url": "x.png"}]}],
        "this model takes no images",
        "chat",
    ),
    RowCase(
        "chat-content-surrogate", [{"role": "user", "content": "hi \ud83d"}], "content is not valid Unicode", "chat"
    ),
    RowCase("chat-message-not-dict", ["hello"], "a message must be a dict, got str", "chat"),
    RowCase("chat-empty-conversation", [], "must be a non-empty list of messages", "chat"),
    RowCase(
        "chat-string-not-conversation", "hello", "the conversation is a string that is neither JSON nor a list", "chat"
    ),
    RowCase("chat-string-holding-a-dict", '{"role": "user"}', "the conversation is a string holding dict", "chat"),
    RowCase(
        "chat-string-nested-past-pythons-limit",
        "[" * 100_000 + "]" * 100_000,
        "the conversation is a string nested too deeply to read",
        "chat",
    ),
    RowCase("chat-null-conversation", None, "the conversation is null", "chat"),
    RowCase("chat-past-context-length", [{"role": "user", "content": LONG}], "longer than max_model_len=64", "chat"),
    # a column of per-row sampling params (dicts)
    RowCase("sp-max-tokens-zero", {"max_tokens": 0}, "max_tokens must be >= 1, got 0", "sampling"),
    RowCase("sp-max-tokens-negative", {"max_tokens": -5}, "max_tokens must be >= 1, got -5", "sampling"),
    RowCase("sp-temperature-nan", {"temperature": math.nan}, "temperature must be finite", "sampling"),
    RowCase("sp-temperature-negative", {"temperature": -0.5}, "temperature must be >= 0.0", "sampling"),
    RowCase("sp-top-p-zero", {"top_p": 0.0}, "top_p must be in (0.0, 1.0]", "sampling"),
    RowCase("sp-top-p-above-one", {"top_p": 1.5}, "top_p must be in (0.0, 1.0]", "sampling"),
    RowCase("sp-stop-empty-string", {"stop": ["", "x"]}, "every stop string must be a non-empty str", "sampling"),
    RowCase("sp-unknown-field", {"temprature": 0.5}, "unknown field(s) ['temprature']", "sampling"),
    RowCase(
        "sp-text-not-a-dict", "greedy please", "a string that is neither JSON nor a dict of SamplingParams", "sampling"
    ),
    RowCase("sp-text-holding-a-list", "[0.5]", "a string holding list, not a dict of SamplingParams", "sampling"),
    RowCase("sp-json-bad-field", '{"max_tokens": 0}', "max_tokens must be >= 1, got 0", "sampling"),
    RowCase("sp-not-a-dict", 7, "must be a dict of SamplingParams fields, got int", "sampling"),
    RowCase("sp-n-above-one", {"n": 2, "temperature": 1.0}, "n must be 1 in a dataframe", "sampling"),
    RowCase(
        "sp-logprobs-past-vocab",
        {"logprobs": 10**9, **SP},
        "logprobs=1000000000 exceeds the model's vocabulary",
        "sampling",
    ),
]


def case_frame(case: RowCase, index) -> tuple[pd.DataFrame, dict]:
    """``[good, bad, good]`` with ``index``, and the accessor call's arguments."""
    if case.kind == "generate":
        df, args = pd.DataFrame({"q": pd.Series([GOOD[0], case.bad, GOOD[1]], dtype=object)}), {"prompt": "q"}
    elif case.kind == "binary":
        values = [GOOD[0].encode(), case.bad, GOOD[1].encode()]
        df, args = pd.DataFrame({"q": pd.array(values, dtype=BINARY)}), {"prompt": "q"}
    elif case.kind == "template":
        df = pd.DataFrame(
            {"q": [GOOD[0], "unused", GOOD[1]], "topic": pd.Series(["math", case.bad, "art"], dtype=object)}
        )
        args = {"prompt": "Q: {q} ({topic})"}
    elif case.kind == "template-width":  # a width taken from a column: "xxx" is no width
        df = pd.DataFrame({"q": [GOOD[0], "unused", GOOD[1]], "topic": ["1", case.bad, "2"]})
        args = {"prompt": "Q: {q:>{topic}}"}
    elif case.kind == "chat":
        df = pd.DataFrame({"c": pd.Series([GOOD_CONV[0], case.bad, GOOD_CONV[1]], dtype=object)})
        args = {"messages": "c"}
    elif case.kind == "sampling":
        df = pd.DataFrame(
            {"q": [GOOD[0], GOOD[0], GOOD[1]], "sp": pd.Series([dict(SP), case.bad, dict(SP)], dtype=object)}
        )
        args = {"prompt": "q", "sampling_params": "sp"}
    else:
        raise AssertionError(case.kind)
    df.index = index
    return df, args


def good_expected(case: RowCase, alone) -> list[str]:
    if case.kind == "chat":
        return [alone("chat", c) for c in GOOD_CONV]
    if case.kind == "template":
        return [alone("generate", "Q: What is 2+2? (math)"), alone("generate", "Q: Name a colour. (art)")]
    if case.kind == "template-width":
        return [alone("generate", f"Q: {p}") for p in GOOD]
    return [alone("generate", p) for p in GOOD]


def call(frame, kw: dict, args: dict, **extra):
    args = dict(args)
    if "messages" in args:
        return frame.llm.chat(args.pop("messages"), sampling_params=SP, **kw, **extra)
    sampling = args.pop("sampling_params", SP)
    return frame.llm.generate(args.pop("prompt"), sampling_params=sampling, **kw, **extra)


def check_result(out: pd.DataFrame, df: pd.DataFrame, case: RowCase, alone) -> None:
    assert len(out) == 3 and list(out.index) == list(df.index)  # count, order, index (duplicates too)
    assert list(out.columns[: len(df.columns)]) == list(df.columns)
    errors = out["llm_error"].tolist()
    assert pd.isna(errors[0]) and pd.isna(errors[2]), errors
    assert isinstance(errors[1], str) and case.error in errors[1], errors[1]
    assert pd.isna(out["generated_text"].iloc[1]) and pd.isna(out["num_generated_tokens"].iloc[1])
    assert [out["generated_text"].iloc[0], out["generated_text"].iloc[2]] == good_expected(case, alone)
    assert out["num_generated_tokens"].iloc[[0, 2]].tolist() == [4, 4]


@pytest.mark.parametrize("case", ROW_CASES, ids=[c.id for c in ROW_CASES])
def test_bad_row_pandas(case, kw, alone):
    df, args = case_frame(case, index=[7, 7, 3])  # duplicate index values, not sorted
    check_result(call(df, kw, args), df, case, alone)


def test_extra_args_nested_without_end_is_the_rows_error(kw, alone):
    """Every key of a request (deduplication, the response cache) walks its params: a row's
    extra_args nested past Python's recursion limit failed its partition. Pandas only: Dask
    cannot tokenize such a cell to build a frame."""
    case = RowCase(
        "sp-extra-args-nested-without-end",
        {"extra_args": {"a": functools.reduce(lambda x, _: [x], range(100_000), 1)}, **SP},
        "extra_args must be nested at most 32 levels deep",
        "sampling",
    )
    df, args = case_frame(case, index=[7, 7, 3])
    check_result(call(df, kw, args), df, case, alone)


def from_pandas(df: pd.DataFrame, npartitions: int) -> dd.DataFrame:
    """``dd.from_pandas`` keeping object columns as they are: by default Dask turns them into
    Arrow strings, so a Dask frame would never hold the non-string values these cases test."""
    with dask.config.set({"dataframe.convert-string": False}):
        return dd.from_pandas(df, npartitions=npartitions, sort=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", ROW_CASES, ids=[c.id for c in ROW_CASES])
def test_bad_row_dask(case, kw, alone):
    df, args = case_frame(case, index=[0, 1, 2])
    ddf = from_pandas(df, npartitions=2)  # the bad row shares a partition with a good one
    out = call(ddf, kw, args)
    assert out.npartitions == 2
    check_result(out.compute(scheduler="synchronous"), df, case, alone)


@pytest.mark.parametrize("case", [c for c in ROW_CASES if c.kind in ("generate", "sampling")][:4], ids=lambda c: c.id)
def test_on_error_raise_names_the_row(case, kw):
    df, args = case_frame(case, index=[0, 1, 2])
    with pytest.raises(ValueError, match="row 1 of the partition"):
        call(df, kw, args, on_error="raise")


def test_every_bad_row_in_one_frame(kw, alone):
    """All the bad text rows at once, between good ones: each good row still gets its own output."""
    cases = [c for c in ROW_CASES if c.kind == "generate"]
    values = [GOOD[(i // 2) % 2] if i % 2 == 0 else cases[i // 2].bad for i in range(2 * len(cases))] + [GOOD[1]]
    df = pd.DataFrame({"q": pd.Series(values, dtype=object)})
    df.index = [f"r{i}" for i in range(len(values))]
    out = df.llm.generate("q", sampling_params=SP, **kw)
    assert list(out.index) == list(df.index)
    for i, v in enumerate(values):
        if i % 2 == 0 or i == len(values) - 1:
            assert pd.isna(out.llm_error.iloc[i]) and out.generated_text.iloc[i] == alone("generate", v)
        else:
            assert cases[i // 2].error in out.llm_error.iloc[i]


def test_a_bad_conversation_is_its_rows_not_a_place_in_the_partition(kw, alone):
    """A row's error is its own: it says "the conversation", never "conversation 2" (the row's
    place in its partition, which is no label the user has)."""
    convs = [GOOD_CONV[0], GOOD_CONV[1], [{"role": "robot", "content": "x"}], []]
    df = pd.DataFrame({"m": pd.Series(convs, dtype=object, index=["a", "b", "c", "d"])})
    for frame in (df, dd.from_pandas(df, npartitions=2)):
        out = frame.llm.chat("m", sampling_params=SP, **kw)
        out = out.compute() if isinstance(out, dd.DataFrame) else out
        assert out.loc["c", "llm_error"].startswith("messages: the conversation, message 0: role must be one of")
        assert out.loc["d", "llm_error"] == "messages: the conversation must be a non-empty list of messages"
        assert [out.loc[k, "generated_text"] for k in "ab"] == [alone("chat", c) for c in GOOD_CONV]


def test_null_sampling_params_row_means_defaults(kw):
    """A null in a sampling-params column (None, NaN, NA) is no error: that row uses the defaults."""
    df = pd.DataFrame({"q": GOOD + GOOD[:1], "sp": pd.Series([None, math.nan, pd.NA], dtype=object)})
    out = df.llm.generate("q", sampling_params="sp", **kw)
    assert out.llm_error.isna().all()
    assert all(1 <= n <= SamplingParams().max_tokens for n in out.num_generated_tokens)


# ---- frame shapes ---------------------------------------------------------------------------------------
def test_empty_dataframe(kw):
    df = pd.DataFrame({"q": pd.Series([], dtype=object)})
    out = df.llm.generate("q", sampling_params=SP, **kw)
    assert len(out) == 0
    assert list(out.columns) == [
        "q",
        "generated_text",
        "num_input_tokens",
        "num_generated_tokens",
        "finish_reason",
        "llm_error",
    ]
    assert str(out.dtypes["num_generated_tokens"]) == "int64[pyarrow]"


def test_dask_frame_of_empty_partitions(kw):
    """Dask cannot build a frame with zero partitions (``from_delayed([])`` and ``from_map`` refuse);
    the nearest thing, partitions holding no rows, gives an empty typed result."""
    df = pd.DataFrame({"q": ["a", "b", "c", "d"]})
    empty = dd.from_pandas(df, npartitions=3)
    empty = empty[empty.q == "no such row"]
    out = empty.llm.generate("q", sampling_params=SP, **kw)
    result = out.compute(scheduler="synchronous")
    assert len(result) == 0 and out.npartitions == 3
    assert result.dtypes.to_dict() == out._meta.dtypes.to_dict()


def test_duplicate_and_string_index_preserved(kw, alone):
    df = pd.DataFrame({"q": GOOD + GOOD}, index=["a", "a", "b", "a"])
    out = df.llm.generate("q", sampling_params=SP, **kw)
    assert list(out.index) == ["a", "a", "b", "a"]
    assert out.generated_text.tolist() == [alone("generate", p) for p in GOOD + GOOD]
    ddf = dd.from_pandas(pd.DataFrame({"q": GOOD * 3}, index=[5, 5, 5, 1, 1, 0]), npartitions=3, sort=False)
    got = ddf.llm.generate("q", sampling_params=SP, **kw).compute(scheduler="synchronous")
    assert list(got.index) == [5, 5, 5, 1, 1, 0]
    assert got.generated_text.tolist() == [alone("generate", p) for p in GOOD * 3]


# ---- the catalogue: bad calls, refused before any work --------------------------------------------------
@dataclass
class CallCase:
    id: str
    args: dict
    error: str
    exc: type = ValueError


CALL_CASES = [
    CallCase("template-missing-column", dict(prompt="Q: {missing}"), r"column\(s\) \['missing'\] not in the dataframe"),
    CallCase("column-missing", dict(prompt="nope"), r"column\(s\) \['nope'\] not in the dataframe"),
    CallCase("template-unclosed-brace", dict(prompt="Q: {q"), "bad template"),
    CallCase("template-positional", dict(prompt="Q: {}"), "placeholders must name columns"),
    CallCase("template-attribute-access", dict(prompt="{q.__class__}"), r"\{q.__class__\} is not a plain column name"),
    CallCase("template-item-access", dict(prompt="{q[0]}"), r"\{q\[0\]\} is not a plain column name"),
    CallCase("template-nested-attribute", dict(prompt="{q:{q.__class__.__init__}}"), "is not a plain column name"),
    CallCase("template-nested-missing-column", dict(prompt="{q:>{width}}"), r"column\(s\) \['width'\] not in"),
    CallCase("template-unknown-conversion", dict(prompt="{q!x}"), "unknown conversion !x"),
    CallCase("template-lone-surrogate", dict(prompt="Q\ud800: {q}"), "not valid Unicode: lone surrogate"),
    CallCase("prompt-not-a-string", dict(prompt=3), "expected a column name or a template string, got int"),
    CallCase("max-tokens-zero", dict(sampling_params={"max_tokens": 0}), "max_tokens must be >= 1, got 0"),
    CallCase("max-tokens-negative", dict(sampling_params={"max_tokens": -1}), "max_tokens must be >= 1, got -1"),
    CallCase("temperature-nan", dict(sampling_params={"temperature": math.nan}), "temperature must be finite"),
    CallCase("temperature-negative", dict(sampling_params={"temperature": -1.0}), r"temperature must be >= 0.0"),
    CallCase("top-p-zero", dict(sampling_params={"top_p": 0.0}), r"top_p must be in \(0.0, 1.0\]"),
    CallCase("top-p-above-one", dict(sampling_params={"top_p": 1.01}), r"top_p must be in \(0.0, 1.0\]"),
    CallCase("stop-empty-string", dict(sampling_params={"stop": [""]}), "every stop string must be a non-empty str"),
    CallCase("stop-list-with-empty", dict(sampling_params={"stop": ["\n", ""]}), "non-empty str"),
    CallCase("n-above-one", dict(sampling_params={"n": 3, "temperature": 0.7}), "n must be 1 in a dataframe"),
    CallCase("unknown-sampling-field", dict(sampling_params={"max_token": 3}), r"unknown field\(s\) \['max_token'\]"),
    CallCase("sampling-column-missing", dict(sampling_params="sp"), "sampling_params column 'sp' not in the dataframe"),
    CallCase("on-error-unknown", dict(on_error="skip"), "on_error must be one of"),
    CallCase("output-column-clash", dict(output_column="q"), "already exist"),
    CallCase(
        "unknown-model", dict(model="no/such/model-dir"), "not a bundled model alias and not an existing directory"
    ),
]


@pytest.mark.parametrize("frame", ["pandas", "dask", "polars"])
@pytest.mark.parametrize("case", CALL_CASES, ids=[c.id for c in CALL_CASES])
def test_bad_call_raises_before_work(case, frame, kw):
    df = pd.DataFrame({"q": GOOD})
    obj = {
        "pandas": lambda: df,
        "dask": lambda: dd.from_pandas(df, npartitions=1),
        "polars": lambda: pl.from_pandas(df),
    }[frame]()
    args = {**kw, **case.args}
    prompt = args.pop("prompt", "q")
    with pytest.raises(case.exc, match=case.error):
        obj.llm.generate(prompt, **{"sampling_params": SP, **args})  # a Dask result is not even built


# ---- bad model directories -------------------------------------------------------------------------------
def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _model_missing_weights(src, root):
    p = _copy(src, root / "missing")
    (p / "model.safetensors").unlink()
    return p


def _model_corrupt_weights(src, root):
    p = _copy(src, root / "corrupt")
    (p / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    return p


def _model_truncated_weights(src, root):
    p = _copy(src, root / "truncated")
    data = (p / "model.safetensors").read_bytes()
    (p / "model.safetensors").write_bytes(data[: len(data) // 2])
    return p


def _model_unsupported_arch(src, root):
    p = _copy(src, root / "arch")
    cfg = json.loads((p / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (p / "config.json").write_text(json.dumps(cfg))
    return p


def _model_pickle_only(src, root):
    p = _copy(src, root / "pickle")
    (p / "model.safetensors").unlink()
    (p / "pytorch_model.bin").write_bytes(b"\x80\x04 never unpickled")
    return p


def _model_no_config(src, root):
    p = _copy(src, root / "noconfig")
    (p / "config.json").unlink()
    return p


def _model_broken_config(src, root):
    p = _copy(src, root / "badjson")
    (p / "config.json").write_text("{ not json")
    return p


MODEL_CASES = [
    ("missing-safetensors", _model_missing_weights, FileNotFoundError, r"has no \*\.safetensors weights"),
    ("corrupt-safetensors", _model_corrupt_weights, ValueError, "cannot read weights file model.safetensors"),
    ("truncated-safetensors", _model_truncated_weights, ValueError, "weights file model.safetensors"),
    ("unsupported-architecture", _model_unsupported_arch, ValueError, "unsupported architecture.*GPTNeoXForCausalLM"),
    ("pickle-only-weights", _model_pickle_only, ValueError, "holds only pickle weights.*never unpickles"),
    ("no-config-json", _model_no_config, FileNotFoundError, "has no config.json"),
    ("config-not-json", _model_broken_config, ValueError, "config.json"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,make,exc,match", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_bad_model_directory(name, make, exc, match, tiny_llama, tmp_path):
    path = make(tiny_llama, tmp_path)
    with pytest.raises(exc, match=match):
        LLM(path, **ENGINE)
    df = pd.DataFrame({"q": GOOD})
    for frame in (df, dd.from_pandas(df, npartitions=2), pl.from_pandas(df)):
        with pytest.raises(exc, match=match):  # at call time: a Dask graph is not even built
            frame.llm.generate("q", model=str(path), sampling_params=SP, **ENGINE)


# ---- Polars ------------------------------------------------------------------------------------------------
def test_polars_bad_rows(kw, alone):
    df = pl.DataFrame(
        {"q": [GOOD[0], None, "   ", GOOD[1]], "b": [GOOD[0].encode(), b"\xc3\x28", None, GOOD[1].encode()]}
    )
    out = df.llm.generate("q", sampling_params=SP, **kw)
    assert out.height == 4 and out["q"].to_list() == df["q"].to_list()
    assert out["llm_error"].to_list()[1:3] == ["column 'q' is null", "column 'q' is empty"]
    assert out["generated_text"].to_list()[::3] == [alone("generate", p) for p in GOOD]
    binary = df.llm.generate("b", sampling_params=SP, **kw)
    assert "not valid UTF-8: byte 0xc3 at offset 0" in binary["llm_error"][1]
    assert binary["llm_error"][2] == "column 'b' is null"
    assert binary["generated_text"].to_list()[::3] == [alone("generate", p) for p in GOOD]
    empty = df.head(0).llm.generate("q", sampling_params=SP, **kw)
    assert empty.height == 0 and empty.schema["generated_text"] == pl.String
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        df.lazy().llm.generate("q", sampling_params={"max_tokens": 0}, **kw)


# ---- LLM methods directly: a bad prompt raises naming it, before any work -----------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, **ENGINE)


@pytest.mark.parametrize(
    "prompts,params,match",
    [
        (["ok", "bad \ud800"], None, r"prompt 1 is not valid Unicode: lone surrogate"),
        ([{"prompt": "\udc00"}], None, r"prompt 0 is not valid Unicode"),
        (None, None, "prompts must be a str, a dict or a list of them, got NoneType"),
        (["ok", None], None, "prompt 1: expected a str"),
        (["ok", b"bytes"], None, "prompt 1: expected a str"),
        (["ok", ""], None, "prompt 1 is empty"),
        (["ok", "word " * 200], None, "prompt 1 has .* tokens, longer than max_model_len=64"),
        (["ok", "fine"], [SamplingParams(), SamplingParams(logprobs=10**6)], "prompt 1: logprobs=1000000 exceeds"),
    ],
)
def test_llm_generate_refuses_before_work(llm, prompts, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.get_num_unfinished_requests() == 0  # no request was queued
    assert llm.generate("ok", SamplingParams(**SP), use_tqdm=False)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "messages,match",
    [
        ([{"role": "user", "content": "x \ud800"}], "conversation 0, message 0: content is not valid Unicode"),
        ([{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}], "content is not valid Unicode"),
        ([[{"role": "user", "content": "ok"}], [{"role": "robot", "content": "x"}]], "conversation 1, message 0: role"),
        ([{"role": "user"}], "content must be a str"),
    ],
)
def test_llm_chat_refuses_before_work(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, SamplingParams(**SP), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def embedder():
    return LLM("all-minilm-l6-v2")


@pytest.mark.parametrize(
    "prompts,match",
    [
        (["ok", "\ud800"], r"prompt 1 is not valid Unicode"),
        (["ok", None], "prompt 1: expected a str"),
        ([{"prompt_token_ids": [1, 10**8]}], "token id 100000000 is outside the model's vocabulary"),
    ],
)
def test_llm_embed_refuses_bad_prompts(embedder, prompts, match):
    with pytest.raises(ValueError, match=match):
        embedder.embed(prompts, use_tqdm=False)


def test_embed_and_score_bad_rows(embedder):
    df = pd.DataFrame(
        {
            "a": pd.Series(["Paris is in France.", "\ud800", None, "Trains"], dtype=object),
            "b": ["The capital of France", "x", "y", "Rails"],
        }
    )
    emb = df.llm.embed("a")
    assert "not valid Unicode" in emb.llm_error[1] and "is null" in emb.llm_error[2]
    ref = embedder.embed(["Paris is in France.", "Trains"], use_tqdm=False)
    assert emb.embedding[0] == pytest.approx(ref[0].outputs.embedding, abs=1e-6)
    assert emb.embedding[3] == pytest.approx(ref[1].outputs.embedding, abs=1e-6)
    with pytest.raises(ValueError, match=r"score data_2\[0\] is not valid Unicode"):
        embedder.score("ok", "\udfff", use_tqdm=False)


# ---- a step that fails inside the engine -----------------------------------------------------------------
class InjectedFault(RuntimeError):
    pass


def _raise(*_):
    raise InjectedFault("injected fault in the model's forward")


@pytest.mark.timeout(120)
def test_failed_step_is_reported_and_engine_recovers(kw, alone):
    """A step that raises (here a forward hook, installed through the public ``apply_model``)
    fails the calls whose rows were in it, clearly and without hanging, and leaves the
    engine serving the next call normally, in the LLM and in the dataframe path."""
    from dfllm.worker.engine_cache import get_engine

    shared = get_engine(kw["model"], ENGINE)
    hooks = shared.apply_model(lambda m: m.register_forward_hook(_raise))
    try:
        with pytest.raises(InjectedFault):
            shared.generate(GOOD, SamplingParams(**SP), use_tqdm=False)
        assert not shared.engine.has_unfinished_requests()
        results: list = []

        def run():
            try:
                results.append(pd.DataFrame({"q": GOOD}).llm.generate("q", sampling_params=SP, **kw))
            except Exception as exc:  # noqa: BLE001
                results.append(exc)

        t = threading.Thread(target=run)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the dataframe call hung after a failed engine step"
        assert (
            isinstance(results[0], RuntimeError)
            and "the engine failed while generating these rows" in str(results[0])
            and "injected fault" in str(results[0])
        )
    finally:
        for h in hooks:
            h.remove()
    assert shared.generate(GOOD[0], SamplingParams(**SP), use_tqdm=False)[0].outputs[0].text == alone(
        "generate", GOOD[0]
    )
    out = pd.DataFrame({"q": GOOD}).llm.generate("q", sampling_params=SP, **kw)
    assert out.generated_text.tolist() == [alone("generate", p) for p in GOOD]


@pytest.mark.timeout(120)
def test_failed_step_keeps_queued_requests(llm, alone):
    """A step that fails during ``generate`` drops no request queued with ``enqueue``: they
    are re-queued from scratch and ``wait_for_completion`` returns their outputs (those they
    would have had); if they fail again there, it raises an error naming them, with every
    output, and the engine serves on."""
    from dfllm.outputs import RequestFailedError

    queued = llm.enqueue(GOOD[0], SamplingParams(**SP))
    hooks = llm.apply_model(lambda m: m.register_forward_hook(_raise))
    try:
        with pytest.raises(InjectedFault):
            llm.generate(GOOD[1], SamplingParams(**SP), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == queued and outs[0].outputs[0].text == alone("generate", GOOD[0])
    assert not llm.engine.has_unfinished_requests()

    first, second = llm.enqueue(GOOD[0], SamplingParams(**SP)), llm.enqueue(GOOD[1], SamplingParams(**SP))
    hooks = llm.apply_model(lambda m: m.register_forward_hook(_raise))
    try:
        with pytest.raises(
            RequestFailedError,
            match=rf"2 of 2 requests failed.*request {first[0]}: the engine "
            rf"failed while serving request {first[0]}: InjectedFault",
        ) as info:
            llm.wait_for_completion(use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    assert [o.request_id for o in info.value.outputs] == first + second and info.value.failed == [0, 1]
    assert all(
        o.outputs[0].finish_reason == "error" and "injected fault" in o.outputs[0].error for o in info.value.outputs
    )
    assert not llm.engine.has_unfinished_requests()
    llm.enqueue(GOOD, SamplingParams(**SP))
    assert [o.outputs[0].text for o in llm.wait_for_completion(use_tqdm=False)] == [alone("generate", p) for p in GOOD]


# ---- Dask on a real cluster -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        with Client(cluster) as c:
            yield c


@pytest.mark.slow
def test_bad_rows_on_a_cluster(client, kw, alone):
    """Every bad text and chat row across the partitions of one frame, on worker processes:
    the same per-row results as pandas, every row back exactly once in order."""
    text = [c for c in ROW_CASES if c.kind == "generate"]
    values = []
    for i, c in enumerate(text):
        values += [GOOD[i % 2], c.bad]
    df = pd.DataFrame({"q": pd.Series(values, dtype=object), "id": range(len(values))})
    df.index = [i // 3 for i in range(len(values))]  # duplicates inside and across partitions
    ddf = from_pandas(df, npartitions=4)
    got = ddf.llm.generate("q", sampling_params=SP, **kw).compute()
    assert got["id"].tolist() == list(range(len(values))) and list(got.index) == list(df.index)
    for i, c in enumerate(text):
        assert got.generated_text.iloc[2 * i] == alone("generate", GOOD[i % 2])
        assert pd.isna(got.llm_error.iloc[2 * i]) and c.error in got.llm_error.iloc[2 * i + 1]
    conv = pd.DataFrame(
        {"c": pd.Series([GOOD_CONV[0], [{"role": "wizard", "content": "x"}], None, GOOD_CONV[1]], dtype=object)}
    )
    chat = from_pandas(conv, npartitions=2).llm.chat("c", sampling_params=SP, **kw).compute()
    assert chat.generated_text.tolist()[::3] == [alone("chat", c) for c in GOOD_CONV]
    assert "got 'wizard'" in chat.llm_error[1] and "is null" in chat.llm_error[2]


@pytest.mark.slow
def test_chat_template_rendering_nothing_for_some_rows(tiny_llama, tmp_path):
    """A model whose chat template renders only system messages: a conversation without one
    renders an empty prompt, a per-row error; the others are generated."""
    path = shutil.copytree(tiny_llama, tmp_path / "system-only")
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    convs = [
        [{"role": "system", "content": GOOD[0]}],
        [{"role": "user", "content": "no system turn"}],
        [{"role": "system", "content": GOOD[1]}, {"role": "user", "content": "x"}],
    ]
    df = pd.DataFrame({"c": pd.Series(convs, dtype=object)})
    out = df.llm.chat("c", model=str(path), sampling_params=SP, **ENGINE)
    assert "the prompt is empty" in out.llm_error[1] and out.llm_error[[0, 2]].isna().all()
    llm = LLM(path, **ENGINE)
    tok = llm.get_tokenizer()
    ref = llm.generate(
        [{"prompt_token_ids": tok.encode(g, add_special_tokens=False)} for g in GOOD],
        SamplingParams(**SP),
        use_tqdm=False,
    )
    assert out.generated_text[[0, 2]].tolist() == [r.outputs[0].text for r in ref]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.chat(convs, SamplingParams(**SP), use_tqdm=False)
