"""The results of scripts/gpu/checks.sh against the GPU goals of docs/GPU.md, and its JUnit files merged into one.

    python scripts/gpu/goals.py merge-junit OUT.xml IN.xml ...   # one <testsuites> file (missing inputs skipped)
    python scripts/gpu/goals.py goals RUN_DIR                    # Markdown on stdout; exit 0 only if all met

``goals`` reads what scripts/gpu/checks.sh wrote into RUN_DIR (steps.tsv: each step's limit, result and seconds;
collected_STEP.txt: the node ids each test step collected; junit_STEP.xml; kernels_cuda.json from
python -m benchmarks.kernels; gpu_overlap.json from python -m benchmarks.gpu_overlap; offload.json from
python -m benchmarks.offload) and states, per goal, the
measured figure and whether it meets the goal, then one verdict: ALL MET only when every row is met. A result that
is missing is never met: a step of scripts/gpu/steps.py's table that is not in steps.tsv, was not selected, was
skipped or timed out, a test collected but without a result, a benchmark whose step did not end ok, are NOT met.

- every GPU test passes: every test step of the table ran to its end (ok or failed, not stopped), and each of the
  tests it collected passed (none failed, errored, skipped or not run);
- commit and peek move >= 85% of the device-to-device copy bandwidth (bytes read + written, the copy probe of
  the same run), at every size >= 10M parameters;
- peek >= 3x faster than clone/step/restore, at every size >= 10M;
- acco's overlap efficiency >= 90% at every stand-in duration;
- the host never leaves the device without work inside acco's steps: on the kernel timeline of the profiled acco
  steps at every stand-in, no host gap of the compute stream over STALL_THRESHOLD_US (:func:`host_goal_met`;
  benchmarks/gpu_overlap/timeline.py defines a host gap); the host syncs per step (acco's round end waits for the
  previous round's summary by design) and the share of steps the host started ahead are reported as diagnostics;
- the offload benchmark's goals (docs/GPU.md section 7), judged from offload.json alone by
  benchmarks/offload/goals.py (standard library only, loaded by its path): fixed ACCO + offload >= 1.4x ZeRO-Offload's
  steps/s where the host step is 0.35-0.7x a step's compute; adaptive ACCO + offload >= 90% of the compute-only
  samples/s where it is up to 1x, and >= ZenFlow's; the loss after the same samples within 2% of ZeRO-Offload's; no
  fp32 master and no moments on the GPU; the host AdamW >= DeepSpeedCPUAdam's throughput; every contender ran.
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
    "qres_fp16": 7 + 4 / 256,
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
    verdict = {True: "met", False: "NOT met", None: "NOT met (no result)"}[met]
    return f"| {goal} | {figure} | {verdict} |"


def read_steps(results: Path):
    """{step: (limit, result, seconds)} from steps.tsv, or None without one."""
    path = results / "steps.tsv"
    if not path.is_file():
        return None
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            name, limit, result, _rc, seconds = line.split("\t")
            out[name] = (int(limit), result, int(seconds))
    return out


def _suite_counts(results: Path, step: str) -> dict | None:
    """{"tests", "passed", "failed", "skipped"} of junit_STEP.xml's testcases, or None without the file."""
    path = results / f"junit_{step}.xml"
    if not path.is_file() or path.stat().st_size == 0:
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    n = {"tests": 0, "passed": 0, "failed": 0, "skipped": 0}
    for tc in root.iter("testcase"):
        if not tc.get("classname"):  # pytest's entry for an interrupted session, not a test
            continue
        n["tests"] += 1
        if tc.find("failure") is not None or tc.find("error") is not None:
            n["failed"] += 1
        elif tc.find("skipped") is not None:
            n["skipped"] += 1
        else:
            n["passed"] += 1
    return n


