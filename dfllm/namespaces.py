""".llm on the dataframe libraries that are installed, whichever of them and dfllm is imported first.

On a library already imported, a stand-in goes on its classes right away; on one imported later,
as soon as it has been (a ``sys.meta_path`` finder watches for it). The first ``.llm`` access
imports dfllm's module for that library (``dfllm/accessors/<library>_ext.py``), whose
``register()`` puts the real namespace in the stand-in's place, and the semantic operators
(:mod:`dfllm.semantic`, a floor above the accessors), which add their methods to it. So
``import dfllm`` loads none of the dataframe stack, and the engine (``from dfllm import LLM``)
runs where none of it is installed. With pandas comes the parser of the nested Arrow dtype
names dfllm's parquet files record (:mod:`dfllm.accessors.arrow_dtypes`).
"""

from __future__ import annotations

import importlib
import sys
import threading
import warnings
from importlib.abc import Loader, MetaPathFinder
from typing import Any

#: The optional packages, each with what installs it.
_PIP = {"dask": "dask[distributed]", "distributed": "dask[distributed]", "polars": "polars"}


def missing_package(exc: ImportError, what: str) -> ImportError:
    """``exc`` with the ``pip install`` command of the optional package it misses, if it is one."""
    package = (exc.name or "").partition(".")[0]
    if package not in _PIP:
        return exc
    return ModuleNotFoundError(
        f"{what} needs {package}, which is not installed: pip install {_PIP[package]}", name=package
    )


#: Each library dfllm puts ``.llm`` on (as imported), its classes that get it, and dfllm's
#: module whose ``register()`` registers the namespace with that library's extension API.
_NAMESPACES: dict[str, tuple[tuple[str, ...], str]] = {
    "pandas": (("DataFrame", "Series"), "dfllm.accessors.pandas_ext"),
    "dask.dataframe": (("DataFrame", "Series"), "dfllm.accessors.dask_ext"),
    "polars": (("DataFrame", "LazyFrame", "Expr"), "dfllm.accessors.polars_ext"),
}
_ATTR = "llm"
_registered: set[str] = set()  # the libraries whose real namespace is in place
_lock = threading.RLock()  # one registration at a time; other threads' first uses wait for it
_registering = threading.local()  # .library: the library this thread is registering


class _StandIn:
    """``.llm`` on a library's classes until its first use, which registers the real one."""

    def __init__(self, library: str) -> None:
        self.library = library

    def __get__(self, obj: object, cls: type) -> Any:
        if getattr(_registering, "library", None) == self.library:
            # the library's registration asking whether the name is taken: not by a stand-in
            raise AttributeError(_ATTR)
        _register(self.library)
        return getattr(cls if obj is None else obj, _ATTR)


def _owners(library: str) -> list[type]:
    module = sys.modules[library]
    return [getattr(module, name) for name in _NAMESPACES[library][0]]


def _stand_in(library: str) -> None:
    """Puts the stand-in ``.llm`` on ``library``'s classes (imported); for pandas, registers
    the parser of nested Arrow dtype names too."""
    if library == "pandas":
        importlib.import_module("dfllm.accessors.arrow_dtypes")
    for owner in _owners(library):
        if _ATTR not in vars(owner):
            setattr(owner, _ATTR, _StandIn(library))


def _register(library: str) -> None:
    """Replaces the stand-ins on ``library`` with dfllm's namespace (imported now). On an
    error they stay, so that the next use tries again (and says the same)."""
    with _lock:
        if library in _registered:
            return
        _registering.library = library
        try:
            import dfllm.semantic  # noqa: F401  (adds the semantic operators to every frame's .llm)

            importlib.import_module(_NAMESPACES[library][1]).register()
        except ImportError as exc:
            raise missing_package(exc, f"{library}'s .llm") from exc
        finally:
            _registering.library = None
        _registered.add(library)
        for owner in _owners(library):  # one the registration missed: no stand-in forever
            if isinstance(vars(owner).get(_ATTR), _StandIn):
                delattr(owner, _ATTR)


class _Watch(MetaPathFinder):
    """Finds nothing itself: for a library of :data:`_NAMESPACES` imported after dfllm, wraps
    the loader the next finders give, to put the stand-ins on once the library has run."""

    def __init__(self, libraries: set[str]) -> None:
        self.waiting = libraries

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.waiting:
            return None
        finders = sys.meta_path[sys.meta_path.index(self) + 1 :] if self in sys.meta_path else []
        for finder in finders:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AfterExec(spec.loader, fullname, self)
                return spec
        return None


class _AfterExec(Loader):
    """A library's own loader, then the stand-ins; the module keeps its own loader."""

    def __init__(self, loader: Any, library: str, watch: _Watch) -> None:
        self.loader, self.library, self.watch = loader, library, watch

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.watch.waiting.discard(self.library)
        if not self.watch.waiting and self.watch in sys.meta_path:
            sys.meta_path.remove(self.watch)
        try:
            _stand_in(self.library)
        except Exception as exc:  # never fail the user's import of the library
            warnings.warn(f"dfllm could not put .llm on {self.library}: {exc!r}", stacklevel=2)

    def __getattr__(self, name: str) -> Any:  # the rest of the library's loader
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


def watch_libraries() -> None:
    waiting = set()
    for library in _NAMESPACES:
        if sys.modules.get(library) is not None:
            try:
                _stand_in(library)
            except Exception as exc:  # a library caught half-imported: never fail ``import dfllm``
                warnings.warn(f"dfllm could not put .llm on {library}: {exc!r}", stacklevel=2)
        else:
            waiting.add(library)
    if waiting:
        sys.meta_path.insert(0, _Watch(waiting))
