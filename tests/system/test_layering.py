"""dfllm's folders are layers a row passes down through: every import in ``dfllm/`` (function-level
and ``TYPE_CHECKING`` ones included) points to its own layer or one below, no modules (and no
folders) import each other in a circle, and no module imports a ``_private`` name (or module)
from another folder. See docs/architecture.md for the route these layers draw."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "dfllm"

#: Top to bottom. A module belongs to the first entry naming its folder or module.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("dfllm", "dfllm.namespaces"),  # the package's facade: what ``import dfllm`` gives, and .llm on the libraries
    ("dfllm.jobs",),  # the CLI, Ray's processor, OpenAI batch files
    ("dfllm.semantic",),  # the semantic operators, added to .llm from above the accessors
    ("dfllm.accessors",),  # .llm on Dask, pandas and Polars; placement; the parquet writer
    ("dfllm.tasks",),  # a task as data, its rows, its runners
    ("dfllm.dashboard",),  # the Dask dashboard's page, reading the worker's leaf counters
    ("dfllm.worker",),  # the engine cache and driver thread of a worker process
    ("dfllm.llm", "dfllm.llm_pooling", "dfllm.llm_control", "dfllm.beam_search"),  # the LLM class
    ("dfllm.engine",),
    ("dfllm.config",),  # the engine's arguments resolved against the model
    ("dfllm.engine_args",),  # each argument of LLM defined once
    ("dfllm.lora",),
    ("dfllm.models",),
    ("dfllm.multimodal",),
    ("dfllm.distributed",),
    ("dfllm.kernels",),
    (
        "dfllm.errors",
        "dfllm.logger",
        "dfllm.outputs",
        "dfllm.sampling_params",
        "dfllm.pooling_params",
        "dfllm.inputs",
        "dfllm.structured_outputs",
        "dfllm.reasoning",
    ),  # plain types every layer shares
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The dfllm modules ``name`` imports anywhere in its file (an imported name that is a
    module counts as that module; else its package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def layer(name: str) -> int:
    """The index in :data:`LAYERS` of the layer holding module ``name``."""
    for i, prefixes in enumerate(LAYERS):
        if any(name == p or (p != "dfllm" and name.startswith(p + ".")) for p in prefixes):
            return i
    raise AssertionError(f"{name} is in no layer: add its folder or module to LAYERS in {__file__}")


def test_every_module_has_a_layer():
    for name in MODULES:
        layer(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name):
    upward = sorted(t for t in GRAPH[name] if layer(t) < layer(name))
    assert not upward, f"{name} (layer {LAYERS[layer(name)][0]}) imports from layers above it: {upward}"


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert circles(GRAPH) == []


def test_the_checks_see_circles_and_upward_imports():
    # the checks themselves: a planted circle is found, and a worker module importing the
    # accessors would be an upward import
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer("dfllm.worker.engine_cache") > layer("dfllm.accessors.writer")
    assert "dfllm.worker.progress" in GRAPH["dfllm.worker.engine_cache"]


def folder(name: str) -> str:
    """The folder (package) holding module ``name``: ``dfllm.engine`` for ``dfllm.engine.sampler``;
    a module at the root (``dfllm.llm``, ``dfllm.errors``, the package's facade) is its own."""
    path = MODULES[name]
    if path.parent == ROOT:
        return name
    return ".".join(path.parent.relative_to(ROOT.parent).parts)


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` between folders: one folder imports another if any of its modules does."""
    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        out.setdefault(folder(name), set()).update(folder(t) for t in targets if folder(t) != folder(name))
    return out


def test_no_folder_circles():
    assert circles(folder_graph(GRAPH)) == []


def test_the_checks_see_the_semantic_floor():
    # planted: an accessor importing the semantic operators again (as before issue 49) is an
    # upward import, and closes a circle of folders
    assert layer("dfllm.accessors.pandas_ext") > layer("dfllm.semantic.methods")
    planted = dict(GRAPH)
    planted["dfllm.accessors.pandas_ext"] = GRAPH["dfllm.accessors.pandas_ext"] | {"dfllm.semantic.methods"}
    assert circles(folder_graph(planted)) == [["dfllm.accessors", "dfllm.semantic"]]


def private_imports(name: str, source: str) -> list[str]:
    """``module.name`` of each ``_private`` name (or name of a ``_private`` module) that module
    ``name``, whose source is ``source``, imports from a folder other than its own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dfllm") and not node.level:
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                module = target if target in MODULES else node.module
                private = [p for p in target.split(".") if p.startswith("_") and not p.startswith("__")]
                if private and module in MODULES and folder(module) != folder(name):
                    found.append(target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES and folder(alias.name) != folder(name):
                    if any(p.startswith("_") and not p.startswith("__") for p in alias.name.split(".")):
                        found.append(alias.name)
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_imports_across_folders(name):
    found = private_imports(name, MODULES[name].read_text())
    assert not found, f"{name} imports private names of another folder: {found} (give them a public face)"


def test_the_checks_see_folder_circles_and_private_imports():
    # planted: a circle between two folders whose modules import no module twice, and private
    # reach-ins across folders (a name, a module), while the same folder's are allowed
    planted = {
        "dfllm.engine.sampler": {"dfllm.kernels.backend"},
        "dfllm.kernels.backend": {"dfllm.engine.scheduler"},
        "dfllm.engine.scheduler": set(),
    }
    assert circles(planted) == []
    assert circles(folder_graph(planted)) == [["dfllm.engine", "dfllm.kernels"]]
    assert private_imports("dfllm.jobs.cli", "from dfllm.accessors.writer import _survey, write_parquet") == [
        "dfllm.accessors.writer._survey"
    ]
    assert private_imports("dfllm.engine.sampler", "from dfllm.kernels import _cpu") == ["dfllm.kernels._cpu"]
    assert private_imports("dfllm.engine.sampler", "import dfllm.kernels._cpu") == ["dfllm.kernels._cpu"]
    assert private_imports("dfllm.kernels.backend", "from dfllm.kernels import _cpu") == []
