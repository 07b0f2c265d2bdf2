"""``.llm.extract`` equals the per-row structured generation of the same model (``LLM.chat``
row by row under the JSON schema, greedy), whatever form the schema takes (a pydantic
model, a JSON schema, a dict name -> type), as typed columns or one Arrow struct, on
pandas, Polars and (lazily, with exact ``meta``) Dask.

The Dask cluster test (a killed worker, resumed writes, filter then extract) is in
tests/semantic/test_semantic_filter.py.
"""

from __future__ import annotations

from typing import Literal

import dask
import dask.dataframe as dd
import polars as pl
import pydantic
import pytest
from semantic_data import ENGINE, direct_extract, reviews

from dfllm.semantic.extract import as_json_schema

pytestmark = pytest.mark.timeout(300)

SCHEMA = {"topic": Literal["shipping", "quality", "price"], "negative": bool}


class Review(pydantic.BaseModel):
    topic: Literal["shipping", "quality", "price"]
    negative: bool


JSON_SCHEMA = {
    "type": "object",
    "properties": {"topic": {"enum": ["shipping", "quality", "price"]}, "negative": {"type": "boolean"}},
    "required": ["topic", "negative"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_extract_equals_the_per_row_structured_generation(tiny_judge):
    df = reviews(6, null_at=2)
    got = df.llm.extract("{review}", SCHEMA, model=str(tiny_judge), **ENGINE)
    want = direct_extract(tiny_judge, df, SCHEMA)
    assert list(got.columns) == ["id", "review", "label", "topic", "negative", "llm_error"]
    assert str(got["topic"].dtype) == "string[pyarrow]" and str(got["negative"].dtype) == "bool[pyarrow]"
    for i, w in enumerate(want):
        if w is None:
            assert got["topic"].isna()[i] and got["llm_error"][i] == "column 'review' is null"
        else:
            assert (got["topic"][i], bool(got["negative"][i])) == (w["topic"], w["negative"])
    assert len({w["topic"] for w in want if w}) > 1  # the outputs differ from row to row


def test_every_schema_form_gives_the_same_columns(tiny_judge):
    assert as_json_schema(JSON_SCHEMA) == JSON_SCHEMA
    assert as_json_schema(SCHEMA)["properties"] == JSON_SCHEMA["properties"]
    assert as_json_schema({"tags": list[str], "stars": int | None, "note": "str"})["properties"] == {
        "tags": {"type": "array", "items": {"type": "string"}},
        "stars": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "note": {"type": "string"},
    }
    df = reviews(4)
    by_dict = df.llm.extract("{review}", SCHEMA, model=str(tiny_judge), **ENGINE)
    by_model = pl.from_pandas(df).llm.extract("{review}", Review, model=str(tiny_judge), **ENGINE)
    by_json = df.llm.extract(
        "{review}", JSON_SCHEMA, model=str(tiny_judge), expand=False, output_column="fields", **ENGINE
    )
    assert by_model["topic"].to_list() == by_dict["topic"].tolist()
    assert by_model.schema["negative"] == pl.Boolean
    assert str(by_json["fields"].dtype) == "struct<topic: string, negative: bool>[pyarrow]"
    assert by_json["fields"].struct.field("topic").tolist() == by_dict["topic"].tolist()


def test_dask_is_lazy_with_exact_meta(tiny_judge):
    df = reviews(6)
    ddf = dd.from_pandas(df, npartitions=3, sort=False).llm.extract("{review}", SCHEMA, model=str(tiny_judge), **ENGINE)
    assert [str(t) for t in ddf._meta.dtypes[["topic", "negative", "llm_error"]]] == [
        "string[pyarrow]",
        "bool[pyarrow]",
        "string[pyarrow]",
    ]
    with dask.config.set(scheduler="sync"):
        got = ddf.compute()
    want = df.llm.extract("{review}", SCHEMA, model=str(tiny_judge), **ENGINE)
    assert got["topic"].tolist() == want["topic"].tolist() and got["negative"].tolist() == want["negative"].tolist()
    lazy = pl.from_pandas(df).lazy().llm.extract("{review}", SCHEMA, model=str(tiny_judge), **ENGINE)
    assert isinstance(lazy, pl.LazyFrame) and lazy.collect()["topic"].to_list() == want["topic"].tolist()


def test_bad_schemas_and_clashes_fail_before_any_work(tiny_judge):
    df = reviews(2)
    with pytest.raises(ValueError, match="field 'x' has type"):
        df.llm.extract("{review}", {"x": object}, model=str(tiny_judge))
    with pytest.raises(ValueError, match="object with properties"):
        df.llm.extract("{review}", {"type": "array", "items": {"type": "string"}}, model=str(tiny_judge))
    with pytest.raises(ValueError, match=r"\['label'\] already exist"):
        df.llm.extract("{review}", {"label": str}, model=str(tiny_judge))
    with pytest.raises(ValueError, match=r"column\(s\) \['text'\]"):
        df.llm.extract("{text}", SCHEMA, model=str(tiny_judge))
