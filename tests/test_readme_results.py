"""The results tables of README ("## Results"), docs/SLOW_LINKS.md ("## Measured") and docs/BENCHMARKS.md ("## In
short") cannot drift from the results:
every row links a results file of this repository, and its
figure cell is written in that file as it is in README ("1.64x", "+0.16% [-0.38%, +0.98%]"); a range "A-B s" is two
cells of a table there ("| A |", "| B |"). A figure a later run changed, or one typed from memory, fails here; so does
a row without a file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RANGE = re.compile(r"(\d+(?:\.\d+)?)-(\d+(?:\.\d+)?)(?: \w+)?")


def results_rows(text: str, heading: str = "## Results") -> list:
    """(figure cell, linked path) of every row of the table under ``heading``."""
    section = text[text.index(heading) :]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("what", "") or set(cells[0]) <= {"-"}:
            continue
        link = re.search(r"\]\(([^)]+)\)", cells[3])
        rows.append((cells[1], link.group(1) if link else None))
    return rows


def not_in(figure: str, text: str) -> list:
    """What of ``figure`` ``text`` does not hold: [] when it is there as README writes it (a range: both ends as
    table cells)."""
    ends = RANGE.fullmatch(figure)
    if ends:
        return [n for n in ends.groups() if f"| {n} |" not in text]
    return [] if figure in text else [figure]


TABLES = {"README.md": "## Results", "docs/SLOW_LINKS.md": "## Measured", "docs/BENCHMARKS.md": "## In short"}
ROWS = [
    (page, figure, path)
    for page, heading in TABLES.items()
    for figure, path in results_rows((ROOT / page).read_text(), heading)
]


@pytest.mark.parametrize("page", list(TABLES))
def test_the_tables_have_rows(page):
    assert sum(1 for p, _, _ in ROWS if p == page) >= 4


@pytest.mark.parametrize(("page", "figure", "path"), ROWS, ids=[f"{p}:{f}" for p, f, _ in ROWS])
def test_each_figure_is_in_its_results_file(page, figure, path):
    assert path is not None, f"{page}: the row of {figure!r} links no results file"
    target = (ROOT / page).parent / path
    path = str(target.resolve().relative_to(ROOT))
    assert target.is_file() and "benchmarks/results/" in path, (
        f"{path}: not a results file of this repository"
    )
    missing = not_in(figure, target.read_text())
    assert not missing, f"{figure!r}: {missing} not in {path}"


def test_the_check_catches_a_drifted_figure():
    text = "| acco | 1.64x best-of, 1.71x median | +0.16% [-0.38%, +0.98%] | 1/1.66 |\n| 37.8 | 39.3 |"
    assert not_in("1.64x", text) == []
    assert not_in("1.66x", text) == ["1.66x"]
    assert not_in("+0.16% [-0.38%, +0.99%]", text) == ["+0.16% [-0.38%, +0.99%]"]
    assert not_in("37.8-39.3 s", text) == []
    assert not_in("33.6-39.3 s", text) == ["33.6"]
    readme = "## Results\n\n| what | figure | measured on | results |\n|---|---|---|---|\n| a | 2x | m | none |\n\n## Next\n"
    assert results_rows(readme) == [("2x", None)]
