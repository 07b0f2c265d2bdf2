"""Structured outputs: JSON schema, regex, choice and grammar constraints, in the engine and as
typed dataframe columns. Every constrained output is parsed and validated here."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import dask.dataframe as dd
import jsonschema
import pandas as pd
import polars as pl
import pyarrow as pa
import pytest
from pydantic import BaseModel, Field

import dfllm  # noqa: F401  (registers the accessors)
from dfllm import LLM, SamplingParams, StructuredOutputsParams
from dfllm.errors import MAX_NESTING_DEPTH
from dfllm.tasks.schema import arrow_type

# Bounded, so that even a random model's output completes within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
        "digits": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        "word": {"type": "string", "maxLength": 6},
        "inner": {
            "type": "object",
            "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}},
            "required": ["x"],
        },
    },
    "required": ["ok", "n", "tag", "digits", "word", "inner"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,5}@[a-z]{2,4}\.(com|org)"
CHOICE = ["yes", "no", 'maybe "so"', "multi\nline"]
GRAMMAR = 'root ::= "(" num " " op " " num ")"\nnum ::= [0-9] | [1-9] [0-9]\nop ::= "+" | "-" | "*"'
GRAMMAR_RE = r"\((\d|[1-9]\d) [+\-*] (\d|[1-9]\d)\)"


def check(kind: str, text: str) -> None:
    """Fail unless ``text`` satisfies the constraint ``kind`` in full."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICE, text
    elif kind == "grammar":
        assert re.fullmatch(GRAMMAR_RE, text), text


CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICE),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}


# ---- parameters ------------------------------------------------------------------------------------------
class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


def test_params_take_exactly_one_valid_constraint():
    assert StructuredOutputsParams(json=Person).json == Person.model_json_schema()
    assert StructuredOutputsParams(json=json.dumps(SCHEMA)) == StructuredOutputsParams(json=SCHEMA)
    sp = SamplingParams.from_dict({"structured_outputs": {"choice": ["a", "b"]}})
    assert sp.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    assert hash(sp.structured_outputs) == hash(StructuredOutputsParams(choice=["a", "b"]))
    bad = [
        ({}, "exactly one"),
        (dict(regex="a", choice=["a"]), "exactly one"),
        (dict(regex="(a"), "regex"),
        (dict(choice=[]), "non-empty"),
        (dict(choice="ab"), "list of strings"),
        (dict(choice=["a", "a"]), "dup"),
        (dict(json={"type": "nonsense"}), "json"),
        (dict(json=int), "pydantic"),
        (dict(json="{nope"), "JSON"),
        (dict(grammar=" "), "grammar"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            StructuredOutputsParams(**kwargs)
    bad_grammar = StructuredOutputsParams(grammar="root ::= undefined_rule")  # refused per request, as vLLM does
    with pytest.raises(ValueError, match="structured_outputs.grammar: invalid grammar"):
        bad_grammar.check()
    with pytest.raises(ValueError, match="unknown"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")


# ---- engine, random model --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, max_model_len=256, kv_cache_memory_bytes=2**22)


PROMPTS = [[20 + (7 * i + 3 * j) % 900 for j in range(5 + 3 * i)] for i in range(10)]


# ---- vLLM's other constraints and options ---------------------------------------------------------------
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
LEGACY_TAG = json.dumps(
    {
        "type": "structural_tag",
        "triggers": ["<f="],
        "structures": [{"begin": "<f=weather>", "schema": WEATHER, "end": "</f>"}],
    }
)


@pytest.mark.slow
def test_json_object_structural_tag_and_options(llm):
    """vLLM's json_object (any JSON object), structural_tag (free text until a trigger, then
    the tagged JSON), disable_additional_properties and disable_any_whitespace, each held
    by the random model's output; whitespace_pattern and a bad tag are refused."""

    def run(so, max_tokens=48, seed=0):
        sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=so)
        return llm.generate([{"prompt_token_ids": PROMPTS[1]}], sp, use_tqdm=False)[0].outputs[0]

    obj = run(StructuredOutputsParams(json_object=True), max_tokens=200)
    if obj.structured_output_complete:
        assert isinstance(json.loads(obj.text), dict)
    else:  # a random model may not close the object in time: what it wrote is still a valid prefix
        assert obj.text.startswith("{") and obj.finish_reason == "length"
    closed = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "boolean"}}}, disable_additional_properties=True
    )
    assert closed.json["additionalProperties"] is False
    out = run(closed, max_tokens=24)
    assert out.structured_output_complete and set(json.loads(out.text)) <= {"a"}
    spaced = StructuredOutputsParams(json=WEATHER, disable_any_whitespace=False)
    assert spaced.key != StructuredOutputsParams(json=WEATHER).key and spaced.any_whitespace
    assert StructuredOutputsParams(json_object=False, regex="a").kind == "regex"
    # the compiled grammars accept exactly what they should (text fed token by token)
    tok = llm.get_tokenizer()

    def accepts(so, text: str) -> bool:
        matcher = llm.engine.input_processor.grammars.prepare(so).matcher()
        return all(matcher.accept(t) for t in tok.encode(text, add_special_tokens=False))

    tag = StructuredOutputsParams(structural_tag=LEGACY_TAG)
    assert accepts(tag, 'free text <f=weather>{"city": "Oslo"}</f> more text')
    assert not accepts(tag, 'free text <f=weather>{"town": 1}</f>')
    assert accepts(StructuredOutputsParams(json_object=True), '{"any": [1, 2, {"b": null}]}')
    assert not accepts(StructuredOutputsParams(json_object=True), "[1, 2]")
    assert accepts(StructuredOutputsParams(json=WEATHER), '{"city": "Oslo"}')  # one space after : and ,
    assert not accepts(StructuredOutputsParams(json=WEATHER), '{ "city" : "Oslo" }')
    assert accepts(spaced, '{ "city" : "Oslo" }')  # vLLM's default: any whitespace
    with pytest.raises(ValueError, match="whitespace_pattern is not supported"):
        StructuredOutputsParams(json=WEATHER, whitespace_pattern=r"[ ]?")
    with pytest.raises(ValueError, match="structural_tag"):
        StructuredOutputsParams(structural_tag="{not json")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json_object=True, regex="a")


