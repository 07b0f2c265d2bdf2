"""Values nested past ``dfllm.errors.MAX_NESTING_DEPTH`` and past Python's recursion limit,
built without recursion, for the tests of every path that must refuse them by name: lists and
dicts nested ``depth`` levels (:func:`nested`), the same 100,000 levels deep built once per
process (:func:`far_nested`), and the depths worth trying (:data:`DEPTHS`)."""

from __future__ import annotations

import functools

from hypothesis import strategies as st

from dfllm.errors import MAX_NESTING_DEPTH

WRAPS = ("list", "dict")
FAR = 100_000  # far past Python's recursion limit: any recursive walk of it fails

# past the limit, just under Python's recursion limit (a check at a shallow stack passes,
# code deeper in the stack recurses), and far past it
DEPTHS = st.one_of(st.integers(MAX_NESTING_DEPTH + 1, 200), st.integers(900, 1000), st.sampled_from([5_000, FAR]))


def nested(depth: int, wrap: str, leaf: object) -> object:
    """``leaf`` inside ``depth`` lists (``wrap="list"``) or dicts (``{"a": ...}``), built
    without recursion."""
    return functools.reduce(lambda x, _: [x] if wrap == "list" else {"a": x}, range(depth), leaf)


@functools.cache
def far_nested(wrap: str) -> object:
    """``1`` inside :data:`FAR` lists or dicts, built once per process (building and freeing
    one takes a tenth of a second). Shared: never change it."""
    return nested(FAR, wrap, 1)


def deep(depth: int, wrap: str) -> object:
    """``1`` inside ``depth`` lists or dicts: :func:`far_nested` for :data:`FAR`."""
    return far_nested(wrap) if depth == FAR else nested(depth, wrap, 1)
