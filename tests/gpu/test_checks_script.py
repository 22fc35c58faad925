"""scripts/gpu_checks.sh and scripts/gpu_goals.py on a machine without a GPU: the script is valid bash and
stops at once saying why; the goals report never calls a missing result met; the JUnit files merge."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load_script_module(name: str):
    """A module of scripts/ (not a package: the GPU machine runs it as ``python scripts/NAME.py``)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_goals = _load_script_module("gpu_goals")


def test_scripts_are_valid_bash():
    for name in ("gpu_checks.sh", "gpu_bundle.sh"):
        r = subprocess.run(["bash", "-n", str(ROOT / "scripts" / name)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_gpu_checks_without_a_gpu_stops_and_says_why(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_checks.sh")], env=env, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]
    assert "no usable CUDA GPU" in r.stdout + r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_checks.log", "summary.md"]
    summary = (tmp_path / "summary.md").read_text()
    assert "| versions | ok |" in summary and "| gpu | FAILED" in summary and "nothing was checked" in summary
    # the log is complete when the script exits: its last line is the script's last message
    assert (tmp_path / "gpu_checks.log").read_text().rstrip().splitlines()[-1].endswith("nothing was checked")


def script_steps() -> list:
    """The STEPS table of scripts/gpu_checks.sh: [(name, limit_s, function), ...] in run order."""
    text = (ROOT / "scripts" / "gpu_checks.sh").read_text()
    m = re.search(r"^STEPS=\(\n(.*?)^\)", text, re.S | re.M)
    assert m, "scripts/gpu_checks.sh declares its steps in one STEPS=( ... ) table"
    rows = [re.fullmatch(r'\s*"(\w+) (\d+) (\w+)"', line) for line in m.group(1).splitlines() if line.strip()]
    assert all(rows), m.group(1)
    return [(r.group(1), int(r.group(2)), r.group(3)) for r in rows]


def script_budget() -> int:
    text = (ROOT / "scripts" / "gpu_checks.sh").read_text()
    return int(re.search(r"^BUDGET=\$\{GPU_CHECKS_BUDGET_S:-(\d+)\}", text, re.M).group(1))


def test_steps_fit_the_budget_in_the_order_the_verdicts_need():
    steps = script_steps()
    names = [n for n, _, _ in steps]
    text = (ROOT / "scripts" / "gpu_checks.sh").read_text()
    assert len(set(names)) == len(names)
    for _, limit, fn in steps:
        assert limit >= 10 and re.search(rf"^{fn}\(\) \{{", text, re.M), (
            fn,
            "is not a function of the script",
        )
    total, budget = sum(limit for _, limit, _ in steps), script_budget()
    assert budget <= 540 and total <= budget - 30, (
        f"the step limits add up to {total}s for a {budget}s budget"
    )
    pos = {n: i for i, n in enumerate(names)}
    assert names[:5] == ["versions", "gpu", "bundle", "install", "build"]
    # the kernel tests and the kernel benchmark (three of the five goals) before the pipeline, the overlap
    # benchmark and the stress tests; the stress tests (the longest optional check) last
    assert max(pos["kernels"], pos["bench_kernels"]) < min(pos["pipeline"], pos["overlap"], pos["stress"])
    assert names[-1] == "stress" and set(names) >= {
        "kernels",
        "bench_kernels",
        "pipeline",
        "overlap",
        "stress",
    }


def _junit(path: Path, name: str, tests: int, failures: int = 0, skipped: int = 0) -> None:
    suite = ET.Element("testsuite", name=name, tests=str(tests), failures=str(failures), errors="0",
                       skipped=str(skipped))  # fmt: skip
    ET.ElementTree(suite).write(path)


def test_merged_junit_and_test_goal(tmp_path):
    _junit(tmp_path / "a.xml", "kernels", 10)
    _junit(tmp_path / "b.xml", "pipeline", 7, failures=1)
    (tmp_path / "empty.xml").write_text("")
    out = tmp_path / "pytest_gpu.xml"
    assert gpu_goals.merge_junit(out, [tmp_path / "a.xml", tmp_path / "b.xml", tmp_path / "empty.xml",
                                       tmp_path / "missing.xml"]) == 2  # fmt: skip
    root = ET.parse(out).getroot()
    assert root.tag == "testsuites" and root.get("tests") == "17" and root.get("failures") == "1"
    assert "| every GPU test passes | 17 tests: 1 failed" in gpu_goals.tests_goal(tmp_path)
    assert gpu_goals.tests_goal(tmp_path).endswith("| NOT met |")
    gpu_goals.merge_junit(out, [tmp_path / "a.xml"])
    assert gpu_goals.tests_goal(tmp_path).endswith("| met |")


def test_kernel_and_overlap_goals(tmp_path):
    assert gpu_goals.goals(tmp_path).count("| no result |") == 6  # nothing measured: nothing is met
    n = 100_000_000
    copy_gbs = 3000.0
    kernels = {
        "stream": {"probes": {"copy": {"gbs": copy_gbs}, "update": {"gbs": 3100.0}}},
        "results": [
            {"params": 1_000_000, "median_s": {"commit": 1.0, "peek": 1.0}},  # small: not judged
            {"params": n, "median_s": {"commit": 28 * n / (0.9 * copy_gbs * 1e9),
                                       "peek": 16 * n / (0.8 * copy_gbs * 1e9), "clone_step_restore": 1.0,
                                       "qres_fp32": (13 + 4 / 256) * n / (0.85 * copy_gbs * 1e9),
                                       "deq_add": (9 + 4 / 256) * n / (0.75 * copy_gbs * 1e9)}},
        ],
    }  # fmt: skip
    (tmp_path / "kernels_cuda.json").write_text(json.dumps(kernels))
    rows = gpu_goals.kernel_goals(tmp_path)
    assert "commit 100M 90%" in rows[0] and "peek 100M 80%" in rows[0] and rows[0].endswith("| NOT met |")
    assert rows[1].endswith("| met |")
    assert (
        "qres_fp32 100M 85%" in rows[2] and "deq_add 100M 75%" in rows[2] and rows[2].endswith("| NOT met |")
    )
    settings = [{"mode": "acco", "factor": f, "efficiency": e, "host_syncs_per_step": 2.0, "host_ahead": 1.0,
                 "host_gaps_us": gaps, "profiled_steps": 1}
                for f, e, gaps in ((0.25, 0.95, [12.0, 40.0]), (2.0, 0.91, [99.0]))]  # fmt: skip
    settings.append(
        {"mode": "sync", "factor": 1.0, "efficiency": 0.5, "host_syncs_per_step": 3, "host_ahead": 0}
    )
    data = {"meta": {"compute_syncs_per_step": 0.0}, "settings": settings}
    (tmp_path / "gpu_overlap.json").write_text(json.dumps(data))
    eff, host = gpu_goals.overlap_goals(tmp_path)
    assert "x0.25 95%, x2 91%" in eff and eff.endswith("| met |")
    # acco's round-end summary waits (2 syncs per step, the model alone 0) are a diagnostic, not a stall
    assert host.endswith("| met |") and "host syncs per step x0.25 2, x2 2" in host, host
    settings[1]["host_gaps_us"] = [12.0, 2000.0]  # the compute stream idled 2 ms waiting for the host
    (tmp_path / "gpu_overlap.json").write_text(json.dumps(data))
    host = gpu_goals.overlap_goals(tmp_path)[1]
    assert host.endswith("| NOT met |") and "x2 1 (largest 2000 us, 1 steps)" in host, host
    # the model alone, profiled the same way, leaves the device idle 2.5 ms: a 2 ms acco gap is not ACCO's wait
    data["meta"].update(compute_host_gaps_us=[30.0, 2500.0], compute_profiled_steps=1)
    (tmp_path / "gpu_overlap.json").write_text(json.dumps(data))
    host = gpu_goals.overlap_goals(tmp_path)[1]
    assert host.endswith("| met |") and "the model alone 1 (largest 2500 us, 1 steps)" in host, host
    data["meta"]["compute_host_gaps_us"] = [30.0, 1500.0]  # ... but one shorter than acco's 2 ms: not met
    (tmp_path / "gpu_overlap.json").write_text(json.dumps(data))
    assert gpu_goals.overlap_goals(tmp_path)[1].endswith("| NOT met |")
    for s in settings[:2]:  # not profiled (an older JSON, or --profile-steps 0): no result, never met
        s.pop("host_gaps_us"), s.pop("profiled_steps")
    (tmp_path / "gpu_overlap.json").write_text(json.dumps(data))
    assert gpu_goals.overlap_goals(tmp_path)[1].endswith("| no result |")


def test_goal_threshold_is_the_benchmarks():
    from benchmarks.gpu_overlap import timeline

    assert gpu_goals.STALL_THRESHOLD_US == timeline.STALL_THRESHOLD_US


def test_goal_bytes_are_the_kernel_benchmarks():
    from benchmarks.kernels import table

    assert pytest.approx(table.QUANT_BYTES) == gpu_goals.QUANT_BYTES
    assert {k: gpu_goals.BYTES[k] for k in ("commit", "peek")} == {
        k: table.BYTES[k] for k in ("commit", "peek")
    }
