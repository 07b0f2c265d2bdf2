"""Hostile frames are normal frames: the semantic operators, the Polars namespace and
per-row LoRA adapters on generated odd input (any type of value, lone surrogates and odd
Unicode, huge ints, nulls, empty frames, a duplicated index, names that clash with the
operators' outputs, passthrough columns of every Polars dtype, malformed adapter folders).

The invariants: the call completes (or is refused now, by a ``ValueError`` naming the
column); every input row comes out exactly once, per the operator's contract, with its
answer or its ``llm_error``; passthrough columns come back equal, of the same dtype.
"""

from __future__ import annotations

import datetime
import decimal
import json
import math
import shutil
import uuid
from pathlib import Path

import pandas as pd
import polars as pl
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from semantic_data import ENGINE

import dfllm  # noqa: F401  (registers .llm)

SETTINGS = settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
GEN = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}

ODD_TEXT = [
    "\ud800",
    "a\udfffb",
    "\x00",
    "\u202eevil",
    "🙂" * 3,
    "e\u0301",
    "",
    " ",
    "\n\t",
    "{review}",
    "{}",
    "\ufeff",
]
hostile_scalar = st.one_of(
    st.none(),
    st.sampled_from(ODD_TEXT),
    st.text(max_size=12),
    st.integers(min_value=-(2**130), max_value=2**130),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.binary(max_size=4),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(min_value=0, max_value=3), max_size=2),
    st.just(float("nan")),
    st.just(pd.NA),
)


def is_null(v) -> bool:
    return v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))


def hostile_frame(draw, column: str, n: int, clash: str | None, dup_index: bool) -> pd.DataFrame:
    values = draw(st.lists(hostile_scalar, min_size=n, max_size=n))
    df = pd.DataFrame({"rid": list(range(n)), column: pd.Series(values, dtype=object)})
    if clash is not None and clash not in df.columns:
        df[clash] = [f"user {clash} {i}" for i in range(n)]
    if dup_index and n:
        df.index = [7] * n
    return df


# ---- defect 3: a left frame's `similarity` clashes with the joins' similarity column -------------------
@pytest.mark.slow
def test_left_similarity_clash_is_refused_by_name(tiny_llama):
    left = pd.DataFrame({"text": ["red", "blue"], "similarity": [1, 2]})
    right = pd.DataFrame({"topic": ["colour", "sound"]})
    with pytest.raises(ValueError, match="'similarity'.*similarity_column"):
        left.llm.sim_join(right, "text", "topic", 1)
    with pytest.raises(ValueError, match="'similarity'.*similarity_column"):
        left.llm.join(right, "{text} is {topic}", model=str(tiny_llama), block_k=1, **ENGINE)
    with pytest.raises(ValueError, match="'similarity'"):
        pl.from_pandas(left).lazy().llm.sim_join(pl.from_pandas(right), "text", "topic", 1)
    # another similarity_column= is the way out: one column of each name, parquet and Polars take it
    out = left.llm.sim_join(right, "text", "topic", 1, similarity_column="cosine")
    assert list(out.columns) == ["text", "similarity", "topic", "cosine", "llm_error"]
    assert pl.from_pandas(out).height == 2
    # an unblocked join adds no similarity column: a left `similarity` is just a column
    plain = left.llm.join(right, "{text} is {topic}", model=str(tiny_llama), **ENGINE)
    assert list(plain.columns).count("similarity") == 1


# ---- defect 4: Polars passthrough columns keep their dtype (Enum...), eagerly and lazily ----------------
def typed_frame(n: int = 3) -> pl.DataFrame:
    rows = list(range(n))
    return pl.DataFrame(
        [
            pl.Series("q", [["Hi", "ok", None][i % 3] for i in rows], dtype=pl.String),
            pl.Series("e", [["a", None, "c"][i % 3] for i in rows], dtype=pl.Enum(["a", "b", "c"])),
            pl.Series("c", [["x", "y", None][i % 3] for i in rows], dtype=pl.Categorical),
            pl.Series("d", [decimal.Decimal("1.50"), None, decimal.Decimal("-2.25")][:n], dtype=pl.Decimal(10, 2)),
            pl.Series("du", [datetime.timedelta(seconds=i) for i in rows], dtype=pl.Duration("ms")),
            pl.Series("tz", [datetime.datetime(2020, 1, 1 + i) for i in rows], dtype=pl.Datetime("us", "Europe/Paris")),
            pl.Series("l", [[1, None], None, []][:n], dtype=pl.List(pl.Int8)),
            pl.Series("s", [{"a": i, "b": "z"} for i in rows], dtype=pl.Struct({"a": pl.Int64, "b": pl.String})),
            pl.Series("n", [None] * n, dtype=pl.Null),
            pl.Series("big", [2**100, None, -(2**90)][:n], dtype=pl.Int128),
        ]
    )


