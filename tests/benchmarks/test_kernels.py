"""benchmarks.kernels writes its raw results as JSON beside the table, and ``--from-json``
re-renders, from that JSON alone, the very table the run wrote (a tiny run: 1,000 parameters, 3 calls)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.ranks.launch import REPO


def _bench(*args) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def test_from_json_rerenders_the_written_table(tmp_path):
    from acco_ds.ops import _build

    if _build.load("cpu") is None:
        if shutil.which("g++") or shutil.which("c++"):
            pytest.fail(
                f"a C++ compiler is present but the CPU extension is missing: {_build.why_missing('cpu')}"
            )
        pytest.skip(f"no C++ compiler: {_build.why_missing('cpu')}")
    run, again = tmp_path / "run", tmp_path / "again"
    _bench(
        "--sizes", "1000", "--reps", "3", "--stream-elems", "65536", "--no-deepspeed", "--out-dir", str(run)
    )
    written = (run / "kernels_cpu.md").read_text()
    res = json.loads((run / "kernels_cpu.json").read_text())
    # raw: every timed call of every contender and stream probe, not only the medians
    (entry,) = res["results"]
    assert entry["params"] == 1000 and {"commit", "peek", "torch_fused"} <= set(entry["times_s"])
    assert all(len(t) == 3 for t in entry["times_s"].values())
    assert set(res["stream"]["probes"]) == {"update", "axpy", "copy", "triad"}
    assert all(len(p["times_s"]) == 9 for p in res["stream"]["probes"].values())

    again.mkdir()
    shutil.copy(run / "kernels_cpu.json", again / "elsewhere.json")
    _bench("--from-json", str(again / "elsewhere.json"), "--out-dir", str(again))
    assert (again / "kernels_cpu.md").read_text() == written
    assert json.loads((again / "kernels_cpu.json").read_text()) == res
    assert "| 1,000 | acco commit (bf16 g in, bf16 p out) |" in written
