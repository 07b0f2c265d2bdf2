"""The error a bad request raises: :class:`InvalidRequestError`, a ``ValueError``.

Every check of a request made by :class:`dfllm.LLM` (``generate``, ``chat``, ``enqueue``,
``enqueue_chat``, ``embed``, ``classify``, ``score``, ``encode``) and by the dataframe
accessors' input processing raises it before any work starts: a malformed or empty prompt,
a token id out of the vocabulary, a prompt longer than ``max_model_len``, more logprobs than
``max_logprobs``, sampling or pooling params the model cannot honour (invalid
``SamplingParams`` raise it when built), a ``best_of`` above ``n``, a grammar that does not
parse, a priority list of the wrong length. It is vLLM's ``vllm.exceptions.VLLMValidationError`` under a dfllm
name (:data:`VLLMValidationError` is the same class): code catching ``ValueError`` (as
vLLM's examples do) catches it too.

Its message starts with vLLM's own words for the same failure where vLLM has them
(``"The decoder prompt cannot be empty"``, ``"Token id 99999 is out of vocabulary"``,
``"Requested sample logprobs of 50, which is greater than max allowed: 20"``, ``"max_tokens
must be at least 1, got 0."``), so code matching vLLM's messages keeps working, and goes on
with dfllm's detail naming the offending input (``"(prompt 3 is empty: no tokens)"``, a
dataframe row's ``llm_error``).

The module also holds what every layer's messages need: how deeply a request's values may
nest (:data:`MAX_NESTING_DEPTH`, :func:`nesting_depth`) and any value written as text a
message or a string column can hold (:func:`printable`, :func:`value_text`, :func:`value_repr`,
:func:`shown`, cut at :data:`MAX_SHOWN` characters).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class InvalidRequestError(ValueError):
    """A request that dfllm refuses before running it (a ``ValueError``; vLLM's
    ``VLLMValidationError``). ``parameter`` names the request field at fault when one is
    (``"logprobs"``, ``"priority"``...), and ``value`` is the value refused."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __reduce__(self):  # keeps parameter and value across pickling (Dask workers)
        return _rebuild, (str(self), self.parameter, self.value)


def _rebuild(message: str, parameter: str | None, value: Any) -> InvalidRequestError:
    return InvalidRequestError(message, parameter=parameter, value=value)


VLLMValidationError = InvalidRequestError
"""vLLM's name for :class:`InvalidRequestError` (``vllm.exceptions.VLLMValidationError``)."""


@contextmanager
def invalid_request() -> Iterator[None]:
    """Inside this block, a plain ``ValueError`` raised by a request check becomes an
    :class:`InvalidRequestError` with the same message (chained to it)."""
    try:
        yield
    except InvalidRequestError:
        raise
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc


#: How deeply a request field's containers (dicts, lists, tuples, sets) may nest: sampling
#: params' fields (``extra_args``, ``stop``, ``logit_bias``...), a structured output's
#: ``json`` schema, ``choice``, ``regex``..., a chat message's fields and a chat template's
#: variables past it are refused by name. Requests' keys (dedupe, the response cache), chat
#: templates and error messages walk every field, and a value nested past Python's recursion
#: limit would fail the partition instead of its row.
MAX_NESTING_DEPTH = 32


def nesting_depth(value: object, limit: int = MAX_NESTING_DEPTH + 1) -> int:
    """How deeply ``value``'s dicts, lists, tuples and sets nest (0: not one; 1: a flat one),
    counted up to ``limit`` only (a value nested deeper than Python recurses is still
    measured), without recursion."""
    containers = (dict, list, tuple, set, frozenset)
    depth, level = 0, [value] if isinstance(value, containers) else []
    while level and depth < limit:
        depth += 1
        level = [x for v in level for x in (v.values() if isinstance(v, dict) else v) if isinstance(x, containers)]
    return depth


def array_as_list(value: object) -> object:
    """An array of one or more dimensions (NumPy's, a tensor, a pandas Series: what a dataframe's
    list column holds) as the nested list of Python values it holds, to be checked as a list
    is (its truth value, compared with ``!=`` or ``if``, raises); anything else as it is."""
    if getattr(value, "ndim", 0) and callable(getattr(value, "tolist", None)):
        return value.tolist()  # type: ignore[attr-defined]
    return value


def invalid_field(name: str, value: object, vllm: str, detail: str | None = None) -> InvalidRequestError:
    """The refusal of a request field ``name`` holding ``value``: vLLM's message, then dfllm's
    ``detail`` (in parentheses) when it adds one."""
    return InvalidRequestError(vllm if detail is None else f"{vllm} ({detail})", parameter=name, value=value)


# ---- values as the text of a message ----------------------------------------------------------
def printable(text: str) -> str:
    """``text`` as valid Unicode: each lone surrogate (which JSON's ``\\ud83d`` escapes can
    make, and which has no UTF-8 form) written as its escape, ``\\ud83d`` (six characters)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def value_text(value) -> str:
    """Any value as text a string column can hold (never an exception): a string
    :func:`printable`, bytes read as UTF-8 (an invalid byte as its escape, ``\\xff``),
    anything else its ``str`` (or, where that fails, its type named)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "backslashreplace")
    if isinstance(value, str):
        return printable(value)
    try:
        return printable(str(value))
    except Exception:  # noqa: BLE001  (an int past Python's digit limit, a __str__ that raises)
        return f"{_a_type(value)} that cannot be written as text"


def value_repr(value) -> str:
    """``repr(value)`` for a message (never an exception): a value whose containers nest more
    than :data:`MAX_NESTING_DEPTH` levels (whose ``repr`` could recurse past Python's limit)
    as ``"a list nested more than 32 levels deep"``, one whose ``repr`` fails (an int past
    Python's digit limit) its type named, and the text :func:`printable`."""
    if nesting_depth(value) > MAX_NESTING_DEPTH:
        return f"{_a_type(value)} nested more than {MAX_NESTING_DEPTH} levels deep"
    try:
        return printable(repr(value))
    except Exception:  # noqa: BLE001  (an int past Python's digit limit, a __repr__ that raises)
        return f"{_a_type(value)} that cannot be written as text"


#: The most characters of a value a message shows (a ``custom_id`` of a million characters, a
#: row's label, a config field, a tensor's name): the value itself is never cut.
MAX_SHOWN = 200


def clipped(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` cut at ``limit`` characters, an ellipsis (``…``) marking the cut."""
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def shown(value, limit: int = MAX_SHOWN) -> str:
    """``value`` as a message shows it: :func:`value_repr` (never an exception, never a
    recursion) :func:`clipped` at ``limit`` characters."""
    return clipped(value_repr(value), limit)


def _a_type(value) -> str:
    """``value``'s type named with its article: ``"a list"``, ``"an int"``."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"
