"""Every reduce-scatter and all-gather of a single tensor in ``acco_ds.core`` and ``acco_ds.ops`` goes through
``acco_ds.core.comm.reduce_scatter_single`` / ``all_gather_single``: the wrappers pick torch's current name at call
time (where a byte counter, ``acco_ds.cli.wire_bytes.WireCounter``, may have wrapped it) and fall back to the
older name on torch < 2.10. A module that calls ``torch.distributed``'s deprecated names (``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``_all_gather_base``, ``_reduce_scatter_base``) or the current ones directly bypasses
that choice; this test reads every module's source with ``ast`` and fails on any such use outside the wrappers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("acco_ds/core", "acco_ds/ops")
DEPRECATED = {"all_gather_into_tensor", "reduce_scatter_tensor", "_all_gather_base", "_reduce_scatter_base"}
CURRENT = {"all_gather_single", "reduce_scatter_single"}
WRAPPERS = {("acco_ds/core/comm.py", "reduce_scatter_single"), ("acco_ds/core/comm.py", "all_gather_single")}
"""(module, function) pairs allowed to name torch's collectives: the wrappers themselves."""


def modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _is_dist(node: ast.AST, aliases: set) -> bool:
    """``node`` spells the ``torch.distributed`` module: ``torch.distributed`` or a name bound to it."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "distributed"
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    )


def bypasses(source: str, path: str) -> list[str]:
    """``line: what`` for each use of a banned name in ``source`` (the module at ``path``, relative to the root)
    outside the wrappers: an attribute of ``torch.distributed`` (``dist.all_gather_into_tensor``, called or not),
    a ``from torch.distributed import`` of one, or the name as a string (``getattr(dist, "...")``)."""
    tree = ast.parse(source)
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and node.level == 0:
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    allowed_lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and (path, node.name) in WRAPPERS:
            allowed_lines |= set(range(node.lineno, node.end_lineno + 1))
    banned = DEPRECATED | CURRENT
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Attribute) and node.attr in banned and _is_dist(node.value, aliases):
            what = f"torch.distributed.{node.attr}"
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            names = [a.name for a in node.names if a.name in banned]
            what = f"from torch.distributed import {', '.join(names)}" if names else None
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in banned:
            what = f"the name {node.value!r}"
        if what is not None and node.lineno not in allowed_lines:
            found.append((node.lineno, f"{path}:{node.lineno}: {what}"))
    return [text for _, text in sorted(found)]


@pytest.mark.parametrize("path", [str(p.relative_to(ROOT)) for p in modules()])
def test_no_module_bypasses_the_collective_wrappers(path):
    found = bypasses((ROOT / path).read_text(), path)
    assert not found, (
        "call acco_ds.core.comm.all_gather_single / reduce_scatter_single instead of torch.distributed's "
        "collectives of a single tensor:\n  " + "\n  ".join(found)
    )


def test_the_check_sees_every_spelling():
    source = """
import torch
import torch.distributed as dist
import torch.distributed as td
from torch import distributed
from torch.distributed import all_gather_into_tensor

def f(a, b):
    dist.all_gather_into_tensor(a, b)
    td.reduce_scatter_tensor(a, b)
    distributed._all_gather_base(a, b)
    torch.distributed._reduce_scatter_base(a, b)
    fn = getattr(dist, "all_gather_single")
    dist.reduce_scatter_single(a, b)
    other.all_gather_into_tensor(a, b)  # not torch.distributed: allowed
"""
    found = bypasses(source, "acco_ds/core/example.py")
    assert [int(line.split(": ", 1)[0].rsplit(":", 1)[1]) for line in found] == [6, 9, 10, 11, 12, 13, 14], (
        found
    )


def test_the_wrappers_themselves_are_allowed_and_only_there():
    source = """
import torch.distributed as dist

def all_gather_single(output, input, group=None):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)

def elsewhere(output, input):
    dist.all_gather_into_tensor(output, input)
"""
    assert bypasses(source, "acco_ds/core/comm.py") == [
        "acco_ds/core/comm.py:9: torch.distributed.all_gather_into_tensor"
    ]
    assert len(bypasses(source, "acco_ds/core/other.py")) == 3


def test_every_package_is_read():
    names = {str(p.relative_to(ROOT)) for p in modules()}
    assert {"acco_ds/core/round_job.py", "acco_ds/core/compressed_comm.py", "acco_ds/ops/adamw.py"} <= names
