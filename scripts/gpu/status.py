"""docs/GPU.md's status section, rendered from the committed GPU results alone.

    python scripts/gpu/status.py                        # the section on stdout
    python scripts/gpu/status.py --write docs/GPU.md    # replaces the text between BEGIN and END
    python scripts/gpu/status.py --check docs/GPU.md    # exit 1 when the section is not what the results give

Every run of scripts/gpu/results.py's load_runs (benchmarks/results/gpu_checks: legacy_runs.json and each run.json
folder) is listed under its own commit, with what it ran, its test files' results (ran, passed, complete), and
its goal figures computed by scripts/gpu/goals.py from its own JSON: the kernel figures as % of the copy probe of
the same run (bytes read + written) and no other denominator, acco's overlap efficiency per stand-in, acco's and
the model alone's largest host gap. A run passes every GPU test only when each test file of scripts/gpu/steps.py
ran completely in it and every test passed: results from several runs are never added up.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BEGIN = "<!-- gpu-status: begin (scripts/gpu/status.py --write docs/GPU.md renders this; do not edit) -->"
END = "<!-- gpu-status: end -->"


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
gpu_goals = _load("goals")
BIG = gpu_goals.BIG


def _rel(path) -> str:
    try:
        return str(Path(path).resolve().relative_to(gpu_steps.ROOT))
    except ValueError:
        return str(path)


def kernel_figures(path: Path) -> dict | None:
    """{"copy": GB/s, "rows": {(key, params): % of copy}, "speedup": {params: x}} from a kernels_cuda.json."""
    if not path or not Path(path).is_file():
        return None
    res = json.loads(Path(path).read_text())
    copy = res["stream"]["probes"]["copy"]["gbs"]
    rows, speedup = {}, {}
    for entry in res["results"]:
        n, t = entry["params"], entry["median_s"]
        if n < BIG:
            continue
        for key, b in {**gpu_goals.BYTES, **gpu_goals.QUANT_BYTES}.items():
            if key in t:
                rows[(key, n)] = 100 * b * n / t[key] / 1e9 / copy
        if "clone_step_restore" in t:
            speedup[n] = t["clone_step_restore"] / t["peek"]
    return {"copy": copy, "rows": rows, "speedup": speedup}


def overlap_figures(path: Path) -> dict | None:
    if not path or not Path(path).is_file():
        return None
    data = json.loads(Path(path).read_text())
    acco = [s for s in data["settings"] if s["mode"] == "acco"]
    meta = data["meta"]
    return {
        "eff": [(s["factor"], 100 * s["efficiency"]) for s in acco],
        "gap": [(s["factor"], max(s.get("host_gaps_us", []), default=None)) for s in acco],
        "alone": max(meta.get("compute_host_gaps_us", []), default=None)
        if meta.get("compute_profiled_steps")
        else None,
    }


def _fmt_n(n: int) -> str:
    return f"{n / 1e6:g}M"


def run_tests(run) -> tuple:
    """(cell text, passed every GPU test of the table)."""
    outcomes = gpu_results.file_outcomes(run)
    wanted = gpu_steps.test_files()
    cells = []
    for f, o in sorted(outcomes.items()):
        short = f.split("/")[-1].removesuffix(".py")
        status = "" if o["complete"] else ", stopped before its end"
        failed = f", {o['failed']} failed" if o["failed"] else ""
        skipped = f", {o['skipped']} skipped" if o["skipped"] else ""
        cells.append(f"{short} {o['passed']}/{o['ran']}{failed}{skipped}{status}")
    passed = gpu_results.passed_files(run)
    return ("; ".join(cells) or "no test step", all(f in passed for f in wanted))


def render(results: Path = gpu_steps.RESULTS) -> str:
    runs = gpu_results.load_runs(results)
    lines = [
        "Rendered by `python scripts/gpu/status.py --write docs/GPU.md` from the committed results "
        "(`benchmarks/results/gpu_checks/`: `legacy_runs.json` and each run folder's `run.json`); "
        "`tests/gpu/test_gpu_status.py` fails when a figure here is not in the cited run's files. Commit: the HEAD "
        "the run's log printed (tree: what else the run carried, where known). Kernel figures: % of the "
        "device-to-device copy probe of the same run (bytes read + written), the only denominator used here.",
        "",
    ]
    full = [r for r in runs if run_tests(r)[1]]
    if full:
        lines.append("Runs that passed every GPU test of the checks in one invocation: "
                     + ", ".join(f"`{r.name}`" for r in full) + ".")  # fmt: skip
    else:
        lines.append("**No run has yet passed every GPU test of the checks in one invocation** (each test file of "
                     "`scripts/gpu/steps.py` run to its end, every test passed; tests passed in different runs "
                     "are not added up).")  # fmt: skip
    lines += ["", "| run | device | commit (tree) | what ran | steps (s) | test files: passed/ran |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        steps = (
            ", ".join(f"{n} {res} ({s})" for n, _, res, s in r.steps) or "not through scripts/gpu/checks.sh"
        )
        tree = r.tree if r.tree and r.tree != r.commit else r.commit
        cmd = r.command.replace("|", "\\|")
        lines.append(f"| `{r.name}` | {r.device} | {tree} | `{cmd}` | {steps} | {run_tests(r)[0]} |")
    lines += ["", "Kernel goals (% of the copy probe; commit/peek >= 85%, quantize rows >= 80%, "
              "peek >= 3x clone/step/restore):", "",
              "| run | commit | copy GB/s | commit/peek | quantize rows | peek vs clone/step/restore |",
              "|---|---|---:|---|---|---|"]  # fmt: skip
    for r in runs:
        k = kernel_figures(r.files.get("kernels"))
        if not k:
            continue
        cp = ", ".join(f"{key} {_fmt_n(n)} {p:.0f}%" for (key, n), p in sorted(k["rows"].items(), key=lambda x: x[0][1])
                       if key in gpu_goals.BYTES)  # fmt: skip
        qr = ", ".join(f"{key} {_fmt_n(n)} {p:.0f}%" for (key, n), p in sorted(k["rows"].items(), key=lambda x: x[0][1])
                       if key in gpu_goals.QUANT_BYTES)  # fmt: skip
        sp = ", ".join(f"{_fmt_n(n)} {x:.1f}x" for n, x in sorted(k["speedup"].items()))
        lines.append(f"| `{r.name}` | {r.commit} | {k['copy']:.0f} | {cp} | {qr} | {sp} |")
    lines += ["", "Overlap goals (acco's overlap efficiency >= 90% at every stand-in; no acco host gap longer "
              "than the model alone's longest or 100 us):", "",
              "| run | commit | acco overlap efficiency | acco's largest host gap (us) | the model alone's (us) |",
              "|---|---|---|---|---:|"]  # fmt: skip
    for r in runs:
        o = overlap_figures(r.files.get("overlap"))
        if not o:
            continue
        eff = ", ".join(f"x{f:g} {e:.0f}%" for f, e in o["eff"])
        gap = ", ".join(f"x{f:g} {g:.0f}" for f, g in o["gap"] if g is not None) or "not profiled"
        alone = "not profiled" if o["alone"] is None else f"{o['alone']:.0f}"
        lines.append(f"| `{r.name}` | {r.commit} | {eff} | {gap} | {alone} |")
    return "\n".join(lines) + "\n"


def splice(doc: str, section: str) -> str:
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"the document has no {BEGIN} ... {END} markers")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{section}{END}{tail}"


def section_of(doc: str) -> str:
    return doc.split(BEGIN, 1)[1].split(END, 1)[0].lstrip("\n")


def main(argv) -> int:
    section = render()
    if not argv:
        sys.stdout.write(section)
        return 0
    if len(argv) == 2 and argv[0] in ("--write", "--check"):
        path = Path(argv[1])
        doc = path.read_text()
        if argv[0] == "--write":
            path.write_text(splice(doc, section))
            return 0
        if section_of(doc) != section:
            sys.stderr.write(f"{path}: the status section is not what the results give; run --write\n")
            return 1
        return 0
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
