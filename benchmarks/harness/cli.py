"""The command line the benchmarks share: ``parser(benchmark, doc)`` is the argument parser of
``python -m benchmarks.<benchmark>``, its description the module docstring ``doc`` as written
(usage lines and all); ``add_outputs``, ``rates`` and ``sweep_defaults`` are the options the two
sweeps (e2e, topology) have in common."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.harness import link
from benchmarks.harness.records import results_dir


def parser(benchmark: str, doc: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=f"python -m benchmarks.{benchmark}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_outputs(ap: argparse.ArgumentParser, benchmark: str) -> None:
    """``--out`` (default ``benchmarks/results/<benchmark>/``), ``--prefix``, ``--work``, ``--from-json``
    of a sweep (the e2e and topology benchmarks)."""
    ap.add_argument("--out", default=str(results_dir(benchmark)), help="folder of the table, JSON and plots")
    ap.add_argument(
        "--prefix", default=None, help=f"file name prefix (default {benchmark}, quick: {benchmark}_quick)"
    )
    ap.add_argument("--work", default=None, help="scratch folder of the runs (default: a new temp folder)")
    ap.add_argument("--from-json", default=None, help="re-render the table and plots from a saved raw JSON")


def rates(ap: argparse.ArgumentParser, text: str | None, quick: bool, default: str) -> list:
    """The ``--rates`` of a sweep (``text``; default ``default``, quick: 200mbit), each checked."""
    out = (text or ("200mbit" if quick else default)).split(",")
    for r in out:
        try:
            link.check_rate(r)
        except ValueError as err:
            ap.error(f"--rates: {err}")
    return out


def sweep_defaults(ap: argparse.ArgumentParser, a: argparse.Namespace, benchmark: str, steps: int) -> None:
    """A sweep's ``--steps`` (default ``steps``, quick 6), ``--warmup`` (default 5, quick 2; the steps
    must exceed it by at least 3), ``--seeds`` (default 0,1,2, quick 0) and ``--prefix`` (with ``--from-json``:
    the JSON's own name, so a re-render rewrites the files it came from)."""
    a.steps = a.steps or (6 if a.quick else steps)
    a.warmup = a.warmup if a.warmup is not None else (2 if a.quick else 5)
    if a.steps < a.warmup + 3:
        ap.error(f"--steps {a.steps} must exceed --warmup {a.warmup} by at least 3 to time anything")
    a.seeds = a.seeds or ([0] if a.quick else [0, 1, 2])
    if a.prefix is None and getattr(a, "from_json", None):  # a re-render keeps the results' own name
        a.prefix = Path(a.from_json).stem
    a.prefix = a.prefix or (f"{benchmark}_quick" if a.quick else benchmark)
