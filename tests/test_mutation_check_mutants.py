"""scripts/mutation_check.py's mutants stay in step with the code: each one's source text occurs exactly once in
its file (otherwise the script reports it stale and it checks nothing), its replacement differs, and the tests
it names exist. Running the mutants themselves takes about 40 minutes: ``python scripts/mutation_check.py``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
mutation_check = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = mutation_check  # dataclasses resolve their module by name
_spec.loader.exec_module(mutation_check)


@pytest.mark.parametrize("m", mutation_check.MUTANTS, ids=lambda m: m.id)
def test_mutant_text_is_there_once(m):
    text = (ROOT / m.path).read_text()
    assert text.count(m.old) == 1, f"{m.id}: its source text occurs {text.count(m.old)} times in {m.path}"
    assert m.new != m.old
    for test in m.tests:
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file(), f"{m.id}: {path} is missing"
        assert not name or f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), (
            f"{m.id}: {test} is missing"
        )


def test_mutant_ids_are_unique():
    ids = [m.id for m in mutation_check.MUTANTS]
    assert len(ids) == len(set(ids))
