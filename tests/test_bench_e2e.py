"""benchmarks/bench_e2e.py: the throttled-link benchmark keeps working (its --quick run), and it
refuses to run without a real throttle instead of faking one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import e2e_env  # noqa: E402


def test_rates_are_checked_and_wrapped():
    assert e2e_env.rate_mbit("2gbit") == 2000 and e2e_env.rate_mbit("800kbit") == 0.8
    with pytest.raises(ValueError, match="not 'none' or a tc rate"):
        e2e_env.check_rate("fast")
    argv = e2e_env.wrap("400mbit")("echo hi")
    assert argv[:3] == ["unshare", "-n", "sh"] and "tbf rate 400mbit burst 256kb latency 200ms" in argv[-1]
    assert "tc " not in e2e_env.wrap("none")("echo hi")[-1]


def test_refuses_without_a_throttle(monkeypatch, capsys):
    import bench_e2e

    monkeypatch.setattr(
        e2e_env, "throttle_unavailable", lambda: "throttling needs root (running as uid 1000)"
    )
    assert bench_e2e.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert "cannot throttle" in err and "uid 1000" in err and "does not fake" in err


def test_quick_benchmark_runs(tmp_path):
    """One rate, few steps: compute-only, comm-only, ZeRO-1 vs ACCO adaptive, and the
    heterogeneous case (about 2 minutes on 2 CPU cores)."""
    why = e2e_env.throttle_unavailable()
    if why:
        pytest.skip(f"cannot throttle a link here: {why}")
    out = tmp_path / "results"
    cmd = [
        sys.executable,
        str(BENCH / "bench_e2e.py"),
        "--quick",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "w"),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    md = (out / "e2e_quick.md").read_text()
    raw = json.loads((out / "e2e_quick.json").read_text())
    for name in ("throughput", "loss", "hetero"):
        assert (out / f"e2e_quick_{name}.png").stat().st_size > 1000
    assert "AMD" in md or "Intel" in md or "machine:" in md
    assert "| 200mbit |" in md and "| zero1 |" in md and "## Goals" in md
    rate = raw["results"]["rates"]["200mbit"]
    assert rate["comm"]["t_comm_s"] > 0
    runs = rate["runs"]
    assert runs["zero1"]["steps"] == 6 and runs["zero1"]["samples_per_s"] > 0
    het = raw["analysis"]["hetero"]["rows"]
    assert het["zero1"]["slow_extra_s"][1] > 0 and het["zero1"]["slow_extra_s"][0] == 0
    if "acco-adaptive" in runs:  # present once acco_ds registers its optimizer
        assert runs["acco-adaptive"]["steps"] == 6
        # the slowed rank computes fewer micro-batches than the fast one in adaptive mode
        mb = het["acco-adaptive"]["rank_micro_batches"]
        assert mb[0] > mb[1]
