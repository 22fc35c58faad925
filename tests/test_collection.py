"""Every test file of tests/ is one the suite runs and ruff lints: no folder on its path is one that pytest does not
recurse into (``norecursedirs``: by default ``build``, ``dist``, ``venv``, dot-folders, ...) or that ruff's
``exclude`` in pyproject.toml leaves out. A test folder named ``build`` was collected by neither."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def _test_files() -> list:
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 50, files  # the walk found the suite
    return files


def _hidden(patterns: list) -> dict:
    """{test file: [(folder, pattern), ...]} for every test file with a folder on its path that ``patterns`` match."""
    out = {}
    for path in _test_files():
        folders = path.relative_to(ROOT).parts[:-1]
        why = [(f, p) for f in folders for p in patterns if fnmatch.fnmatch(f, p)]
        if why:
            out[str(path.relative_to(ROOT))] = why
    return out


def test_pytest_recurses_into_every_test_folder(request):
    patterns = request.config.getini("norecursedirs")
    assert "build" in patterns  # pytest's default list, which the check reads
    assert _hidden(patterns) == {}


def _ruff_excludes() -> list:
    """The names in ``[tool.ruff]``'s ``exclude`` and ``extend-exclude`` lists (tomllib is Python >= 3.11; this
    project runs on 3.10)."""
    toml = (ROOT / "pyproject.toml").read_text()
    section = toml.split("[tool.ruff]", 1)[1].split("\n[", 1)[0]
    lists = re.findall(r"^(?:extend-)?exclude\s*=\s*\[(.*?)\]", section, flags=re.S | re.M)
    assert len(lists) == 2, lists
    return [name for body in lists for name in re.findall(r'"([^"]+)"', body)]


def test_ruff_lints_every_test_file():
    patterns = _ruff_excludes()
    assert "build" in patterns and "benchmarks/results" in patterns
    assert _hidden(patterns) == {}