def test_polars_passthrough_dtypes_eager_and_lazy(tiny_llama):
    df = typed_frame()
    kw = dict(model=str(tiny_llama), sampling_params=GEN, **ENGINE)
    out = df.llm.generate("{q}", **kw)
    assert out.select(df.columns).schema == df.schema
    assert out.select(df.columns).equals(df)
    lazy = df.lazy().llm.generate("{q}", **kw)
    declared = lazy.collect_schema()
    got = lazy.collect()
    assert got.schema == declared
    assert got.select(df.columns).equals(df) and got.select(df.columns).schema == df.schema


def test_a_polars_column_arrow_cannot_hold_is_refused_by_name_where_it_is_read(tiny_judge):
    """An Int128 column passes through a call that does not read it (above); one that is read
    (a template's field, a semantic operator's frame) cannot go through Arrow to pandas: a
    ValueError naming it and its type, not Arrow's '_pli128'."""
    df = typed_frame().rename({"q": "review"})
    kw = dict(model=str(tiny_judge), sampling_params=GEN, **ENGINE)
    for call in (
        lambda: df.llm.generate("{review} {big}", **kw),
        lambda: df.lazy().llm.generate("{big}", **kw).collect(),
        lambda: df.llm.dedup("review"),
        lambda: df.llm.judge("{review} is a greeting", model=str(tiny_judge), **ENGINE),
    ):
        with pytest.raises(ValueError, match=r"column\(s\) 'big' \(Int128\) cannot go through Arrow to pandas"):
            call()


def test_a_pandas_other_with_a_mixed_column_joins_a_polars_frame():
    """``other`` may be a pandas frame whose passthrough column holds values of several types
    (``1``, ``"a"``, bytes): Arrow cannot type them together, so that column comes back as a
    Polars ``Object`` column with its values as they are, not an error for the whole join."""
    left = pl.DataFrame({"id": [0, 1], "review": ["late parcel", "great price"]})
    right = pd.DataFrame({"topic": ["shipping", "price", "sound"], "extra": pd.Series([1, "a", b"\xff"], dtype=object)})
    out = left.llm.sim_join(right, "review", "topic", k=3)
    assert out.height == 6 and out["llm_error"].null_count() == 6
    assert out.schema["extra"] == pl.Object
    assert sorted(map(repr, out["extra"].to_list())) == sorted(map(repr, [1, "a", b"\xff"] * 2))


@pytest.mark.slow
def test_polars_semantic_filter_keeps_dtypes(tiny_judge):
    df = typed_frame().drop("big").rename({"q": "review"})
    eager = df.llm.filter("{review} is a greeting", model=str(tiny_judge), **ENGINE)
    lazy = df.lazy().llm.filter("{review} is a greeting", model=str(tiny_judge), **ENGINE)
    declared = lazy.collect_schema()
    got = lazy.collect()
    assert got.schema == declared == eager.schema
    assert {c: eager.schema[c] for c in df.columns} == dict(df.schema)
    assert got.equals(eager)


# ---- defect 11: adapter configs that are JSON but not objects, wrong types: that row's error --------
def model_dims(base: Path) -> tuple[int, int, int]:
    cfg = json.loads((base / "config.json").read_text())
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    return h, heads * head_dim, cfg["num_key_value_heads"] * head_dim


def write_adapter(base: Path, out: Path, r: int = 2, config: object = None, seed: int = 0) -> Path:
    """A random q/v LoRA adapter of ``base`` as PEFT saves it (``config`` replaces its
    adapter_config.json's content when given)."""
    h, q, kv = model_dims(base)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module, width in (("q_proj", q), ("v_proj", kv)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, h, generator=g)
            tensors[f"{key}.lora_B.weight"] = torch.randn(width, r, generator=g)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    text = json.dumps(cfg if config is None else config)
    (out / "adapter_config.json").write_text(text)
    return out


