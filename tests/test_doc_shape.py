"""The docs stay short: no prose paragraph of README.md or docs/*.md runs past 12 lines, and docs/GPU.md stays
within 38 KB (per-run findings and predictions go in tables or beside the run's results, benchmarks/results/...).

A paragraph is a run of consecutive non-blank lines that are prose: fenced code blocks, indented code blocks,
tables, headings, HTML comments and list items (with their continuation lines, and the indented paragraphs that
belong to an item) are not prose."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_LINES = 12
GPU_PAGE = ROOT / "docs" / "GPU.md"
GPU_MAX_BYTES = 38 * 1024

FENCE = re.compile(r"^\s*(```|~~~)")
LIST_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s+\S")
HEADING = re.compile(r"^\s{0,3}#{1,6}(\s|$)")


def long_paragraphs(text: str, max_lines: int = MAX_LINES) -> list:
    """(first line, length) of every prose paragraph of ``text`` longer than ``max_lines`` lines (1-based)."""
    found = []
    block = None  # the kind of the block the previous line belongs to: None after a blank line
    start = count = 0
    in_list = False  # the last block before the blank lines was a list: indented blocks continue it
    fence = None

    def flush():
        if block == "prose" and count > max_lines:
            found.append((start, count))

    for number, line in enumerate(text.splitlines(), start=1):
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        opening = FENCE.match(line)
        if opening:
            flush()
            block, fence = None, opening.group(1)
            continue
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if not stripped:
            flush()
            block = None
            continue
        if HEADING.match(line) or stripped.startswith(("|", "<!--")):
            kind = "other"
        elif LIST_ITEM.match(line):
            kind = "list"
        elif block in ("list", "code"):
            kind = block if block == "list" or indent >= 4 else "prose"
        elif block is None and indent >= 2 and in_list:
            kind = "list"
        elif block is None and indent >= 4:
            kind = "code"
        else:
            kind = "prose"
        if kind != block or (kind == "list" and LIST_ITEM.match(line)):
            flush()
            start, count = number, 0
        block = kind
        count += 1
        if kind == "list":
            in_list = True
        elif kind in ("prose", "other"):
            in_list = False
    flush()
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_prose_paragraph_runs_past_12_lines(page):
    found = long_paragraphs(page.read_text(errors="replace"))
    where = ", ".join(f"line {line} ({n} lines)" for line, n in found)
    assert not found, f"{page.relative_to(ROOT)}: prose paragraphs over {MAX_LINES} lines at {where}"


def test_gpu_page_stays_within_38_kb():
    size = len(GPU_PAGE.read_bytes())
    assert size <= GPU_MAX_BYTES, (
        f"{GPU_PAGE.relative_to(ROOT)}: {size} bytes, over {GPU_MAX_BYTES} (38 KB): move per-run findings "
        "and predictions beside the run's results (benchmarks/results/...)"
    )


def test_a_long_paragraph_is_found():
    prose = "\n".join(f"line {i} of the text" for i in range(13))
    assert long_paragraphs(f"# Title\n\n{prose}\n\nshort\n") == [(3, 13)]
    twelve = "\n".join(prose.splitlines()[:12])
    assert long_paragraphs(f"{twelve}\n\n{twelve}\n") == []
    # a table, a heading or a fence ends a paragraph; the pieces are counted apart
    assert long_paragraphs(f"{twelve}\n| a | b |\n{twelve}\n") == []
    assert long_paragraphs(f"{twelve}\n## Head\n{twelve}\n") == []
    assert long_paragraphs(f"{twelve}\n```\ncode\n```\n{twelve}\n") == []
    # a paragraph right after a table, a heading or a list's end (blank line) is still prose
    assert long_paragraphs(f"| a |\n{prose}\n") == [(2, 13)]
    assert long_paragraphs(f"- item\n\n{prose}\n") == [(3, 13)]
    # a line that only starts with "#" or a number is prose, not a heading or a list item
    assert long_paragraphs("#1 issue\n2026 was\n" + "\n".join(prose.splitlines()[:11])) == [(1, 13)]


def test_code_tables_lists_and_headings_are_not_prose():
    many = "\n".join(f"text {i}" for i in range(20))
    fenced = f"```bash\n{many}\n```\n"
    tilde = f"~~~\n{many}\n~~~\n"
    indented = "intro\n\n" + "\n".join(f"    cmd {i}" for i in range(20)) + "\n"
    table = "\n".join(f"| {i} | x |" for i in range(20)) + "\n"
    items = "\n".join(f"- item {i}" for i in range(20)) + "\n"
    numbered = "\n".join(f"{i}. item" for i in range(1, 21)) + "\n"
    item_with_continuation = "- an item\n" + "\n".join(f"  more of it {i}" for i in range(20)) + "\n"
    lazy_continuation = "- an item\n" + many + "\n"
    item_paragraph = "- an item\n\n" + "\n".join(f"  its second paragraph {i}" for i in range(20)) + "\n"
    headings = "\n".join(f"## heading {i}" for i in range(20)) + "\n"
    for text in (
        fenced,
        tilde,
        indented,
        table,
        items,
        numbered,
        item_with_continuation,
        lazy_continuation,
        item_paragraph,
        headings,
    ):
        assert long_paragraphs(text) == [], text
    # a fence inside a list item hides its lines too
    assert long_paragraphs(f"- item:\n\n  ```\n{many}\n  ```\n") == []
