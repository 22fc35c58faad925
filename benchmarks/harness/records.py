"""Where the benchmarks' results go, and how a report is written and read back.

Contract:
- ``results_dir(benchmark)``: ``benchmarks/results/<benchmark>/``, the default output folder of
  ``python -m benchmarks.<benchmark>`` (what is committed: the Markdown table, the raw JSON, the
  plots).
- ``write_report(out, prefix, md, raw, plot)`` writes ``<out>/<prefix>.md`` (``md``) and
  ``<out>/<prefix>.json`` (``raw`` as JSON, indent 1; values JSON cannot hold as strings), then
  the plots (``plot(out, prefix)`` returns the paths it wrote), and returns ``md`` followed by a
  ``wrote <path>`` line per file.
- ``load_results(path)``: the ``"results"`` of such a raw JSON: everything ``--from-json``
  re-renders the same Markdown, JSON and plots from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

RESULTS = Path(__file__).resolve().parents[1] / "results"


def results_dir(benchmark: str) -> Path:
    """The committed results folder of ``benchmark``."""
    return RESULTS / benchmark


def write_report(
    out: Path,
    prefix: str,
    md: str,
    raw: dict,
    plot: Callable[[Path, str], Iterable[Path]] | None = None,
) -> str:
    """Write the table, the raw JSON and the plots (see the module docstring)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md_path, json_path = out / f"{prefix}.md", out / f"{prefix}.json"
    md_path.write_text(md)
    json_path.write_text(json.dumps(raw, indent=1, default=str))
    paths = list(plot(out, prefix)) if plot else []
    return md + "\n" + "\n".join(f"wrote {p}" for p in [md_path, json_path, *paths])


def load_results(path) -> dict:
    """The ``results`` of a raw JSON written by ``write_report``."""
    return json.loads(Path(path).read_text())["results"]
