"""The steps of scripts/gpu/checks.sh: one table, read by the checks (their run order), the goals (which steps a
full run must hold), the freshness listing (which GPU-path sources and GPU tests each step exercises) and the
limits' own test.

    python scripts/gpu/steps.py table [STALE_UNIT ...]   # "name limit function group" lines in run order
    python scripts/gpu/steps.py estimate                 # each test step's limit against its measured rate

Run order (:func:`run_order`): the set-up steps, then the units (a group of steps that run at once, or one step
alone) whose code or tests changed since their last GPU pass, then the others, each part in the table's order.
The steps of the group ``kernel_tests`` run at the same time (one pytest process each, on the one GPU): they are
correctness tests whose time is mostly Triton compilation on the host's CPU cores; the timing steps
(bench_kernels, overlap, bench_offload) and the multi-process ones (pipeline, stress, offload) run alone.

The budget: the units of ``OWN_CALL`` (the offload tests and the offload benchmark) do not fit one call with the
others; each call's units add up to at most the budget minus BUDGET_MARGIN_S (:func:`call_limits`): ``checks`` the
set-up and every other unit, ``offload`` the set-up and ``OWN_CALL``'s
(``GPU_CHECKS_ONLY="versions gpu bundle install build offload bench_offload"``). In a full run they come last in
the table, so they never displace the others: they get what the others leave (the benchmark then skips the
contenders that would not fit, and its step is not ok). A group lasts as long as its
longest step, so its steps share one limit: the longest estimate among them (adamw_difference's), rounded up; each
step's basis still states its own estimate.

Each limit's basis says where it comes from: the longest time of that step in the committed logs
(benchmarks/results/gpu_checks), or for a test step its measured seconds per test (:func:`measured_rates`: the
largest over the committed JUnit files of a test file's summed test times over its number of tests) times the
number of tests it collects now, plus PYTEST_OVERHEAD_S. tests/gpu/test_checks_script.py fails when a limit is
below that figure or the units' limits add up to more than the budget minus BUDGET_MARGIN_S. No torch import.
"""

from __future__ import annotations

import math
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_checks"
BUDGET_S = 540
"""checks.sh's default total: one device call of at most 540 s on a fresh machine, the bundle's install
included (the device tool's 600 s limit minus start and transfer margin)."""
BUDGET_MARGIN_S = 30
"""Kept out of the limits: the goals, the packing, and the SIGKILL grace of a step stopped at its limit."""
PYTEST_OVERHEAD_S = 5
"""A pytest step's start: torch's import and the collection (the committed runs: step seconds minus the suite's
time, 3-5 s)."""
SETUP = ("versions", "gpu", "bundle", "install", "build")
OWN_CALL = ("offload", "bench_offload")
"""Units that run in a call of their own, together, with the set-up: their limits and the others' do not fit one
budget."""

TRITON = "acco_ds/ops/triton_kernels/"
CUDA_ADAMW = "csrc/"
"""The CUDA module: csrc/**/*.cu and the headers they include (freshness.py lists no other csrc file)."""
CORE_GPU = (
    "acco_ds/core/comm.py",
    "acco_ds/core/pipeline.py",
    "acco_ds/core/round_job.py",
    "acco_ds/core/phase_clock.py",
    "acco_ds/core/fused_round_end.py",
    "acco_ds/core/host_step.py",
)
"""The CUDA parts of acco_ds/core: the side-stream executor, the pipeline and round job that order the streams with
events, the phase clock's CUDA events, the fused round end's gradient hooks on the compute stream, the offloaded
step's copies to and from the host on the side stream (host_step.py)."""


@dataclass(frozen=True)
class Step:
    name: str
    limit: int
    fn: str
    group: str = ""
    tests: tuple = ()
    code: tuple = ()
    basis: str = ""

    @property
    def unit(self) -> str:
        """The group's name, or the step's own where it runs alone."""
        return self.group or self.name


