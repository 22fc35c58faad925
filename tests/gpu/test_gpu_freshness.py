"""scripts/gpu/freshness.py on a planted history (a temporary git repository with two commits and a run folder):
the GPU-path sources are the .cu files, the headers they include (through other headers) and the Triton and core
files; a test file's last GPU pass is the commit of the newest run where all its collected tests passed; a change
since that commit, committed or not, flags it, and the units that hold it run first. CPU only."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.gpu.gpu_scripts import load

ROOT = Path(__file__).resolve().parents[2]


gpu_freshness = load("freshness")
gpu_results = load("results")
gpu_steps = load("steps")


def _git(repo: Path, *args) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin", "HOME": str(repo)}  # fmt: skip
    return subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


def _write(repo: Path, rel: str, text: str) -> None:
    (repo / rel).parent.mkdir(parents=True, exist_ok=True)
    (repo / rel).write_text(text)


STEPS = (
    gpu_steps.Step("build", 30, "build", code=("csrc/",)),
    gpu_steps.Step("kernels", 60, "step_kernels", "kernel_tests", ("tests/gpu/test_a_gpu.py",),
                   ("csrc/", "acco_ds/ops/triton_kernels/acc.py")),
    gpu_steps.Step("quantize", 60, "step_quantize", "kernel_tests", ("tests/gpu/test_b_gpu.py",),
                   ("acco_ds/ops/triton_kernels/quant.py",)),
    gpu_steps.Step("stress", 60, "step_stress", tests=("tests/gpu/test_c_gpu.py",), code=("acco_ds/core/comm.py",)),
)  # fmt: skip


def _plant_run(folder: Path, commit: str, collected: dict, passed: dict) -> None:
    """A run.json run at ``commit``: per step, the node ids collected and how many of them passed."""
    import json
    import xml.etree.ElementTree as ET

    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"name": folder.name, "device": "planted", "date": "2026-01-01",
                                                 "commit": commit}))  # fmt: skip
    steps = []
    for step, (test_file, n) in collected.items():
        ids = [f"{test_file}::t{i}" for i in range(n)]
        (folder / f"collected_{step}.txt").write_text("\n".join(ids) + "\n")
        suite = ET.Element("testsuite", name=step)
        for i in range(passed[step]):
            ET.SubElement(
                suite, "testcase", classname=test_file[:-3].replace("/", "."), name=f"t{i}", time="1"
            )
        ET.ElementTree(suite).write(folder / f"junit_{step}.xml")
        steps.append(f"{step}\t60\tok\t0\t10\n")
    (folder / "steps.tsv").write_text("".join(steps))


def test_freshness_on_a_planted_history(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _write(repo, "csrc/adamw/k.cu", '#include "adamw/launch.h"\n')
    _write(repo, "csrc/adamw/launch.h", '#include "common/bf16.h"\n')
    _write(repo, "csrc/common/bf16.h", "// bf16\n")
    _write(repo, "csrc/common/cpu_only.h", "// no .cu includes it\n")
    _write(repo, "acco_ds/ops/triton_kernels/acc.py", "A = 1\n")
    _write(repo, "acco_ds/ops/triton_kernels/quant.py", "Q = 1\n")
    _write(repo, "acco_ds/ops/triton_kernels/orphan.py", "O = 1\n")
    _write(repo, "acco_ds/core/comm.py", "C = 1\n")
    for t in ("a", "b", "c"):
        _write(repo, f"tests/gpu/test_{t}_gpu.py", "def test(): pass\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "first")
    first = _git(repo, "rev-parse", "--short=7", "HEAD")
    results = repo / "results"
    # at the first commit: a passed completely, b had a collected test without a result, c passed
    _plant_run(results / "planted_first", first,
               {"kernels": ("tests/gpu/test_a_gpu.py", 3), "quantize": ("tests/gpu/test_b_gpu.py", 4),
                "stress": ("tests/gpu/test_c_gpu.py", 2)},
               {"kernels": 3, "quantize": 3, "stress": 2})  # fmt: skip
    _write(repo, "csrc/common/bf16.h", "// bf16, fp16 added\n")  # a header of the .cu changes, committed
    _git(repo, "commit", "-q", "-am", "second")
    _write(repo, "acco_ds/core/comm.py", "C = 2\n")  # uncommitted

    assert gpu_freshness.cuda_sources(repo) == [
        "csrc/adamw/k.cu",
        "csrc/adamw/launch.h",
        "csrc/common/bf16.h",
    ]
    runs = gpu_results.load_runs(results)
    assert gpu_results.passed_files(runs[0]) == {"tests/gpu/test_a_gpu.py", "tests/gpu/test_c_gpu.py"}
    rows = {
        path: (commit, changed) for _, path, commit, _, changed in gpu_freshness.freshness(repo, runs, STEPS)
    }
    assert rows["tests/gpu/test_a_gpu.py"] == (first, False)
    assert rows["tests/gpu/test_b_gpu.py"] == ("never", None)  # one collected test never ran
    assert rows["tests/gpu/test_c_gpu.py"] == (first, False)
    assert rows["csrc/adamw/k.cu"] == (first, False)
    assert rows["csrc/adamw/launch.h"] == (first, False)
    assert rows["csrc/common/bf16.h"] == (first, True)  # changed in a later commit
    assert "csrc/common/cpu_only.h" not in rows  # no .cu includes it: not a GPU-path source
    assert rows["acco_ds/ops/triton_kernels/acc.py"] == (first, False)
    assert rows["acco_ds/ops/triton_kernels/quant.py"] == ("never", None)  # its only test never passed
    assert rows["acco_ds/ops/triton_kernels/orphan.py"] == ("no GPU test", None)
    assert rows["acco_ds/core/comm.py"] == (first, True)  # changed, not committed
    table = gpu_freshness.freshness(repo, runs, STEPS)
    assert gpu_freshness.stale_units(table, STEPS) == ["kernel_tests", "stress"]
    text = gpu_freshness.markdown(table, ["kernel_tests", "stress"])
    assert f"| source | csrc/common/bf16.h | {first} |" in text and "| CHANGED |" in text
    assert "Stale units (run first): kernel_tests, stress" in text

    # a later run passes b and c at the second commit with comm.py committed: nothing stale but what a needs
    _git(repo, "commit", "-q", "-am", "third")
    third = _git(repo, "rev-parse", "--short=7", "HEAD")
    _plant_run(results / "planted_third", third,
               {"quantize": ("tests/gpu/test_b_gpu.py", 4), "stress": ("tests/gpu/test_c_gpu.py", 2)},
               {"quantize": 4, "stress": 2})  # fmt: skip
    runs = gpu_results.load_runs(results)
    table = gpu_freshness.freshness(repo, runs, STEPS)
    rows = {path: (commit, changed) for _, path, commit, _, changed in table}
    assert rows["tests/gpu/test_b_gpu.py"] == (third, False) and rows["acco_ds/core/comm.py"] == (
        third,
        False,
    )
    assert rows["csrc/common/bf16.h"] == (first, True)  # a's last pass is still the first commit
    assert gpu_freshness.stale_units(table, STEPS) == ["kernel_tests"]


def test_the_projects_freshness_lists_every_gpu_test_and_source():
    rows = gpu_freshness.freshness(ROOT, gpu_results.load_runs(gpu_steps.RESULTS))
    paths = [p for _, p, *_ in rows]
    assert sorted(p for k, p, *_ in rows if k == "test") == sorted(gpu_steps.test_files())
    assert "csrc/adamw/adamw_cuda.cu" in paths and "acco_ds/core/comm.py" in paths
    assert all(p in paths for p in map(str, (x.relative_to(ROOT) for x in
                                              (ROOT / "acco_ds/ops/triton_kernels").glob("*.py"))))  # fmt: skip
    # every GPU-path source is named by a step (none is left without a GPU test)
    assert not [p for _, p, commit, *_ in rows if commit == "no GPU test"]
