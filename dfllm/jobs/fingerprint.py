"""A stable fingerprint of what a user's function does, for resuming a processor's write.

:func:`fingerprint` hashes a function by its code, not by its name or its address, so it
is the same in every Python process that defines the same function (a re-run of the same
script), and differs when the function's code or the values it reads change:

- a Python function (``def``, ``lambda``, nested): its bytecode, constants (nested
  functions' code included) and the names it uses; its defaults; the values of its
  closure's cells; and the module globals it reads: plain values by value, functions of its
  own module by their fingerprint (recursively), other functions, classes and modules by
  their qualified name. Line numbers and comments do not count.
- a bound method: its function and the object it is bound to; ``functools.partial``: its
  function and arguments; an object with ``__call__`` (defined in Python): its class's
  ``__call__`` and the object's attributes; any other callable (a builtin, a numpy ufunc)
  by value, as below.
- any other value (a closure's or global's value, a default): by Dask's deterministic
  ``tokenize`` (plain values, numpy arrays, pandas objects, dataclasses, picklable
  objects).

Best effort, by design: a function of another module (a library's) counts by name, so an
upgraded library is not noticed, nor is a change in a class's methods. A value Dask cannot
tokenize deterministically (a lock, an open file, a client...) makes :func:`fingerprint`
raise :class:`FingerprintError` naming it; the caller then asks for an explicit key.
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Callable


class FingerprintError(ValueError):
    """A function reads a value whose content cannot be fingerprinted."""


def fingerprint(fn: Callable | None) -> str:
    """A hex digest of what ``fn`` does (see the module docstring); ``"none"`` for None."""
    if fn is None:
        return "none"
    return hashlib.sha256(
        repr(_callable(fn, set(), getattr(fn, "__qualname__", type(fn).__name__))).encode()
    ).hexdigest()


def _callable(fn, seen: set, where: str):
    if isinstance(fn, types.FunctionType):
        return _function(fn, seen, where)
    if isinstance(fn, types.MethodType):
        return ("method", _callable(fn.__func__, seen, where), _value(fn.__self__, seen, f"{where}.__self__"))
    if isinstance(fn, functools.partial):
        return (
            "partial",
            _callable(fn.func, seen, where),
            _value(fn.args, seen, f"{where} (partial's arguments)"),
            _value(fn.keywords, seen, f"{where} (partial's keywords)"),
        )
    if isinstance(fn, (types.BuiltinFunctionType, types.MethodWrapperType, type)):
        return ("named", _name(fn))
    call = next((k.__dict__["__call__"] for k in type(fn).__mro__ if "__call__" in k.__dict__), None)
    if isinstance(call, types.FunctionType):  # a callable object: its class's __call__ and its state
        state = vars(fn) if hasattr(fn, "__dict__") else fn
        return ("object", _name(type(fn)), _function(call, seen, where), _value(state, seen, where))
    return ("other", _name(type(fn)), _value(fn, seen, where))  # e.g. a numpy ufunc: by Dask's token


def _function(fn: types.FunctionType, seen: set, where: str):
    if id(fn) in seen:  # recursion: itself, or helpers calling each other
        return ("seen", _name(fn))
    seen.add(id(fn))
    code = fn.__code__
    cells = tuple(
        _value(c.cell_contents if _filled(c) else None, seen, f"{where}: closure value {name!r}")
        for name, c in zip(code.co_freevars, fn.__closure__ or ())
    )
    reads: list[tuple] = []
    for name in _names(code):
        if name in fn.__globals__:
            value = fn.__globals__[name]
            if isinstance(value, types.FunctionType) and value.__module__ != fn.__module__:
                reads.append((name, "named", _name(value)))  # a library's function: by name
            else:
                reads.append((name, _value(value, seen, f"{where}: global {name!r}")))
    return (
        "function",
        _code(code),
        _value(fn.__defaults__, seen, f"{where}: defaults"),
        _value(fn.__kwdefaults__, seen, f"{where}: defaults"),
        cells,
        tuple(reads),
    )


def _code(code: types.CodeType) -> tuple:
    return (
        code.co_name,
        code.co_code,
        tuple(map(_const, code.co_consts)),
        code.co_names,
        code.co_varnames,
        code.co_freevars,
    )


def _const(const):
    """A code constant as text that is the same in every process (a frozenset's order is not)."""
    if isinstance(const, types.CodeType):
        return _code(const)
    if isinstance(const, tuple):
        return tuple(map(_const, const))
    if isinstance(const, frozenset):
        return ("frozenset", tuple(sorted(repr(_const(c)) for c in const)))
    return repr(const)


def _names(code: types.CodeType) -> list[str]:
    """The names a code object (and the code nested in it) reads: globals and attributes."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _names(const)
    return sorted(set(names))


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell (a name assigned after the function was made)
        return False
    return True


def _value(value, seen: set, where: str):
    if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
        return _callable(value, seen, where)
    if isinstance(value, (types.ModuleType, type, types.BuiltinFunctionType)):
        return ("named", _name(value))
    if isinstance(value, (tuple, list)) and any(callable(v) for v in value):
        return (type(value).__name__, tuple(_value(v, seen, where) for v in value))
    if isinstance(value, dict) and any(callable(v) for v in value.values()):
        return ("dict", tuple((repr(k), _value(v, seen, where)) for k, v in value.items()))
    from dask.base import tokenize
    from dask.tokenize import TokenizationError

    try:
        return ("value", tokenize(value, ensure_deterministic=True))
    except TokenizationError:
        raise FingerprintError(f"{where}: a {type(value).__name__} has no stable fingerprint") from None


def _name(obj) -> str:
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', getattr(obj, '__name__', repr(obj)))}"
