"""Which GPU-path sources and GPU tests changed since their last GPU pass.

    python scripts/gpu/freshness.py                    # the table (Markdown) on stdout
    python scripts/gpu/freshness.py --markdown FILE    # ... into FILE
    python scripts/gpu/freshness.py --stale-units      # the units of scripts/gpu/steps.py to run first

GPU-path sources (:func:`gpu_sources`): csrc/**/*.cu and every header they include (``#include "..."``, followed
through the headers, from csrc/), acco_ds/ops/triton_kernels/*.py, and the CUDA parts of acco_ds/core
(gpu_steps.CORE_GPU). GPU tests: the test files of gpu_steps.STEPS (tests/gpu/*_gpu.py).

A test file's last GPU pass: the commit of the newest run (scripts/gpu/results.py: the committed results) in which
it ran completely and every one of its tests passed. A source's: the oldest of the last passes of the GPU test
files of the steps whose ``code`` names it (all of them had passed by then), "never" when one never passed; a
source no step names is listed as "no GPU test". Changed since: the working tree differs from that commit for the
file (``git diff --quiet COMMIT -- FILE``: committed and uncommitted changes), or the file did not exist there.
A unit is stale when a step of it has a test file or a named source never passed or changed since; the set-up
steps are never stale. Runs where git is absent fail with exit status 2 (checks.sh then keeps the table's
order).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(stem: str):
    """scripts/gpu/STEM.py as the module ``gpu_STEM`` (the folder is no package: the GPU machine runs each file
    as ``python scripts/gpu/STEM.py``); registered first, its dataclasses look their module up there."""
    name = f"gpu_{stem}"
    spec = importlib.util.spec_from_file_location(name, HERE / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


gpu_steps = _load("steps")
gpu_results = _load("results")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def cuda_sources(root: Path) -> list:
    """csrc/**/*.cu and the headers they include, transitively (paths relative to ``root``)."""
    csrc = root / "csrc"
    seen, todo = set(), sorted(csrc.rglob("*.cu"))
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for inc in INCLUDE.findall(path.read_text(errors="replace")):
            for base in (path.parent, csrc):
                if (base / inc).is_file():
                    todo.append((base / inc).resolve())
                    break
    return sorted(str(p.relative_to(root.resolve())) for p in seen)


def gpu_sources(root: Path) -> list:
    triton = sorted(str(p.relative_to(root)) for p in (root / gpu_steps.TRITON).glob("*.py"))
    core = [c for c in gpu_steps.CORE_GPU if (root / c).is_file()]
    return cuda_sources(root) + triton + core


def covering_tests(source: str, steps=gpu_steps.STEPS) -> list:
    """The GPU test files of the steps whose ``code`` names ``source`` (a path, or a folder prefix ending in /)."""
    out = []
    for s in steps:
        if any(source == c or (c.endswith("/") and source.startswith(c)) for c in s.code):
            out += [t for t in s.tests if t not in out]
    return out


def _commit_time(root: Path, commit: str) -> int:
    return int(gpu_results._git("log", "-1", "--format=%ct", commit, cwd=root))


def changed_since(root: Path, commit: str, path: str) -> bool:
    exists = subprocess.run(["git", "cat-file", "-e", f"{commit}:{path}"], cwd=root, capture_output=True)
    if exists.returncode != 0:
        return True
    return subprocess.run(["git", "diff", "--quiet", commit, "--", path], cwd=root).returncode != 0


def last_passes(runs, root: Path) -> dict:
    """{test file: (commit, run name)} of its newest passing run (by the commit's time, then the run's date)."""
    best: dict = {}
    for run in runs:
        try:
            t = _commit_time(root, run.commit)
        except subprocess.CalledProcessError:
            continue  # a commit this history does not hold
        for f in gpu_results.passed_files(run):
            if f not in best or (t, run.date) >= best[f][0]:
                best[f] = ((t, run.date), run.commit, run.name)
    return {f: (c, n) for f, (_, c, n) in best.items()}


def freshness(root: Path, runs, steps=gpu_steps.STEPS) -> list:
    """[(kind, path, last pass commit or "never" / "no GPU test", via run or tests, changed since: bool | None)]."""
    passes = last_passes(runs, root)
    rows = []
    for t in [t for s in steps for t in s.tests]:
        if t in passes:
            c, name = passes[t]
            rows.append(("test", t, c, name, changed_since(root, c, t)))
        else:
            rows.append(("test", t, "never", "", None))
    for src in gpu_sources(root):
        tests = covering_tests(src, steps)
        if not tests:
            rows.append(("source", src, "no GPU test", "", None))
            continue
        if any(t not in passes for t in tests):
            never = ", ".join(t.split("/")[-1] for t in tests if t not in passes)
            rows.append(("source", src, "never", f"never passed: {never}", None))
            continue
        c = min((passes[t][0] for t in tests), key=lambda commit: _commit_time(root, commit))
        rows.append(
            ("source", src, c, ", ".join(t.split("/")[-1] for t in tests), changed_since(root, c, src))
        )
    return rows


def stale_units(rows, steps=gpu_steps.STEPS) -> list:
    """The units (steps.py) with a test file or named source never passed or changed since, in table order."""
    stale_paths = {path for _, path, commit, _, changed in rows if commit == "never" or changed}
    out = []
    for s in steps:
        if s.unit in gpu_steps.SETUP or s.unit in out:
            continue
        named = set(s.tests) | {p for _, p, *_ in rows if any(p == c or (c.endswith("/") and p.startswith(c))
                                                             for c in s.code)}  # fmt: skip
        if named & stale_paths:
            out.append(s.unit)
    return out


def markdown(rows, units) -> str:
    lines = ["| kind | file | last GPU pass | via | changed since |", "|---|---|---|---|---|"]
    for kind, path, commit, via, changed in rows:
        flag = (
            {True: "CHANGED", False: "no", None: "-"}[changed] if commit not in ("never",) else "never passed"
        )
        lines.append(f"| {kind} | {path} | {commit} | {via} | {flag} |")
    lines += ["", "Stale units (run first): " + (", ".join(units) or "none")]
    return "\n".join(lines) + "\n"


def main(argv) -> int:
    root = gpu_steps.ROOT
    try:
        gpu_results._git("rev-parse", "HEAD", cwd=root)
    except (OSError, subprocess.CalledProcessError):
        sys.stderr.write("freshness: no git history here\n")
        return 2
    rows = freshness(root, gpu_results.load_runs(gpu_steps.RESULTS))
    units = stale_units(rows)
    if argv == ["--stale-units"]:
        print(" ".join(units))
        return 0
    text = markdown(rows, units)
    if len(argv) == 2 and argv[0] == "--markdown":
        Path(argv[1]).write_text(text)
        return 0
    if not argv:
        sys.stdout.write(text)
        return 0
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