GOOD_CFG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
# (what is wrong, how to break the folder, a word the row's error must hold)
BREAKAGES = {
    "null": (lambda d: (d / "adapter_config.json").write_text("null"), "adapter_config.json"),
    "list": (lambda d: (d / "adapter_config.json").write_text("[]"), "adapter_config.json"),
    "number": (lambda d: (d / "adapter_config.json").write_text("3"), "adapter_config.json"),
    "string": (lambda d: (d / "adapter_config.json").write_text('"r"'), "adapter_config.json"),
    "r-string": (lambda d: _cfg(d, r="8"), "r must be"),
    "r-bool": (lambda d: _cfg(d, r=True), "r must be"),
    "r-nan": (lambda d: _cfg(d, r=float("nan")), "r must be"),
    "alpha-null": (lambda d: _cfg(d, lora_alpha=None), "lora_alpha"),
    "alpha-inf": (lambda d: _cfg(d, lora_alpha=float("inf")), "lora_alpha"),
    "targets-number": (lambda d: _cfg(d, target_modules=5), "target_modules"),
    "targets-dicts": (lambda d: _cfg(d, target_modules=[{"q": 1}]), "target_modules"),
    "rslora-string": (lambda d: _cfg(d, use_rslora="yes"), "use_rslora"),
    "not-json": (lambda d: (d / "adapter_config.json").write_text("{r: 2"), "not valid JSON"),
    "deep-json": (lambda d: (d / "adapter_config.json").write_text("[" * 100000 + "]" * 100000), "adapter_config"),
    "not-utf8": (lambda d: (d / "adapter_config.json").write_bytes(b"\xff\xfe{"), "adapter_config.json"),
    "no-config": (lambda d: (d / "adapter_config.json").unlink(), "adapter_config.json is missing"),
    "no-weights": (lambda d: (d / "adapter_model.safetensors").unlink(), "adapter_model.safetensors is missing"),
    "bad-weights": (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x08junk"), "adapter_model.safetensors"),
    "rank-too-big": (None, "max_lora_rank"),
}


def _cfg(d: Path, **changes) -> None:
    (d / "adapter_config.json").write_text(json.dumps({**GOOD_CFG, **changes}))


def broken_adapter(base: Path, root: Path, what: str) -> Path:
    out = root / f"{what}-{uuid.uuid4().hex[:8]}"
    if what == "rank-too-big":
        return write_adapter(base, out, r=16, config={**GOOD_CFG, "r": 16, "lora_alpha": 16})
    write_adapter(base, out)
    BREAKAGES[what][0](out)
    return out


LORA_KW = dict(sampling_params=GEN, max_loras=2, max_lora_rank=8, **ENGINE)


@pytest.fixture(scope="module")
def good_adapter(tiny_llama, tmp_path_factory) -> Path:
    return write_adapter(tiny_llama, tmp_path_factory.mktemp("good") / "good")


@pytest.mark.slow
@pytest.mark.parametrize("what", ["null", "list", "number", "string"])
def test_adapter_config_not_an_object_is_that_rows_error(tiny_llama, good_adapter, tmp_path, what):
    bad = broken_adapter(tiny_llama, tmp_path, what)
    df = pd.DataFrame({"q": ["Hello", "Hi", "Hey"], "adapter": [str(good_adapter), str(bad), None]})
    out = df.llm.generate("{q}", model=str(tiny_llama), lora="adapter", **LORA_KW)
    assert out.llm_error.isna().tolist() == [True, False, True]
    err = out.llm_error[1]
    assert str(bad) in err and "adapter_config.json" in err and "object" in err, err


@SETTINGS
@given(data=st.data())
def test_property_malformed_adapters_fail_only_their_rows(tiny_llama, good_adapter, tmp_path_factory, data):
    root = tmp_path_factory.mktemp("bad-adapters")
    kinds = data.draw(st.lists(st.sampled_from(sorted(BREAKAGES)), min_size=1, max_size=3, unique=True))
    bad = {k: broken_adapter(tiny_llama, root, k) for k in kinds}
    choices = [None, str(good_adapter), *(str(p) for p in bad.values())]
    rows = data.draw(st.lists(st.sampled_from(choices), min_size=1, max_size=6))
    df = pd.DataFrame({"q": ["Say hi"] * len(rows), "adapter": pd.Series(rows, dtype=object)})
    out = df.llm.generate("{q}", model=str(tiny_llama), lora="adapter", **LORA_KW)
    assert len(out) == len(df) and out["adapter"].tolist() == rows
    for spec, err, text in zip(rows, out.llm_error, out.generated_text):
        kind = next((k for k, p in bad.items() if str(p) == spec), None)
        if kind is None:
            assert pd.isna(err) and isinstance(text, str), (spec, err)
        else:
            assert isinstance(err, str) and spec in err and BREAKAGES[kind][1] in err, (kind, err)
            assert pd.isna(text)
    shutil.rmtree(root, ignore_errors=True)


# ---- properties: semantic operators on hostile pandas frames ---------------------------------------------
FILTER_CLASHES = [None, "similarity", "llm_error", "verdict", "verdict_probability", "explanation", "generated_text"]


@pytest.mark.slow
@SETTINGS
@given(data=st.data())
def test_property_filter_every_row_once(tiny_judge, data):
    n = data.draw(st.integers(min_value=0, max_value=5))
    clash = data.draw(st.sampled_from(FILTER_CLASHES))
    df = hostile_frame(data.draw, "review", n, clash, data.draw(st.booleans()))
    if clash == "llm_error":
        df["llm_error"] = pd.Series([None] * n, dtype=object)
    out = df.llm.filter("{review} is about shipping", model=str(tiny_judge), **ENGINE)
    kept = out["rid"].tolist()
    assert kept == sorted(set(kept)) and set(kept) <= set(range(n))  # each row at most once, in order
    assert list(out.columns) == [*df.columns, *([] if "llm_error" in df.columns else ["llm_error"])]
    for rid, err in zip(out["rid"], out["llm_error"]):
        if clash not in (None, "llm_error"):
            assert out.loc[out["rid"] == rid, clash].tolist() == [f"user {clash} {rid}"]
        assert err is None or pd.isna(err) or isinstance(err, str)
    for rid in range(n):  # a row that could not be judged is kept with its error
        if is_null(df["review"].iloc[rid]):
            assert rid in kept and isinstance(out.loc[out["rid"] == rid, "llm_error"].iloc[0], str)


SIM_CLASHES = [None, "similarity", "llm_error", "topic", "rid"]


@pytest.mark.slow
@SETTINGS
@given(data=st.data())
def test_property_sim_join_pairs_per_contract(data):
    n = data.draw(st.integers(min_value=0, max_value=4))
    m = data.draw(st.integers(min_value=0, max_value=3))
    k = data.draw(st.integers(min_value=1, max_value=3))
    clash = data.draw(st.sampled_from(SIM_CLASHES))
    left = hostile_frame(data.draw, "text", n, clash, data.draw(st.booleans()))
    right = hostile_frame(data.draw, "topic", m, None, data.draw(st.booleans())).rename(columns={"rid": "tid"})
    if clash == "llm_error":
        left["llm_error"] = pd.Series([None] * n, dtype=object)
    if clash == "similarity":
        with pytest.raises(ValueError, match="'similarity'"):
            left.llm.sim_join(right, "text", "topic", k)
        return
    out = left.llm.sim_join(right, "text", "topic", k)
    assert len(set(out.columns)) == len(out.columns)
    ok = out[out.llm_error.isna()]
    pairs = list(zip(ok["rid"], ok["tid"]))
    assert len(pairs) == len(set(pairs))  # each pair at most once
    failed_left = out[out.llm_error.notna() & out["rid"].notna()]["rid"].tolist()
    failed_right = out[out.llm_error.notna() & out["rid"].isna()]["tid"].tolist()
    assert len(failed_left) == len(set(failed_left)) and len(failed_right) == len(set(failed_right))
    usable_right = m - len(failed_right)
    for rid in range(n):
        mine = [t for r, t in pairs if r == rid]
        if rid in failed_left:  # once, with its error naming the column, and in no pair
            assert not mine
            err = out[out["rid"] == rid].llm_error.iloc[0]
            assert "'text'" in err, err
        else:
            assert len(mine) == min(k, usable_right), (rid, mine)
    for rid in range(n):
        if is_null(left["text"].iloc[rid]):
            assert rid in failed_left
    for tid in failed_right:
        assert not any(t == tid for _, t in pairs)
    assert pl.from_pandas(out.drop(columns=["text", "topic"])).height == len(out)  # one column per name


@SETTINGS
@given(data=st.data())
def test_property_dedup_every_row_once(data):
    n = data.draw(st.integers(min_value=0, max_value=5))
    clash = data.draw(st.sampled_from([None, "similarity", "llm_error", "cluster_id"]))
    df = hostile_frame(data.draw, "text", n, clash, data.draw(st.booleans()))
    if clash == "cluster_id":
        with pytest.raises(ValueError, match="'cluster_id'"):
            df.llm.dedup("text", threshold=0.9)
        return
    if clash == "llm_error":
        df["llm_error"] = pd.Series([None] * n, dtype=object)
    out = df.llm.dedup("text", threshold=0.9)
    assert sorted(out["rid"].tolist()) == list(range(n))  # every row exactly once
    assert len(set(out.columns)) == len(out.columns)
    for rid, err, cluster in zip(out["rid"], out["llm_error"], out["cluster_id"]):
        if is_null(df["text"].iloc[rid]):
            assert isinstance(err, str) and "text" in err, err
        assert isinstance(err, str) or not pd.isna(cluster)


# ---- properties: the Polars namespace, eager and lazy -----------------------------------------------------
POLARS_VALUES = {
    pl.Enum(["a", "b", "ç"]): st.sampled_from(["a", "b", "ç", None]),
    pl.Categorical: st.one_of(st.none(), st.text(max_size=3)),
    pl.Decimal(12, 3): st.one_of(st.none(), st.decimals(min_value=-(10**8), max_value=10**8, places=3)),
    pl.Duration("us"): st.one_of(st.none(), st.timedeltas(max_value=datetime.timedelta(days=999))),
    pl.Datetime("us", "Asia/Kolkata"): st.one_of(
        st.none(), st.datetimes(min_value=datetime.datetime(1970, 1, 2), max_value=datetime.datetime(2200, 1, 1))
    ),
    pl.List(pl.List(pl.Int16)): st.one_of(
        st.none(), st.lists(st.lists(st.integers(-(2**15), 2**15 - 1), max_size=2), max_size=2)
    ),
    pl.Struct({"x": pl.Enum(["p", "q"]), "y": pl.List(pl.String)}): st.one_of(
        st.none(),
        st.fixed_dictionaries({"x": st.sampled_from(["p", "q", None]), "y": st.lists(st.text(max_size=2), max_size=2)}),
    ),
    pl.Null: st.none(),
    pl.Int128: st.one_of(st.none(), st.integers(-(2**120), 2**120)),
    pl.UInt64: st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    pl.Binary: st.one_of(st.none(), st.binary(max_size=3)),
    pl.Boolean: st.one_of(st.none(), st.booleans()),
    pl.Float32: st.one_of(st.none(), st.floats(width=32, allow_nan=True)),
    pl.Date: st.one_of(st.none(), st.dates()),
    pl.Time: st.one_of(st.none(), st.times()),
}
POLARS_DTYPES = list(POLARS_VALUES)
polars_text = st.one_of(st.none(), st.sampled_from([t for t in ODD_TEXT if "\ud800" not in t and "\udfff" not in t]))
polars_text = st.one_of(polars_text, st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=8))