def test_step_verdicts(results: Path, test_steps) -> list:
    """[(step, figure, met)] for each test step: met only when the step ran to its end and every test it
    collected passed."""
    steps = read_steps(results) or {}
    out = []
    for name in test_steps:
        if name not in steps:
            out.append((name, "missing: not in steps.tsv", False))
            continue
        limit, result, seconds = steps[name]
        collected_file = results / f"collected_{name}.txt"
        collected = len(collected_file.read_text().split()) if collected_file.is_file() else None
        n = _suite_counts(results, name)
        if result in ("not_selected", "skipped"):
            out.append((name, f"{result.replace('_', ' ')}: no test ran", False))
            continue
        ran = n["tests"] if n else 0
        parts = [f"{result} ({seconds} s of {limit})"]
        if collected is None:
            parts.append("collected count not recorded")
        else:
            parts.append(f"{collected} collected")
        if n is not None:
            parts.append(f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped")
        else:
            parts.append("no JUnit report")
        not_run = (collected - ran) if collected is not None else None
        if not_run:
            parts.append(f"{not_run} not run")
        met = (result in ("ok", "failed") and collected is not None and collected > 0 and n is not None
               and not_run == 0 and n["passed"] == collected)  # fmt: skip
        out.append((name, ", ".join(parts), met))
    return out


def tests_goal(results: Path, test_steps=None) -> str:
    """The goal "every GPU test passes" over ``test_steps`` (default: the test steps of scripts/gpu/steps.py)."""
    if test_steps is None:
        test_steps = [s.name for s in _steps_module().STEPS if s.tests]
    if read_steps(results) is None:
        return _row("every GPU test passes", "steps.tsv missing: which steps ran and what they collected is "
                    "not known", False)  # fmt: skip
    verdicts = test_step_verdicts(results, test_steps)
    figure = "; ".join(f"{name}: {fig}" for name, fig, _ in verdicts)
    return _row("every GPU test passes", figure, all(met for *_, met in verdicts))


def _steps_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_steps", Path(__file__).with_name("steps.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_steps", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return sys.modules["gpu_steps"]


def step_ended_ok(results: Path, step: str) -> str | None:
    """None when ``step`` ended ok in steps.tsv (or there is no steps.tsv: a legacy folder), else why not."""
    steps = read_steps(results)
    if steps is None:
        return None
    if step not in steps:
        return f"{step}: missing"
    if steps[step][1] != "ok":
        return f"{step}: {steps[step][1].replace('_', ' ')}"
    return None


def kernel_goals(results: Path) -> list:
    path = results / "kernels_cuda.json"
    why = step_ended_ok(results, "bench_kernels")
    if why or not path.is_file():
        why = why or "kernels_cuda.json missing"
        return [
            _row("commit/peek >= 85% of the copy bandwidth", why, None),
            _row("peek >= 3x clone/step/restore", why, None),
            _row("quantize/dequantize-add >= 80% of the copy bandwidth", why, None),
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
    why = step_ended_ok(results, "overlap")
    if why or not path.is_file():
        why = why or "gpu_overlap.json missing"
        return [
            _row("acco overlap efficiency >= 90% at every stand-in", why, None),
            _row("the host never waits inside a round (acco)", why, None),
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


def _offload_goals_module():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "offload" / "goals.py"
    spec = importlib.util.spec_from_file_location("offload_goals", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def offload_goals(results: Path) -> list:
    """The offload benchmark's goals from offload.json (benchmarks/offload/goals.py's rows), each NOT met (no result)
    when the bench_offload step did not end ok or the file is missing."""
    og = _offload_goals_module()
    path = results / "offload.json"
    why = step_ended_ok(results, "bench_offload")
    if why or not path.is_file():
        why = why or "offload.json missing"
        return [_row(f"offload: {goal}", why, None) for goal in og.GOALS]
    rows = og.judge(json.loads(path.read_text()))
    return [_row(f"offload: {r['goal']}", r["figure"].replace("|", "/"), r["met"]) for r in rows]


def goal_rows(results: Path) -> list:
    return [tests_goal(results), *kernel_goals(results), *overlap_goals(results), *offload_goals(results)]


def all_met(rows) -> bool:
    return bool(rows) and all(r.endswith("| met |") for r in rows)


def goals(results: Path) -> str:
    """The goals table, then the verdict line: ALL MET, or NOT MET naming the goals not met."""
    rows = goal_rows(results)
    lines = ["| GPU goal | measured | verdict |", "|---|---|---|", *rows, ""]
    missed = [r.split(" | ")[0].lstrip("| ") for r in rows if not r.endswith("| met |")]
    lines.append("**Verdict: ALL MET**" if all_met(rows) else f"**Verdict: NOT MET** ({'; '.join(missed)})")
    return "\n".join(lines) + "\n"


def main(argv) -> int:
    if len(argv) >= 2 and argv[0] == "merge-junit":
        merge_junit(Path(argv[1]), argv[2:])
        return 0
    if len(argv) == 2 and argv[0] == "goals":
        text = goals(Path(argv[1]))
        sys.stdout.write(text)
        return 0 if "**Verdict: ALL MET**" in text else 1
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