def test_every_constraint_holds_in_a_mixed_batch(llm):
    """Greedy, seeded and unseeded sampled rows of every kind, next to unconstrained rows, in one batch."""
    free = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
    ]
    alone = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], free, use_tqdm=False)
    ]
    rows, params = [], []
    for k, (kind, so) in enumerate(CONSTRAINTS.items()):
        for j, sampling in enumerate([dict(temperature=0.0), dict(temperature=1.0, seed=k), dict(temperature=1.0)]):
            rows.append((kind, PROMPTS[(k + j) % len(PROMPTS)]))
            params.append(SamplingParams(max_tokens=80, structured_outputs=so, **sampling))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]] + [{"prompt_token_ids": p} for _, p in rows]
    outs = llm.generate(prompts, free + params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone  # unconstrained rows (greedy, seeded): as if alone
    assert all(o.outputs[0].structured_output_complete is None for o in outs[:2])
    for (kind, _), out in zip(rows, outs[2:]):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.structured_output_complete, (kind, c.text, c.finish_reason)
        assert c.token_ids[-1] in llm.engine.eos_token_ids  # the grammar ended it with end-of-sequence
        check(kind, c.text)
    # A random model left alone would not have written these: the mask did.
    plain = llm.generate(
        [{"prompt_token_ids": p} for _, p in rows], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False
    )
    assert sum(o.outputs[0].text.startswith("{") for o in plain) < 3


@pytest.mark.slow
def test_seeded_constrained_sample_is_reproducible_and_n_samples_differ(llm):
    so = CONSTRAINTS["json"]
    sp = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=80, structured_outputs=so, logprobs=2)
    first = llm.generate([{"prompt_token_ids": PROMPTS[3]}], sp, use_tqdm=False)[0]
    again = llm.generate(
        [{"prompt_token_ids": PROMPTS[3]}, {"prompt_token_ids": PROMPTS[4]}], [sp, sp], use_tqdm=False
    )[0]
    assert [c.text for c in first.outputs] == [c.text for c in again.outputs]
    assert len({c.text for c in first.outputs}) > 1
    for c in first.outputs:
        check("json", c.text)
        assert len(c.logprobs) == len(c.token_ids) and all(t in lp for t, lp in zip(c.token_ids, c.logprobs))