STEPS = (
    Step("versions", 15, "versions", basis="12 s at most in the committed logs (h200/full)"),
    Step("gpu", 10, "gpu_present", basis="6 s at most (H100, second run)"),
    Step("bundle", 15, "bundle_install", basis="12 s at most (H100 second run, h200/full)"),
    Step("install", 10, "step_install", basis="4 s at most"),
    Step("build", 35, "build", code=("csrc/",),
         basis="25 s at most (stress_rerun); the fp16 instantiations added since have not been built on a GPU"),
    Step("kernels", 140, "step_kernels", "kernel_tests", ("tests/gpu/test_kernels_gpu.py",),
         (CUDA_ADAMW, TRITON + "accumulate.py", TRITON + "bf16.py", TRITON + "__init__.py"),
         "0.30 s per test (H100 second run: 39.4 s for 131) x the tests collected now"),
    Step("quantize", 140, "step_quantize", "kernel_tests", ("tests/gpu/test_quantize_gpu.py",),
         (TRITON + "quantize.py", TRITON + "bf16.py"),
         "0.27 s per test (H100 second run: 21.6 s for 80) x the tests collected now"),
    Step("norm", 140, "step_norm", "kernel_tests", ("tests/gpu/test_norm_gpu.py",), (TRITON + "norm.py",),
         "0.54 s per test (h200/fourth_kernels: 4.9 s for 9) x the tests collected now"),
    Step("adamw_difference", 140, "step_adamw_difference", "kernel_tests",
         ("tests/gpu/test_adamw_difference_gpu.py",),
         (TRITON + "adamw_difference.py", TRITON + "quantize.py", TRITON + "bf16.py", CUDA_ADAMW),
         "1.97 s per test (h200/fourth_kernels: 41.4 s for the first 21, Triton compiling cold) x the tests "
         "collected now; the group's longest: it sets the group's time"),
    Step("fused_sum", 140, "step_fused_sum", "kernel_tests", ("tests/gpu/test_quantized_sum_step_gpu.py",),
         (TRITON + "quantized_sum_step.py", TRITON + "quantize.py", TRITON + "bf16.py"),
         "never run on a GPU: no measured time; the group's time (adamw_difference's limit), which it costs "
         "nothing to give"),
    Step("fold_quantize", 140, "step_fold_quantize", "kernel_tests", ("tests/gpu/test_fold_quantize_gpu.py",),
         (TRITON + "fold_quantize.py", TRITON + "quantize.py", TRITON + "bf16.py"),
         "never run on a GPU: no measured time; the group's time, as fused_sum"),
    Step("bench_kernels", 30, "step_bench_kernels", code=(CUDA_ADAMW, TRITON),
         basis="14 s at most with the rows of the fourth run (h200/fourth_full); the fp16, commit + difference, "
               "sum_commit and fold_qres rows added since have not run on a GPU: twice that"),
    Step("pipeline", 80, "step_pipeline", tests=("tests/gpu/test_pipeline_gpu.py",),
         code=(*CORE_GPU, CUDA_ADAMW, TRITON),
         basis="2.18 s per test (H100 second run: 54.6 s for 25) x the tests collected now (33 with the fp16 "
               "runs, which have not run on a GPU): 78 s"),
    Step("overlap", 50, "step_overlap", code=CORE_GPU, basis="45 s at most (h200/fourth_full)"),
    Step("stress", 120, "step_stress", tests=("tests/gpu/test_stress_gpu.py",), code=CORE_GPU,
         basis="115 s at most (stress_rerun: 13 tests, 8.1 s each)"),
    Step("offload", 60, "step_offload", tests=("tests/gpu/test_offload_gpu.py",), code=CORE_GPU,
         basis="never run on a GPU: one launch at W = 1 (NCCL) of 8 toy scenarios of 6 steps (4 modes with and "
               "without offload); the pipeline step's 2.18 s per test (H100 second run) x 8 + the launch's 15 s: "
               "33 s"),
    Step("bench_offload", 300, "step_bench_offload", code=CORE_GPU,
         basis="never run on a GPU: estimated 240 s (docs/GPU.md section 7): DeepSpeedCPUAdam's JIT build about 60 s, "
               "six contender processes of about 15 s start-up (imports, NCCL, 0.95B model, pinned host state) plus "
               "9 optimizer steps each (1.0-1.2 s a step for ZeRO-Offload, 0.6-0.8 s the others) and a profile; "
               "the benchmark gets the limit as its deadline and skips the contenders that would not fit"),
)  # fmt: skip


def by_name() -> dict:
    return {s.name: s for s in STEPS}


