"""docs/GPU.md's status section against the committed GPU results: it is what scripts/gpu/status.py renders from
them, and every figure in it is in the files of the run its row cites (the run's summary, logs, Markdown tables,
JSON: a figure matches a number there at the precision shown, or a count of its JUnit files' tests). acco-plan's
GPU note quotes the range of one run's quantize rows. CPU only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.gpu.gpu_scripts import load

ROOT = Path(__file__).resolve().parents[2]


gpu_status = load("status")
gpu_results = load("results")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _section() -> str:
    return gpu_status.section_of((ROOT / "docs" / "GPU.md").read_text())


def test_the_section_is_what_the_results_give():
    assert _section() == gpu_status.render(), "run: python scripts/gpu/status.py --write docs/GPU.md"


def _pool(run) -> str:
    """The text the run's goal figures were printed into when it ran: its summary.md and its log (which ends with
    the goals table)."""
    return "\n".join(Path(run.files[k]).read_text(errors="replace") for k in ("summary", "log")
                     if k in run.files and Path(run.files[k]).is_file())  # fmt: skip


def _item_found(run, column: str, item: str, pool: str) -> bool:
    """Whether one comma-separated item of a figure column is in the run's files."""
    item = item.strip()
    if column == "steps":  # "kernels timeout (98)": the log's "=== kernels: TIMEOUT ... (98s)"
        m = re.fullmatch(r"(\w+) (\w+) \((\d+)\)", item)
        return bool(m) and (m.group(1), m.group(2), int(m.group(3))) in {
            (n, r, s) for n, _, r, s in run.steps
        }
    if column == "tests":  # "test_x_gpu 7/17": passed / ran, counted in the run's JUnit files
        m = re.fullmatch(r"(test_\w+) (\d+)/(\d+)", item)
        o = gpu_results.file_outcomes(run).get(f"tests/gpu/{m.group(1)}.py") if m else None
        return bool(o) and (o["passed"], o["ran"]) == (int(m.group(2)), int(m.group(3)))
    if column in ("failed", "skipped"):
        n = int(item.split()[0])
        return any(o[column] == n for o in gpu_results.file_outcomes(run).values())
    if column == "copy":
        return f"copy {item} GB/s" in pool
    if column == "gap":
        m = re.fullmatch(r"(x[\d.]+) (\d+)", item)
        return (
            bool(m) and re.search(rf"{re.escape(m.group(1))} \d+ \(largest {m.group(2)} us", pool) is not None
        )
    if column == "alone":
        return re.search(rf"the model alone \d+ \(largest {item} us", pool) is not None
    return re.search(rf"(?<![\w.]){re.escape(item)}(?!\w)", pool) is not None  # "commit 10M 96%", "x0 92%"


COLUMNS = {  # the figure columns of each table of the section (after the run's), by its header's start
    "| run | device |": [None, None, None, "steps", "tests"],
    "| run | commit | copy": [None, "copy", "figures", "figures", "figures"],
    "| run | commit | acco": [None, "figures", "gap", "alone"],
}


def unmatched_figures(section: str) -> list:
    """[(run, item)] for each figure of a table row not found in the files of the run the row cites."""
    runs = {r.name: r for r in gpu_results.load_runs()}
    missing, columns = [], None
    for line in section.splitlines():
        header = next((k for k in COLUMNS if line.startswith(k)), None)
        if header:
            columns = COLUMNS[header]
            continue
        m = re.match(r"\| `([\w.-]+)` \|", line)
        if not m or columns is None:
            continue
        run = runs[m.group(1)]
        pool = _pool(run)
        cells = [c.strip() for c in line.strip().strip("|").split("|")][1:]
        for column, cell in zip(columns, cells):
            if column is None or not NUMBER.search(cell):
                continue
            if column == "tests":
                for part in cell.split("; "):
                    items = part.split(", ")
                    if not _item_found(run, "tests", items[0], pool):
                        missing.append((run.name, items[0]))
                    for extra in items[1:]:
                        kind = extra.split()[-1]
                        if kind in ("failed", "skipped") and not _item_found(run, kind, extra, pool):
                            missing.append((run.name, extra))
                continue
            for item in cell.split(", "):
                if NUMBER.search(item) and not _item_found(run, column, item, pool):
                    missing.append((run.name, item))
    return missing


def test_every_figure_of_the_section_is_in_its_runs_files():
    section = _section()
    assert section.count("| `") >= 20  # the rows are there to check
    assert unmatched_figures(section) == []


def test_a_figure_not_in_the_results_is_found():
    section = _section()
    kernels = section[section.index("| run | commit | copy GB/s |") :].split("\n\n")[0]
    assert unmatched_figures(kernels) == []
    planted = kernels.replace("peek 10M 82%", "peek 10M 87%")  # a figure from memory, not from the run
    assert unmatched_figures(planted) == [("h200_2026-11-28_9524805", "peek 10M 87%")]
    planted = kernels.replace("| 9524805 | 4204 |", "| 9524805 | 4194 |")  # another run's copy bandwidth
    assert unmatched_figures(planted) == [("h200_2026-11-28_9524805", "4194")]
    runs = section[section.index("| run | device |") :].split("\n\n")[0]
    planted = runs.replace("kernels timeout (98)", "kernels ok (98)")  # a stitched pass
    assert unmatched_figures(planted) == [("h200_2026-11-28_9524805", "kernels ok (98)")]
    planted = runs.replace("test_adamw_difference_gpu 7/17", "test_adamw_difference_gpu 31/31")
    assert unmatched_figures(planted) == [("h200_2026-11-28_9524805", "test_adamw_difference_gpu 31/31")]
    overlap = section[section.index("| run | commit | acco") :].split("\n\n")[0]
    planted = overlap.replace("x0.5 4749", "x0.5 3749")
    assert unmatched_figures(planted) == [("h200_2026-11-28_9524805", "x0.5 3749")]


def test_a_stitched_status_is_not_rendered(tmp_path):
    """The section says no run passed every GPU test while none did, whatever several runs add up to."""
    assert "No run has yet passed every GPU test of the checks in one invocation" in _section()
    runs = gpu_results.load_runs()
    assert not [r.name for r in runs if gpu_status.run_tests(r)[1]]


def test_plan_gpu_note_quotes_one_runs_quantize_rows():
    from acco_ds.plan.model import GPU_COMPRESSION_NOTE

    m = re.search(r"moved (\d+)-(\d+)% of the copy bandwidth .*run ([\w-]+) of", GPU_COMPRESSION_NOTE)
    assert m, GPU_COMPRESSION_NOTE
    run = {r.name: r for r in gpu_results.load_runs()}[m.group(3)]
    k = gpu_status.kernel_figures(run.files["kernels"])
    quant = [p for (key, _), p in k["rows"].items() if key in gpu_status.gpu_goals.QUANT_BYTES]
    assert (int(m.group(1)), int(m.group(2))) == (round(min(quant)), round(max(quant)))


@pytest.mark.parametrize("stale", ["One run so far", "one run so far", "gpu_overlap/gpu_checks_summary.md"])
def test_gpu_summaries_are_not_stale(stale):
    """README and docs/GPU.md's summary ("In short") say nothing a later run made false."""
    gpu = (ROOT / "docs" / "GPU.md").read_text()
    summary = gpu[gpu.index("## In short") : gpu.index("## Status")]
    assert stale not in (ROOT / "README.md").read_text()
    assert stale not in summary
