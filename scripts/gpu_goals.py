"""The results of scripts/gpu_checks.sh against the GPU goals of docs/GPU.md, and its JUnit files merged into one.

    python scripts/gpu_goals.py merge-junit OUT.xml IN.xml ...   # one <testsuites> file (missing inputs skipped)
    python scripts/gpu_goals.py goals RESULTS_DIR                # Markdown on stdout

``goals`` reads what the checks wrote into RESULTS_DIR (pytest_gpu.xml, kernels_cuda.json from
python -m benchmarks.kernels, gpu_overlap.json from python -m benchmarks.gpu_overlap) and states, per goal, the
measured figure and whether it meets the goal; a result that is missing is reported as missing, never as met:

- every GPU test passes (none failed, errored or skipped);
- commit and peek move >= 85% of the device-to-device copy bandwidth (bytes read + written, the copy probe of
  the same run), at every size >= 10M parameters;
- peek >= 3x faster than clone/step/restore, at every size >= 10M;
- acco's overlap efficiency >= 90% at every stand-in duration;
- the host never leaves the device without work inside acco's steps: on the kernel timeline of the profiled acco
  steps at every stand-in, no host gap of the compute stream over STALL_THRESHOLD_US (:func:`host_goal_met`;
  benchmarks/gpu_overlap/timeline.py defines a host gap); the host syncs per step (acco's round end waits for the
  previous round's summary by design) and the share of steps the host started ahead are reported as diagnostics.
No torch import: runs anywhere.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

BYTES = {"commit": 28, "peek": 16}  # as benchmarks/kernels/table.py's BYTES
QUANT_BYTES = {  # as benchmarks/kernels/table.py's QUANT_BYTES
    "qres_fp32": 13 + 4 / 256,
    "qres_bf16": 7 + 4 / 256,
    "deq_add": 9 + 4 / 256,
    "deq_sum": 4 * (1 + 4 / 256) + 2,
    "qdiff": 5 + 4 / 256,
    "add_deq": 5 + 4 / 256,
}
BIG = 10_000_000
STALL_THRESHOLD_US = (
    100.0  # as benchmarks/gpu_overlap/timeline.py (this script imports nothing of the project)
)


def stall_bound(meta: dict) -> float:
    """The longest host gap that is not ACCO's: STALL_THRESHOLD_US, or the longest gap of the model alone profiled
    the same way (``compute_host_gaps_us``: the host launching the model's own ops late is not a wait)."""
    model_alone = meta.get("compute_host_gaps_us", []) if meta.get("compute_profiled_steps", 0) else []
    return max([STALL_THRESHOLD_US, *model_alone])


def host_goal_met(settings, meta: dict | None = None) -> bool | None:
    """The host goal on the acco settings of gpu_overlap.json: None without a profiled setting (no result), else
    True when every setting was profiled and none has a host gap over :func:`stall_bound`."""
    if not settings or not any(s.get("profiled_steps", 0) for s in settings):
        return None
    bound = stall_bound(meta or {})
    return all(s.get("profiled_steps", 0) > 0 and max(s.get("host_gaps_us", []), default=0.0) <= bound
               for s in settings)  # fmt: skip


def merge_junit(out: Path, inputs) -> int:
    """Merge JUnit files (each a <testsuite> or <testsuites>) into ``out``; returns the number of suites."""
    root = ET.Element("testsuites")
    for path in map(Path, inputs):
        if not path.is_file() or path.stat().st_size == 0:
            continue
        try:
            top = ET.parse(path).getroot()
        except ET.ParseError:
            continue
        for suite in [top] if top.tag == "testsuite" else top.findall("testsuite"):
            root.append(suite)
    totals = {k: 0 for k in ("tests", "failures", "errors", "skipped")}
    for suite in root:
        for k in totals:
            totals[k] += int(suite.get(k, 0))
    for k, v in totals.items():
        root.set(k, str(v))
    ET.ElementTree(root).write(out, encoding="utf-8", xml_declaration=True)
    return len(root)


def _row(goal: str, figure: str, met) -> str:
    verdict = {True: "met", False: "NOT met", None: "no result"}[met]
    return f"| {goal} | {figure} | {verdict} |"


def tests_goal(results: Path) -> str:
    path = results / "pytest_gpu.xml"
    if not path.is_file():
        return _row("every GPU test passes", "pytest_gpu.xml missing", None)
    root = ET.parse(path).getroot()
    n = {k: int(root.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    suites = ", ".join(s.get("name", "?") for s in root.findall("testsuite"))
    figure = (
        f"{n['tests']} tests: {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped ({suites})"
    )
    return _row(
        "every GPU test passes", figure, n["tests"] > 0 and n["failures"] + n["errors"] + n["skipped"] == 0
    )


def kernel_goals(results: Path) -> list:
    path = results / "kernels_cuda.json"
    if not path.is_file():
        return [
            _row("commit/peek >= 85% of the copy bandwidth", "kernels_cuda.json missing", None),
            _row("peek >= 3x clone/step/restore", "kernels_cuda.json missing", None),
            _row("quantize/dequantize-add >= 80% of the copy bandwidth", "kernels_cuda.json missing", None),
        ]
    res = json.loads(path.read_text())
    copy = res["stream"]["probes"]["copy"]["gbs"]
    fractions, speedups, quant = [], [], []
    for entry in res["results"]:
        n, t = entry["params"], entry["median_s"]
        if n < BIG:
            continue
        for key in ("commit", "peek"):
            fractions.append((n, key, BYTES[key] * n / t[key] / 1e9 / copy))
        if "clone_step_restore" in t:
            speedups.append((n, t["clone_step_restore"] / t["peek"]))
        quant += [(n, key, b * n / t[key] / 1e9 / copy) for key, b in QUANT_BYTES.items() if key in t]
    frac = ", ".join(f"{k} {n / 1e6:g}M {100 * f:.0f}%" for n, k, f in fractions)
    spd = ", ".join(f"{n / 1e6:g}M {s:.1f}x" for n, s in speedups)
    qfrac = ", ".join(f"{k} {n / 1e6:g}M {100 * f:.0f}%" for n, k, f in quant)
    return [
        _row(
            "commit/peek >= 85% of the copy bandwidth",
            f"copy {copy:.0f} GB/s (read + write); {frac or 'no size >= 10M'}",
            bool(fractions) and all(f >= 0.85 for *_, f in fractions),
        ),
        _row("peek >= 3x clone/step/restore", spd or "no clone/step/restore timing", bool(speedups) and all(
            s >= 3 for _, s in speedups)),
        _row(
            "quantize/dequantize-add >= 80% of the copy bandwidth",
            qfrac or "no quantize timing at a size >= 10M",
            bool(quant) and all(f >= 0.80 for *_, f in quant) if quant else None,
        ),
    ]  # fmt: skip


def overlap_goals(results: Path) -> list:
    path = results / "gpu_overlap.json"
    if not path.is_file():
        return [
            _row("acco overlap efficiency >= 90% at every stand-in", "gpu_overlap.json missing", None),
            _row("the host never waits inside a round (acco)", "gpu_overlap.json missing", None),
        ]
    data = json.loads(path.read_text())
    settings = [s for s in data["settings"] if s["mode"] == "acco"]
    base = data["meta"].get("compute_syncs_per_step", 0.0)
    eff = ", ".join(f"x{s['factor']:g} {100 * s['efficiency']:.0f}%" for s in settings)
    syncs = ", ".join(f"x{s['factor']:g} {s['host_syncs_per_step']:g}" for s in settings)
    stall = ", ".join(
        f"x{s['factor']:g} {sum(g > STALL_THRESHOLD_US for g in s.get('host_gaps_us', []))} "
        f"(largest {max(s.get('host_gaps_us', []), default=0.0):.0f} us, {s.get('profiled_steps', 0)} steps)"
        for s in settings
    )
    ahead = ", ".join(f"x{s['factor']:g} {100 * s['host_ahead']:.0f}%" for s in settings)
    meta = data["meta"]
    if meta.get("compute_profiled_steps", 0):
        alone = meta.get("compute_host_gaps_us", [])
        model_alone = (
            f"the model alone {sum(g > STALL_THRESHOLD_US for g in alone)} "
            f"(largest {max(alone, default=0.0):.0f} us, {meta['compute_profiled_steps']} steps)"
        )
    else:
        model_alone = "the model alone not profiled"
    bound = stall_bound(meta)
    return [
        _row(
            "acco overlap efficiency >= 90% at every stand-in",
            eff or "no acco setting",
            bool(settings) and all(s["efficiency"] >= 0.9 for s in settings),
        ),
        _row(
            "the host never waits inside a round (acco)",
            f"host stalls (compute stream idle > {STALL_THRESHOLD_US:g} us, the next op not launched): {stall}; "
            f"{model_alone}; met when no acco gap exceeds {bound:.0f} us (the threshold, or the model alone's "
            f"largest gap); diagnostics: host syncs per step {syncs} (the model alone: {base:g}), steps started "
            f"with the device still busy {ahead}",
            host_goal_met(settings, meta),
        ),
    ]


def goals(results: Path) -> str:
    lines = ["| GPU goal | measured | verdict |", "|---|---|---|", tests_goal(results)]
    lines += kernel_goals(results) + overlap_goals(results)
    return "\n".join(lines) + "\n"


def main(argv) -> int:
    if len(argv) >= 2 and argv[0] == "merge-junit":
        merge_junit(Path(argv[1]), argv[2:])
        return 0
    if len(argv) == 2 and argv[0] == "goals":
        sys.stdout.write(goals(Path(argv[1])))
        return 0
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