def test_max_tokens_before_completion_is_marked_incomplete(llm):
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}] * 2,
        [
            SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=CONSTRAINTS["json"]),
            SamplingParams(temperature=0.0, max_tokens=1, structured_outputs=CONSTRAINTS["grammar"]),
        ],
        use_tqdm=False,
    )
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "length" and c.structured_output_complete is False
    with pytest.raises(ValueError):
        json.loads(outs[0].outputs[0].text)
    assert outs[1].outputs[0].text == "("


@pytest.mark.slow
def test_preemption_and_chunked_prefill_keep_the_grammar_state(tiny_llama, llm):
    """A KV cache too small for the batch (recompute preemption) and a tiny token budget (chunked
    prefill) give exactly the constrained outputs of an unconstrained-resources run."""
    prompts = [{"prompt_token_ids": p * 4} for p in PROMPTS[4:10]]
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=so) for so in CONSTRAINTS.values()]
    params = (params * 2)[: len(prompts)]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    small = LLM(
        tiny_llama,
        max_model_len=256,
        max_num_batched_tokens=32,
        block_size=16,
        kv_cache_memory_bytes=20 * llm.engine.runner.block_bytes,
    )
    small.engine.scheduler.reserve_growth = False  # admit as vLLM does, so that the small cache preempts
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.stats().num_preemptions > 0
    assert [o.outputs[0].text for o in outs] == expected
    for kind, out in zip((list(CONSTRAINTS) * 2), outs):
        check(kind, out.outputs[0].text)


def test_each_distinct_constraint_compiles_once(llm):
    compiler = llm.engine.input_processor.grammars
    before = compiler.num_compiled
    sp = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs={"regex": "[0-9]{2}-[0-9]{2}"})
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], sp, use_tqdm=False)
    same = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs={"regex": "[0-9]{2}-[0-9]{2}"})
    llm.generate([{"prompt_token_ids": PROMPTS[5]}], same, use_tqdm=False)
    assert compiler.num_compiled == before + 1


# ---- engine, bundled SmolLM2 -----------------------------------------------------------------------------
class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population: int = Field(ge=0, le=10**9)


@pytest.fixture(scope="module")
def smol():
    return LLM(max_model_len=256, kv_cache_memory_bytes=2**25)


@pytest.mark.slow
def test_smollm2_json_choice_regex_with_free_chat(smol):
    q = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    convs = [
        q("Describe Paris as JSON with name, country and population."),
        q("Is the sky blue? Answer yes or no."),
        q("Write a time of day like 09:30."),
        q("What is the capital of France?"),
        q("Describe Tokyo as JSON."),
    ]
    free = SamplingParams(temperature=0.0, max_tokens=12)
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=City)),
        SamplingParams(temperature=0.0, max_tokens=5, structured_outputs={"choice": ["yes", "no"]}),
        SamplingParams(temperature=0.7, seed=0, max_tokens=10, structured_outputs={"regex": r"[0-2]\d:[0-5]\d"}),
        free,
        SamplingParams(temperature=0.7, seed=1, max_tokens=60, structured_outputs={"json": City}),
    ]
    outs = smol.chat(convs, params, use_tqdm=False)
    assert outs[3].outputs[0].text == smol.chat(convs[3], free, use_tqdm=False)[0].outputs[0].text
    for i in (0, 4):
        c = outs[i].outputs[0]
        assert c.structured_output_complete and c.finish_reason == "stop", c.text
        City.model_validate_json(c.text)
    assert outs[1].outputs[0].text in ("yes", "no")
    assert re.fullmatch(r"[0-2]\d:[0-5]\d", outs[2].outputs[0].text)


# ---- accessors: typed columns ----------------------------------------------------------------------------
SP = {"temperature": 0.0, "max_tokens": 80}


@pytest.fixture(scope="module")
def kw(tiny_llama):
    return dict(model=str(tiny_llama), max_model_len=128, kv_cache_memory_bytes=2**22)


