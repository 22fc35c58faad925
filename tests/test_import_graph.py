"""No import cycle among acco_ds's modules.

The graph has one node per module under ``acco_ds/`` (a package is its ``__init__.py``) and an edge
A -> B for every ``import`` or ``from ... import`` in A that names the acco_ds module B, at any depth
in A (function-level imports count: a lazy import hides a cycle, it does not remove it). Relative
imports are resolved against A's package. ``from pkg import name`` is an edge to ``pkg.name`` when that
is a module, else to ``pkg``. The parent packages Python runs on the way to B (``acco_ds/__init__.py``
for every ``acco_ds.x``) are not edges: counting them would put every module in one cycle with the root.

The test fails on any cycle outside ``ALLOWED_CYCLES`` and names its modules in import order.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "acco_ds"

# Cycles known and not yet broken, each as the sorted tuple of its modules, with the reason it stays.
# Empty: add one only with a comment saying why it cannot be broken now; any other cycle fails.
ALLOWED_CYCLES: dict = {}


def module_name(path: Path) -> str:
    """The dotted name of the module at ``path`` (a package's ``__init__.py`` is the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict:
    """Dotted name -> path of every module under acco_ds/."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve_from(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` names (before its imported names)."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(source: str, importer: str, is_package: bool, modules) -> set:
    """The acco_ds modules that the code ``source`` of module ``importer`` imports anywhere in it, as
    dotted names in ``modules`` (``is_package``: ``source`` is a package's ``__init__.py``)."""
    found = set()

    def add(name: str) -> None:
        while name and name not in modules:  # ``import acco_ds.x.y`` where y is a name: take the module
            name = name.rpartition(".")[0]
        if name.startswith("acco_ds") and name != importer:
            found.add(name)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(node, importer, is_package)
            if not base.startswith("acco_ds"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else base)
    return found


def import_graph() -> dict:
    """Dotted module name -> the set of acco_ds modules it imports."""
    modules = all_modules()
    return {
        name: imported_modules(path.read_text(), name, path.name == "__init__.py", modules)
        for name, path in modules.items()
    }


def find_cycles(graph: dict) -> list:
    """Every group of modules that import one another, round a circle (a strongly connected component of more
    than one module, or a module importing itself), each as its sorted list of modules."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = [0]

    def strongconnect(v):  # Tarjan, recursive: the graph is a few hundred nodes
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(components)


def cycle_through(component: list, graph: dict) -> list:
    """A shortest circle from the component's first module back to itself, inside the component: modules where
    each imports the next and the last the first."""
    start, members = component[0], set(component)
    paths, frontier = {start: [start]}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return paths[v]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return component


def test_finds_a_planted_cycle():
    graph = {"a": {"c"}, "b": {"a"}, "c": {"b", "x"}, "x": {"a"}, "d": {"a"}, "e": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c", "x"], ["e"]]
    assert cycle_through(["a", "b", "c", "x"], graph) == ["a", "c", "b"]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_holds_the_package_imports():
    """A reader that found no edge would find no cycle: the graph holds known module- and function-level ones."""
    graph = import_graph()
    assert "acco_ds.plan.planner" in graph["acco_ds.plan.cli"]  # module level
    assert "acco_ds.deepspeed.register" in graph["acco_ds"]  # inside register()
    assert "acco_ds.plan.hfconfig" in graph["acco_ds.plan.cli"]  # inside a function


def test_reads_relative_and_function_level_imports():
    modules = {"acco_ds", "acco_ds.plan", "acco_ds.plan.b", "acco_ds.plan.c", "acco_ds.plan.d", "acco_ds.cli"}
    source = (
        "import os\n"
        "import acco_ds.cli\n"
        "from acco_ds.plan.d import Thing\n"
        "def f():\n"
        "    from .b import thing\n"
        "    from . import c\n"
        "    from .. import config_name\n"
    )
    found = imported_modules(source, "acco_ds.plan.probe", False, modules)
    assert found == {"acco_ds.cli", "acco_ds.plan.d", "acco_ds.plan.b", "acco_ds.plan.c", "acco_ds"}
    assert imported_modules("from .b import x\n", "acco_ds.plan", True, modules) == {"acco_ds.plan.b"}


def test_no_import_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    new = [c for c in cycles if tuple(c) not in ALLOWED_CYCLES]
    assert not new, "import cycles among acco_ds's modules:\n" + "\n".join(
        " -> ".join(cycle_through(c, graph) + [c[0]])
        + (f"  (the circle's modules: {c})" if len(c) > 2 else "")
        for c in new
    )
    stale = sorted(set(ALLOWED_CYCLES) - {tuple(c) for c in cycles})
    assert not stale, f"ALLOWED_CYCLES lists cycles that no longer exist, remove them: {stale}"
