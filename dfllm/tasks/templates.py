"""Templates over a row's columns (``"Q: {question}"``) and the values they format: which
columns a template reads, and each value checked as text or a scalar before it is formatted."""

from __future__ import annotations

import datetime
import decimal
import string

import numpy as np
import pandas as pd

from dfllm.inputs import check_unicode

TEMPLATE_SCALARS = (str, bool, int, float, decimal.Decimal, datetime.date, datetime.time, datetime.timedelta)


def is_template(text: str) -> bool:
    """Whether an input is a ``{column}`` template rather than a column name."""
    return "{" in text


def template_fields(template: str) -> list[str]:
    """The ``{column}`` names a template uses, those nested in format specs (``{q:>{width}}``)
    included; malformed templates raise ``ValueError``. A field is a plain column name:
    attribute or index access (``{q.__class__}``, ``{q[0]}``) is refused, so a template
    can only ever read the row's values."""
    names: list[str] = []

    def walk(text: str, depth: int) -> None:
        for _, name, spec, conversion in string.Formatter().parse(text):
            if name is None:
                continue
            if conversion not in (None, "r", "s", "a"):
                raise ValueError(f"unknown conversion !{conversion}")
            names.append(name)
            if spec and depth < 2:
                walk(spec, depth + 1)

    try:
        walk(template, 0)
    except ValueError as exc:
        raise ValueError(f"bad template {template!r}: {exc}") from None
    if any(n == "" or n.isdigit() for n in names):
        raise ValueError(f"template {template!r}: placeholders must name columns, like {{question}}")
    for n in names:
        if "." in n or "[" in n:
            raise ValueError(
                f"template {template!r}: {{{n}}} is not a plain column name (attribute and index "
                "access are not allowed; pass a column whose name has '.' or '[' directly)"
            )
    return list(dict.fromkeys(names))


def is_null(value) -> bool:
    """Whether a cell is missing: None, pandas' NA and NaT, a NaN (float, NumPy or decimal) or
    NumPy's NaT. A container (a list, dict or array) is a value whatever it holds (``[None]``
    is not null), and so is text."""
    if value is None or value is pd.NA or value is pd.NaT:
        return True
    if isinstance(value, (str, bytes, bytearray, list, tuple, dict, set, np.ndarray)):
        return False
    try:
        return bool(pd.isna(value))  # a scalar: True or False
    except (TypeError, ValueError):  # an object pandas cannot ask
        return False


def cell_text(value, what: str) -> str:
    """The value as a non-empty string, or raise ``ValueError`` saying what is wrong.

    Bytes (a binary column) are read as UTF-8."""
    if is_null(value):
        raise ValueError(f"{what} is null")
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{what} is not valid UTF-8: byte {value[exc.start]:#04x} at offset {exc.start}") from None
    if not isinstance(value, str):
        raise ValueError(f"{what} is not a string ({type(value).__name__})")
    if not value.strip():
        raise ValueError(f"{what} is empty")
    return check_unicode(value, what)


def template_value(value, what: str):
    """A row's value for a template field, formatted later exactly as ``str.format`` would:
    text (bytes read as UTF-8) and scalars (ints, floats, bools, dates, times, decimals)
    pass as they are, so ``{price:.2f}`` works; a null (None, NA, NaN, NaT) is the row's
    error naming the column, and so is a nested value (a list, a dict) or an empty text."""
    if is_null(value):
        raise ValueError(f"{what} is null")
    if isinstance(value, (str, bytes, bytearray)):
        return cell_text(value, what)
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a numpy scalar
        value = value.item()
    if not isinstance(value, TEMPLATE_SCALARS):
        raise ValueError(
            f"{what} holds a {type(value).__name__}; templates format text, numbers, booleans, "
            "dates and decimals (pass a column of text for anything else)"
        )
    return value


def field_text(value, what: str) -> str:
    """A row's value as the text a prompt's ``{field}`` without a format spec writes (a semantic
    operator's ``[column]: value`` record): :func:`template_value`'s check, then ``str.format``'s
    text, which must be valid Unicode; ``ValueError`` naming ``what`` otherwise (an int past
    Python's digit limit too)."""
    value = template_value(value, what)
    try:
        text = format(value, "")
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"{what} cannot be written as text: {exc}") from None
    return check_unicode(text, what)