def units() -> list:
    """[(unit, [steps])] in the table's order; a unit's time is its steps' longest limit."""
    out: dict = {}
    for s in STEPS:
        out.setdefault(s.unit, []).append(s)
    return list(out.items())


def unit_limit(steps) -> int:
    return max(s.limit for s in steps)


def total_limit(leave_out=OWN_CALL) -> int:
    """The units' limits added up, those of ``leave_out`` left out: the longest a run of the others can take before
    the goals (a group counts its longest)."""
    return sum(unit_limit(steps) for name, steps in units() if name not in leave_out)


def call_limits() -> dict:
    """{call: its units' limits added up}: ``checks`` (the set-up and every unit but ``OWN_CALL``'s) and ``offload``
    (the set-up and ``OWN_CALL``'s units): each must fit the budget minus BUDGET_MARGIN_S."""
    setup = sum(unit_limit(steps) for name, steps in units() if name in SETUP)
    own = sum(unit_limit(steps) for name, steps in units() if name in OWN_CALL)
    return {"checks": total_limit(), "offload": setup + own}


def run_order(stale_units=()) -> list:
    """The steps in run order: the set-up, then the units in ``stale_units``, then the others (table order)."""
    stale = set(stale_units)
    us = units()
    setup = [u for u in us if u[0] in SETUP]
    rest = [u for u in us if u[0] not in SETUP]
    ordered = setup + [u for u in rest if u[0] in stale] + [u for u in rest if u[0] not in stale]
    return [s for _, steps in ordered for s in steps]


def test_files() -> list:
    return [t for s in STEPS for t in s.tests]


def junit_files(results: Path = RESULTS) -> list:
    return sorted(p for p in results.rglob("*.xml") if p.is_file())


def measured_rates(results: Path = RESULTS) -> dict:
    """{test file: seconds per test}: the largest, over the committed JUnit files, of a file's summed test times
    over its number of tests (testcase classnames are dotted paths: tests.gpu.test_x_gpu)."""
    rates: dict = {}
    for path in junit_files(results):
        sums: dict = {}
        for tc in ET.parse(path).getroot().iter("testcase"):
            cls = tc.get("classname") or ""
            if not cls.startswith("tests.gpu."):
                continue
            f = cls.replace(".", "/") + ".py"
            n, t = sums.get(f, (0, 0.0))
            sums[f] = (n + 1, t + float(tc.get("time", 0) or 0))
        for f, (n, t) in sums.items():
            rates[f] = max(rates.get(f, 0.0), t / n)
    return rates


def estimate(step: Step, rates: dict, collected: dict):
    """PYTEST_OVERHEAD_S + sum over the step's test files of rate x tests collected now; None when a file has no
    measured rate (never ran on a GPU)."""
    total = float(PYTEST_OVERHEAD_S)
    for f in step.tests:
        if f not in rates:
            return None
        total += rates[f] * collected.get(f, 0)
    return total


def collect_counts(files, python=sys.executable) -> dict:
    """{test file: tests pytest collects in it now} (``pytest --collect-only -q``, on any machine: the GPU tests are
    collected, then skipped, without a GPU)."""
    import subprocess

    r = subprocess.run([python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    counts = dict.fromkeys(files, 0)
    for line in r.stdout.splitlines():
        f = line.split("::", 1)[0]
        if "::" in line and f in counts:
            counts[f] += 1
    return counts


def main(argv) -> int:
    if argv and argv[0] == "table":
        for s in run_order(argv[1:]):
            print(s.name, s.limit, s.fn, s.group or "-")
        return 0
    if argv == ["estimate"]:
        rates, collected = measured_rates(), collect_counts(test_files())
        print(f"units add up to {total_limit(())} s, {total_limit()} s without {', '.join(OWN_CALL)}, of the "
              f"{BUDGET_S} s budget (margin {BUDGET_MARGIN_S} s); per call: {call_limits()}")  # fmt: skip
        for s in STEPS:
            e = estimate(s, rates, collected) if s.tests else None
            n = sum(collected.get(f, 0) for f in s.tests)
            est = "-" if e is None else f"{math.ceil(e)} s"
            print(f"{s.name:17} limit {s.limit:4} s  tests now {n:4}  estimate {est:>6}  ({s.basis})")
        return 0
    sys.stderr.write(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