@pytest.fixture(scope="module")
def frame():
    return pd.DataFrame(
        {
            "q": ["Tell me a colour.", "How many?", None, "Why?"],
            "sp": [SP, {"temperature": 1.0, "seed": 5, "max_tokens": 80}, None, {"temperature": 0.0, "max_tokens": 3}],
        }
    )


class Item(BaseModel):
    ok: bool
    n: int = Field(ge=0, le=999)
    tag: Literal["red", "green", "blue"]
    digits: list[Annotated[int, Field(ge=0, le=9)]] = Field(max_length=3)
    word: str = Field(max_length=6)
    maybe: float | None = Field(ge=0, le=1)


ITEM_TYPE = pa.struct(
    [
        ("ok", pa.bool_()),
        ("n", pa.int64()),
        ("tag", pa.string()),
        ("digits", pa.list_(pa.int64())),
        ("word", pa.string()),
        ("maybe", pa.float64()),
    ]
)


def test_arrow_type_from_json_schema():
    assert arrow_type(Item.model_json_schema()) == ITEM_TYPE
    assert arrow_type(SCHEMA) == pa.struct(
        [
            ("ok", pa.bool_()),
            ("n", pa.int64()),
            ("tag", pa.string()),
            ("digits", pa.list_(pa.int64())),
            ("word", pa.string()),
            ("inner", pa.struct([("x", pa.float64())])),
        ]
    )
    tree = {
        "$defs": {
            "Node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}
        },
        "$ref": "#/$defs/Node",
    }
    assert arrow_type(tree) == pa.struct([("kids", pa.list_(pa.string()))])  # recursion stops at a JSON string
    assert arrow_type({"anyOf": [{"type": "integer"}, {"type": "string"}]}) == pa.string()


@pytest.mark.slow
def test_pandas_json_schema_gives_a_struct_column_and_errors_for_incomplete_rows(frame, kw):
    out = frame.llm.generate("q", json_schema=Item, sampling_params="sp", **kw)
    assert out.dtypes["generated_text"] == pd.ArrowDtype(ITEM_TYPE)
    errors = out.llm_error.tolist()
    assert errors[0] is pd.NA and errors[1] is pd.NA
    assert "null" in errors[2] and "incomplete" in errors[3] and "max_tokens" in errors[3]
    assert out.generated_text.isna().tolist() == [False, False, True, True]
    for value in out.generated_text[:2]:
        Item.model_validate(value)
    unnested = pd.DataFrame(out.generated_text.struct.explode())  # fields become columns
    assert list(unnested.columns) == [f.name for f in ITEM_TYPE]
    # The values are what the engine generated, parsed.
    llm = LLM(kw["model"], max_model_len=128, kv_cache_memory_bytes=2**22)
    ref = llm.generate(frame.q[0], SamplingParams(**SP, structured_outputs={"json": Item}), use_tqdm=False)
    assert out.generated_text[0] == Item.model_validate_json(ref[0].outputs[0].text).model_dump()
    with pytest.raises(ValueError, match="incomplete"):
        frame.iloc[[3]].llm.generate("q", json_schema=Item, sampling_params="sp", on_error="raise", **kw)


def test_choice_gives_a_categorical_and_bad_calls_raise(frame, kw):
    out = frame.llm.generate("q", choice=["red", "green", "blue"], sampling_params=SP, **kw)
    assert out.dtypes["generated_text"] == pd.CategoricalDtype(["red", "green", "blue"])
    assert set(out.generated_text.dropna()) <= {"red", "green", "blue"} and out.generated_text.notna().sum() == 3
    with pytest.raises(ValueError, match="not both"):
        frame.llm.generate("q", choice=["a"], json_schema=Item, **kw)
    with pytest.raises(ValueError, match="once"):
        frame.llm.generate("q", choice=["a"], sampling_params={"structured_outputs": {"regex": "a"}}, **kw)
    with pytest.raises(ValueError, match="regex|json"):
        frame.llm.generate("q", json_schema={"type": "nonsense"}, **kw)


