"""How much of a value the jobs' messages show: a row's index label, a batch line's
``custom_id``, ``method`` or ``url``, a field's value. Whatever its size (a ``custom_id``
of a million characters, a list of a million numbers), a message shows at most
:data:`MAX_SHOWN` characters of it; the value itself (an output line's ``custom_id``, a
row's label in the output's index) is never cut."""

from __future__ import annotations

from dfllm.errors import value_text

MAX_SHOWN = 200  # characters of a value a message shows


def clipped(text: str) -> str:
    """``text`` cut at :data:`MAX_SHOWN` characters, an ellipsis (``…``) marking the cut."""
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 1] + "\u2026"


def shown(value) -> str:
    """``value`` as a message shows it: its ``repr`` (a lone surrogate written as its
    escape, :func:`~dfllm.errors.value_text`), :func:`clipped`; never an exception (a
    ``repr`` that fails, an int past Python's digit limit, gives the value's text or its
    type named)."""
    try:
        text = value_text(repr(value))
    except Exception:  # noqa: BLE001  (a repr that raises)
        text = value_text(value)
    return clipped(text)
