"""h3core's import graph, read from the source: no cycle, and the layer contract of docs/architecture.md.

Every import counts: at module level, inside functions, under `TYPE_CHECKING`. An import names the
module it loads (`from h3core.model import attention` is an edge to `h3core.model.attention`; `from
h3core.model.dit import H3Model` one to `h3core.model.dit`). The layers are ordered from the bottom;
a module may import from its own layer or a lower one, never from a higher one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "h3core"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("vocabulary", ("h3core", "h3core.errors", "h3core.span", "h3core.media")),
    ("settings", ("h3core.settings",)),
    ("files", ("h3core.files",)),
    ("reports", ("h3core.reports",)),
    ("pod", ("h3core.pod",)),
    ("runtime", ("h3core.runtime",)),
    ("nvfp4", ("h3core.nvfp4",)),
    ("checkpoints", ("h3core.checkpoints",)),
    ("text", ("h3core.text",)),
    ("decode", ("h3core.decode",)),
    ("keyframes", ("h3core.keyframes",)),
    ("model", ("h3core.model", "h3core.lora")),
    ("parallel", ("h3core.parallel",)),
    ("commands", ("h3core.bench", "h3core.generate")),
    ("suites", ("h3core.batch", "h3core.matrix", "h3core.verify")),
    ("serve", ("h3core.serve",)),
]
"""docs/architecture.md's layer contract, lowest first: (name, module prefixes)."""


def module_names() -> dict[str, Path]:
    """Every module of h3core by dotted name (a package by its own name, for its __init__)."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The h3core modules `path` imports, wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def layer_of(module: str) -> int:
    """The index of the layer whose longest prefix matches `module`."""
    best, index = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    assert index is not None, f"{module} is in no layer: add it to LAYERS and to docs/architecture.md's layout"
    return index


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), and self-imports."""
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_from_every_module():
    graph = import_graph()
    assert "h3core.generate.pipeline" in graph and "h3core.parallel.parallelize" in graph["h3core.generate.pipeline"]
    # function-level imports count: resolve() imports the memory check inside the function
    assert "h3core.generate.memory" in graph["h3core.generate.request"]


def test_h3core_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_a_cycle_is_found_where_there_is_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_every_module_imports_only_its_own_or_lower_layers():
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert upward == []


@pytest.mark.parametrize("name, prefixes", LAYERS)
def test_the_readme_documents_each_layer(name, prefixes):
    readme = (ROOT.parent / "docs" / "architecture.md").read_text()
    layout = readme[readme.index("## Layout") :]
    for prefix in prefixes:
        if prefix != "h3core":
            assert prefix.removeprefix("h3core.") in layout, f"docs/architecture.md's layout does not name {prefix}"