def test_dask_meta_is_exact_and_polars_types(frame, kw):
    ddf = dd.from_pandas(frame[["q"]], npartitions=2)
    for constraint in (dict(json_schema=Item), dict(choice=["yes", "no"])):
        result = ddf.llm.chat("{q}", sampling_params=SP, **constraint, **kw)
        computed = result.compute(scheduler="sync")
        assert result._meta.dtypes.to_dict() == computed.dtypes.to_dict()
    pdf = pl.DataFrame({"q": ["Hi", None, "More"]})
    out = pdf.llm.generate("q", json_schema=Item, sampling_params=SP, **kw)
    assert out.schema["generated_text"] == pl.Struct(
        {
            "ok": pl.Boolean,
            "n": pl.Int64,
            "tag": pl.String,
            "digits": pl.List(pl.Int64),
            "word": pl.String,
            "maybe": pl.Float64,
        }
    )
    assert out.unnest("generated_text")["tag"].drop_nulls().is_in(["red", "green", "blue"]).all()
    lazy = pdf.lazy().llm.generate("q", choice=["yes", "no"], sampling_params=SP, **kw)
    assert lazy.collect_schema()["generated_text"] == pl.Enum(["yes", "no"])
    collected = lazy.collect()
    assert collected.schema["generated_text"] == pl.Enum(["yes", "no"])
    expr = pdf.with_columns(pl.col("q").llm.generate(json_schema=Item, sampling_params=SP, **kw).alias("a"))
    assert expr.schema["a"] == out.schema["generated_text"] and expr["a"].to_list() == out["generated_text"].to_list()


def test_a_value_the_column_type_cannot_hold_is_that_rows_error():
    """JSON integers are unbounded; a completed output whose integer is past int64 gets an
    llm_error naming the column type instead of failing the partition."""
    from dfllm.outputs import CompletionOutput
    from dfllm.tasks.schema import structured_value
    from dfllm.tasks.task import make_task

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    task = make_task("generate", ("q",), ["q"], output_column="out", json_schema=schema)
    dtype = task.output_dtypes()["out"]
    fits = CompletionOutput(0, '{"n": 42}', [1], None, None, "stop", structured_output_complete=True)
    assert structured_value(task.structured, fits, dtype) == {"n": 42}
    huge = CompletionOutput(
        0, '{"n": 123456789012345678901234567890}', [1], None, None, "stop", structured_output_complete=True
    )
    with pytest.raises(ValueError, match=r"does not fit the column type struct<n: int64>"):
        structured_value(task.structured, huge, dtype)


@pytest.mark.parametrize("depth", [50, 5000])
def test_an_output_nested_past_pythons_limit_is_that_rows_error(depth):
    """A schema of nested arrays lets the model nest without end; JSON deeper than Python
    reads (RecursionError) is that row's error, not the partition's failure."""
    from dfllm.outputs import CompletionOutput
    from dfllm.tasks.schema import structured_value
    from dfllm.tasks.task import make_task

    schema = {"type": "object", "properties": {"a": {"type": "array"}}, "required": ["a"]}
    task = make_task("generate", ("q",), ["q"], output_column="out", json_schema=schema)
    dtype = task.output_dtypes()["out"]
    text = '{"a": ' + "[" * depth + "]" * depth + "}"
    out = CompletionOutput(0, text, [1], None, None, "stop", structured_output_complete=True)
    if depth < 100:
        assert structured_value(task.structured, out, dtype) is not None
    else:
        with pytest.raises(ValueError, match=r"^structured output nested too deeply to read"):
            structured_value(task.structured, out, dtype)


@pytest.mark.parametrize("as_text", [False, True])
def test_a_schema_nested_past_pythons_limit_is_refused_by_name(as_text):
    """A per-row schema nested without end is that row's error (a RecursionError failed the
    partition), refused by name at the one nesting limit (``dfllm.errors.MAX_NESTING_DEPTH``)."""
    from dfllm import SamplingParams

    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    text = '{"type": "array", "items": ' * 5000 + '{"type": "string"}' + "}" * 5000
    value = text if as_text else schema
    with pytest.raises(ValueError, match=f"^structured_outputs.json must be nested at most {MAX_NESTING_DEPTH} levels"):
        SamplingParams(max_tokens=2, structured_outputs={"json": value})