@pytest.mark.slow
@SETTINGS
@given(data=st.data())
def test_property_polars_passthrough_every_row_once(tiny_llama, data):
    n = data.draw(st.integers(min_value=0, max_value=4))
    picked = data.draw(st.lists(st.integers(0, len(POLARS_DTYPES) - 1), min_size=1, max_size=5, unique=True))
    columns = [pl.Series("q", data.draw(st.lists(polars_text, min_size=n, max_size=n)), dtype=pl.String)]
    for j in picked:
        dtype = POLARS_DTYPES[j]
        values = data.draw(st.lists(POLARS_VALUES[dtype], min_size=n, max_size=n))
        columns.append(pl.Series(f"c{j}", values, dtype=dtype))
    df = pl.DataFrame(columns)
    kw = dict(model=str(tiny_llama), sampling_params=GEN, **ENGINE)
    lazy = data.draw(st.booleans())
    if lazy:
        frame = df.lazy().llm.generate("{q}", **kw)
        declared = frame.collect_schema()
        out = frame.collect()
        assert out.schema == declared
    else:
        out = df.llm.generate("{q}", **kw)
    assert out.height == n
    assert out.select(df.columns).schema == df.schema
    assert out.select(df.columns).equals(df)
    for q, text, err in zip(df["q"], out["generated_text"], out["llm_error"]):
        assert (text is None) != (err is None), (q, text, err)
