"""Every relative link of README, docs/ and the results' pages (benchmarks/results/) points at a file or folder of this
repository (moved or renamed pages leave no dead link)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "benchmarks" / "results").rglob("*.md")),
]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def dead_links(page: Path) -> list:
    return [
        t
        for t in LINK.findall(page.read_text(errors="replace"))
        if "://" not in t and not (page.parent / t).exists()
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert not dead_links(page), f"{page.relative_to(ROOT)}: dead links {dead_links(page)}"


def test_a_dead_link_is_found(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[ok](p.md) [web](https://x.org/a) [gone](missing.md#part)")
    assert dead_links(page) == ["missing.md"]
