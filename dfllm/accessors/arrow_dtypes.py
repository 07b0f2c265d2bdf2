"""Let pandas read back the nested Arrow dtypes it records in parquet files.

pandas writes an ``ArrowDtype`` column's name into the parquet metadata
(``list<item: float>[pyarrow]``, ``struct<name: string, age: int64>[pyarrow]``) but its
own ``pandas_dtype`` parses only flat type names, so reading such a file fails with
"data type ... not understood", in ``pd.read_parquet`` and ``dd.read_parquet`` alike.
dfllm's outputs have such columns (``embedding``, ``probs``, structured-output structs),
so ``import dfllm`` registers a parser for these names with pandas' extension-dtype
registry: it answers only for strings that end in ``[pyarrow]`` and parse as a list,
large list or struct of Arrow types, and gives ``pd.ArrowDtype`` of that type.
"""

from __future__ import annotations

import re

import pandas as pd
import pyarrow as pa
from pandas.api.extensions import ExtensionDtype, register_extension_dtype

_PRIMITIVE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\[[^\]]*\])?")
_LISTS = (("large_list<", pa.large_list), ("list<", pa.list_))


def parse_arrow_type(text: str) -> pa.DataType:
    """The Arrow type whose ``str()`` is ``text`` (lists, large lists, structs, named types)."""
    typ, rest = _type(text.strip())
    if rest:
        raise ValueError(f"unexpected {rest!r} after an Arrow type in {text!r}")
    return typ


def _type(s: str) -> tuple[pa.DataType, str]:
    for prefix, make in _LISTS:
        if s.startswith(prefix):
            item, rest = _field(s[len(prefix) :])
            return make(item), _expect(rest, ">")
    if s.startswith("struct<"):
        rest, fields = s[len("struct<") :], []
        while not rest.startswith(">"):
            field, rest = _field(rest)
            fields.append(field)
            if rest.startswith(", "):
                rest = rest[2:]
        return pa.struct(fields), rest[1:]
    match = _PRIMITIVE.match(s)
    if not match:
        raise ValueError(f"not an Arrow type: {s!r}")
    return pa.type_for_alias(match.group()), s[match.end() :]


def _field(s: str) -> tuple[pa.Field, str]:
    name, sep, rest = s.partition(": ")
    if not sep or not name or any(c in name for c in "<>,"):
        raise ValueError(f"not an Arrow field: {s!r}")
    typ, rest = _type(rest)
    nullable = not rest.startswith(" not null")
    return pa.field(name, typ, nullable=nullable), rest if nullable else rest[len(" not null") :]


def _expect(s: str, token: str) -> str:
    if not s.startswith(token):
        raise ValueError(f"expected {token!r} at {s!r}")
    return s[len(token) :]


@register_extension_dtype
class NestedArrowDtypeName(ExtensionDtype):
    """Registry entry only: turns ``"list<item: float>[pyarrow]"`` into ``pd.ArrowDtype``."""

    name = "dfllm-nested-arrow"
    type = object

    @classmethod
    def construct_from_string(cls, string):
        if not isinstance(string, str) or not string.endswith("[pyarrow]") or "<" not in string:
            raise TypeError(f"cannot construct a nested ArrowDtype from {string!r}")
        try:
            return pd.ArrowDtype(parse_arrow_type(string[: -len("[pyarrow]")]))
        except (ValueError, TypeError, pa.ArrowException) as exc:
            raise TypeError(str(exc)) from None

    @classmethod
    def construct_array_type(cls):
        raise NotImplementedError("a parser of dtype names, not a dtype")
