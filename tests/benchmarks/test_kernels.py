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


def _host_results(times: dict, interleaved: list) -> dict:
    """Raw results of one size, 1M parameters, with the given per-call times (as the benchmark's JSON holds them)."""
    import statistics

    probes = {
        k: {"bytes_per_elem": 8, "times_s": [1.0], "median_s": 1.0, "gbs": 20.0} for k in ("update", "copy")
    }
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "device": "cpu", "threads": 2, "clock": "wall clock", "reps": 3, "host_reps": 3, "date": "d", "machine": "m",
        "load": [0.0, 0.0], "versions": "v", "cpu_isa": "avx2", "command": "c", "notes": [],
        "stream": {"elems": 2**26, "reps": 9, "probes": probes},
        "results": [{"params": 1_000_000, "median_s": med, "times_s": times, "interleaved": interleaved}],
    }  # fmt: skip


def test_host_ratios_are_paired_round_by_round():
    """The host section's ratio is the median of the per-round ratios (DeepSpeedCPUAdam's time over ACCO's in the
    same round), not the ratio of the medians: a slow round slows both sides of its ratio alike."""
    from benchmarks.kernels.table import host_summary, paired_ratios, quantile, render

    # round 2 is loaded: every contender slower; per round DeepSpeedCPUAdam takes 1.25x, 1.25x, 1.25x ACCO's commit
    times = {
        "commit": [0.004, 0.008, 0.016],
        "peek": [0.003, 0.006, 0.012],
        "deepspeed": [0.005, 0.010, 0.020],
    }
    res = _host_results(times, [["commit", "peek", "deepspeed"]])
    entry = res["results"][0]
    assert paired_ratios(entry, "deepspeed", "commit") == pytest.approx([1.25, 1.25, 1.25])
    (row,) = host_summary(res)
    assert row["vs"]["commit"] == pytest.approx((1.25, 1.25, 1.25))
    assert row["vs"]["peek"] == pytest.approx((5 / 3, 5 / 3, 5 / 3))
    assert row["rounds"] == 3 and row["gbs"]["commit"] == pytest.approx(28 * 1e6 / 0.008 / 1e9)
    assert row["copy_pct"]["commit"] == pytest.approx(100 * row["gbs"]["commit"] / 20.0)
    # the medians alone would pair round 1's commit with another round's anchor
    times2 = {
        "commit": [0.004, 0.020, 0.008],
        "peek": [0.003, 0.006, 0.012],
        "deepspeed": [0.010, 0.005, 0.024],
    }
    (row2,) = host_summary(_host_results(times2, [["commit", "peek", "deepspeed"]]))
    assert row2["vs"]["commit"][0] == pytest.approx(quantile([2.5, 0.25, 3.0], 0.5)) == pytest.approx(2.5)
    md = render(res)
    assert "## Host rows: ACCO's AdamW against DeepSpeedCPUAdam" in md
    assert "| 1,000,000 | 8.000 | 6.000 | 10.000 | 1.25x [1.25x, 1.25x] | 1.67x [1.67x, 1.67x] | met |" in md
    # timed one after the other (not in the same rounds): no paired ratio, no host section
    apart = _host_results(times, [["commit", "peek"]])
    assert paired_ratios(apart["results"][0], "deepspeed", "commit") is None
    assert "not measured" in render(apart)
    del apart["results"][0]["interleaved"]  # results written before the host rows
    assert "## Host rows" not in render(apart)
    assert quantile([4.0, 1.0, 2.0, 3.0], 0.25) == pytest.approx(1.75)


def test_host_only_run_times_the_host_rows_interleaved(tmp_path):
    from acco_ds.ops import _build

    if _build.load("cpu") is None:
        pytest.skip(f"CPU extension missing: {_build.why_missing('cpu')}")
    _bench("--sizes", "1000", "--host-only", "--host-reps", "5", "--stream-elems", "65536", "--no-deepspeed",
           "--out-dir", str(tmp_path))  # fmt: skip
    res = json.loads((tmp_path / "kernels_cpu_host.json").read_text())
    (entry,) = res["results"]
    assert res["host_only"] and res["host_reps"] == 5
    assert entry["interleaved"] == [["commit", "peek"]] and set(entry["times_s"]) == {"commit", "peek"}
    assert all(len(t) == 5 for t in entry["times_s"].values())
    md = (tmp_path / "kernels_cpu_host.md").read_text()
    assert "| 1,000 | acco commit (bf16 g in, bf16 p out) |" in md and "## Host rows" in md
    assert "DeepSpeedCPUAdam was not measured in this run" in md
