"""docs/DEVELOPING.md's "How it is built" is a complete map of the package, and the dependency rules it states hold.

The map is the first fenced block under that heading. An unindented line naming a folder (``acco_ds/core/``)
opens a package; the indented ``name.py`` lines below it are that package's modules; an unindented
``acco_ds/x.py`` is a top-level module. Every module under ``acco_ds/`` must be listed (``__init__.py``
only where it holds more than re-exports: the package root), and every listed module must exist.

The rules (``ALLOWED``) say which of acco_ds's packages each one may import, at any depth in a module
(function-level imports included), and which packages alone may import DeepSpeed and Triton.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "acco_ds"

# package (or top-level module) -> the acco_ds packages it may import
ALLOWED = {
    "ops": set(),
    "config": {"ops"},
    "data": set(),
    "models": set(),
    "plan": set(),
    "core": {"config", "ops"},
    "deepspeed": {"config", "core", "ops"},
    "cli": {"config", "core", "ops", "deepspeed", "data", "models", "plan", "(root)"},
    "train": {"cli"},
    "run": {"(root)"},
    "(root)": {"config", "deepspeed"},
}
# third-party packages only some of ours may import
EXTERNAL_ONLY_IN = {
    "deepspeed": {"deepspeed", "cli", "(root)"},
    "triton": {"ops"},
}


def _map_block() -> str:
    text = (ROOT / "docs" / "DEVELOPING.md").read_text()
    head = text.index("## How it is built")
    start = text.index("```", head)
    end = text.index("```", start + 3)
    return text[start + 3 : end]


def listed_modules() -> set:
    listed, current = set(), None
    for line in _map_block().splitlines():
        token = line.split()[0] if line.strip() else ""
        if not token:
            continue
        if not line.startswith(" "):
            current = token if token.endswith("/") else None
            if token.endswith(".py"):
                listed.add(token)
        elif current is not None and token.endswith(".py"):
            listed.add(current + token)
    return listed


def actual_modules() -> set:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" and path.parent != PACKAGE:
            continue
        found.add(rel)
    return found


def test_every_module_is_on_the_map():
    missing = sorted(actual_modules() - listed_modules())
    assert not missing, f"modules missing from docs/DEVELOPING.md's 'How it is built': {missing}"


def test_every_listed_module_exists():
    stale = sorted(listed_modules() - actual_modules())
    assert not stale, f"docs/DEVELOPING.md's 'How it is built' lists modules that do not exist: {stale}"


def _owner(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    if len(rel.parts) == 1:
        return "(root)" if rel.name == "__init__.py" else rel.stem
    return rel.parts[0]


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_dependency_rules():
    broken = []
    for path in PACKAGE.rglob("*.py"):
        owner = _owner(path)
        assert owner in ALLOWED, (
            f"{path}: no rule for {owner!r} in ALLOWED: add one (and to docs/DEVELOPING.md's map)"
        )
        for name in _imports(path):
            top, *rest = name.split(".")
            if top == "acco_ds":
                target = "(root)" if not rest else rest[0]
                if target != owner and target not in ALLOWED[owner]:
                    broken.append(
                        f"{path.relative_to(ROOT)} imports {name} ({owner} may not import {target})"
                    )
            elif top in EXTERNAL_ONLY_IN and owner not in EXTERNAL_ONLY_IN[top]:
                broken.append(
                    f"{path.relative_to(ROOT)} imports {name} (only {sorted(EXTERNAL_ONLY_IN[top])})"
                )
    assert not broken, "\n".join(broken)
