"""docs/REFERENCE.md's options table is the configuration's: one row per option of ``ACCOConfig`` (compression's
and memory_state's keys as ``<section>.<key>``), its default as the model's default, its allowed values as ``config.ALLOWED`` words
them (what the error messages quote)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acco_ds.config import ALLOWED, SECTIONS, ACCOConfig

ROOT = Path(__file__).resolve().parents[1]


def table_rows() -> dict:
    text = (ROOT / "docs" / "REFERENCE.md").read_text()
    start = text.index("| key | default | allowed |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        key, default, allowed, _ = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[key.strip("`")] = (default, allowed)
    return rows


def shown(value) -> str:
    """A default as the table writes it: strings quoted, JSON's null / true / false, lists as JSON."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value) if value is None or isinstance(value, (bool, list)) else str(value)


def options() -> dict:
    out = {k: f.default for k, f in ACCOConfig.model_fields.items() if k not in SECTIONS}
    for name, section in SECTIONS.items():
        out.update({f"{name}.{k}": f.default for k, f in section.model_fields.items()})
    return out


ROWS = table_rows()


def test_every_option_has_a_row_and_no_row_is_stale():
    assert set(ROWS) == set(options())


@pytest.mark.parametrize("key", sorted(options()))
def test_default_and_allowed_values_are_the_configs(key):
    default, allowed = ROWS[key]
    assert default == shown(options()[key]), key
    assert allowed == ALLOWED[key], key


def test_shown_writes_defaults_as_the_table_does():
    assert [shown(v) for v in ("acco", None, True, (0.9, 0.999), 1e-08, 256)] == [
        "'acco'", "null", "true", "[0.9, 0.999]", "1e-08", "256",
    ]  # fmt: skip
