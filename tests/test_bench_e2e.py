"""benchmarks/bench_e2e.py: the throttled-link benchmark keeps working (its --quick run), refuses to
run without a real throttle instead of faking one, exits non-zero naming any contender that could
not run, and its compute-only bound sums the ranks' own rates."""

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
import e2e_runs  # noqa: E402

from acco_ds.cli.launch import LaunchError  # noqa: E402
from acco_ds.cli.metrics import merge_ranks, summarize  # noqa: E402


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


def _log(ms_per_mb: float, steps: int = 8, gas: int = 4) -> list:
    """One rank's cumulative step records at a constant pace."""
    return [
        {"step": k, "t": k * gas * ms_per_mb / 1000, "mb": k * gas, "loss_sum": 3.0 * k * gas}
        for k in range(1, steps + 1)
    ]


def test_bound_sums_the_ranks_own_rates():
    """Ranks at 80 and 100 ms per micro-batch of 8: 100 + 80 samples/s. Not W x the slowest rank
    (160), which an adaptive contender whose fast rank computes more would beat."""
    b = e2e_runs.bound_figures([_log(80.0), _log(100.0)], warmup=2, micro_batch=8)
    assert b["rank_samples_per_s"] == pytest.approx([100.0, 80.0])
    assert b["samples_per_s"] == pytest.approx(180.0)
    assert b["t_mb"] == pytest.approx([0.080, 0.100])
    # the window is where both run: from the slower rank's end of warm-up to the faster one's end
    assert b["window_s"] == pytest.approx([0.8, 2.56])
    drained = _log(80.0) + [{"step": 9, "t": 9.0, "mb": 32, "loss_sum": 96.0}]  # end-of-run drain
    assert e2e_runs.bound_figures([drained, _log(80.0)], 2, 8)["samples_per_s"] == pytest.approx(200.0)
    with pytest.raises(ValueError, match="fewer than warm-up"):
        e2e_runs.bound_figures([_log(80.0, steps=4), _log(80.0)], warmup=2, micro_batch=8)


def _run_summary(label: str, rate: str, ms_per_mb: float) -> dict:
    """What e2e_runs returns for a finished run, from synthetic rank records."""
    logs = [_log(ms_per_mb), _log(ms_per_mb)]
    ranks = [
        {"train_s": 3.0, "val_loss": 2.9, "peak_mem_mib": 500.0, "micro_batches_local": 32, "stats": {}}
        for _ in logs
    ]
    records = merge_ranks(logs, 8)
    s = summarize(records, ranks, warmup=2, micro_batch=8)
    s.update(
        label=label, rate=rate, load_before=0.1, load_after=0.1, slow_extra_s=[0.0, 0.0], records=records
    )
    return s


@pytest.fixture
def fake_runs(monkeypatch):
    """bench_e2e with its launches replaced by synthetic results; ``launched`` lists the contender
    launches and ``failing`` the labels whose launches raise LaunchError."""
    launched, failing = [], set()

    def contender(setup, label, rate, slow=None, tag=""):
        launched.append((label, tag))
        if label in failing:
            raise LaunchError("the ranks exited with status 1 (log: x):\nunknown option")
        return _run_summary(label, rate, 90.0)

    def compute(setup, tag):
        s = e2e_runs.bound_figures([_log(80.0), _log(80.0)], setup.warmup, setup.micro_batch)
        return dict(s, load_before=0.1, load_after=0.1)

    monkeypatch.setattr(e2e_env, "throttle_unavailable", lambda: None)
    monkeypatch.setattr(e2e_runs, "run_contender", contender)
    monkeypatch.setattr(e2e_runs, "run_compute_only", compute)
    monkeypatch.setattr(e2e_runs, "run_comm_probe", lambda setup, rate: {"t_comm_s": 0.1, "t_reduce_s": 0.05})
    return launched, failing


def test_a_contender_that_cannot_run_fails_the_benchmark(fake_runs, tmp_path, capsys):
    """acco-adaptive's launches fail: the benchmark still writes ZeRO-1's results, names
    acco-adaptive in the table and on stderr, and exits 1."""
    import bench_e2e

    launched, failing = fake_runs
    failing.add("acco-adaptive")
    out = tmp_path / "results"
    rc = bench_e2e.main(["--quick", "--steps", "8", "--out", str(out), "--work", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert rc == 1
    assert "acco-adaptive" in err and "could not run" in err and "unknown option" in err
    assert launched.count(("acco-adaptive", "/r0")) == 2  # retried once, then recorded
    raw = json.loads((out / "e2e_quick.json").read_text())
    assert "zero1" in raw["results"]["rates"]["200mbit"]["runs"]
    assert {f["label"] for f in raw["results"]["failed"]} == {"acco-adaptive"}
    assert [f["where"] for f in raw["results"]["failed"]] == [
        "200mbit repeat 1/1",
        "200mbit-hetero repeat 1/1",
    ]
    md = (out / "e2e_quick.md").read_text()
    assert "## Runs that could not run" in md and "| acco-adaptive | 200mbit repeat 1/1 |" in md
    assert "| every contender and reference run ran | 2 could not: acco-adaptive | MISSED |" in md


def test_unregistered_acco_fails_the_benchmark(fake_runs, monkeypatch, tmp_path, capsys):
    """Without an acco_ds that registers ACCO the baselines still run, and the exit status says
    which contenders did not."""
    import bench_e2e

    launched, _ = fake_runs
    monkeypatch.setattr(bench_e2e, "acco_registered", lambda: (False, "import acco_ds failed: boom"))
    rc = bench_e2e.main(
        ["--quick", "--steps", "8", "--out", str(tmp_path / "r"), "--work", str(tmp_path / "w")]
    )
    assert rc == 1 and {label for label, _ in launched} == {"zero1"}
    err = capsys.readouterr().err
    assert "acco-adaptive (all rates): not run: import acco_ds failed: boom" in err
    assert "acco-adaptive (heterogeneous)" in err


def test_quick_benchmark_runs(tmp_path):
    """One rate, few steps: the compute-only bound, comm-only, ZeRO-1 vs ACCO adaptive, and the
    heterogeneous case (about 2-4 minutes on 2 CPU cores). Every contender must run: a failing
    ACCO contender fails this test."""
    why = e2e_env.throttle_unavailable()
    if why:
        pytest.skip(f"cannot throttle a link here: {why}")
    out = tmp_path / "results"
    cmd = [
        sys.executable,
        str(BENCH / "bench_e2e.py"),
        "--quick",
        "--slow-factor",  # 3x (not 2x): a margin against other jobs slowing the fast rank on shared machines
        "3",
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
    assert "| 200mbit |" in md and "| zero1 |" in md and "| acco-adaptive |" in md and "## Goals" in md
    assert raw["results"]["failed"] == [] and "could not run" not in md
    bound = raw["results"]["compute"][0]
    assert len(bound["rank_samples_per_s"]) == 2 and min(bound["rank_samples_per_s"]) > 0
    assert bound["samples_per_s"] == pytest.approx(sum(bound["rank_samples_per_s"]))
    rate = raw["results"]["rates"]["200mbit"]
    assert rate["comm"]["t_comm_s"] > 0
    runs = rate["runs"]
    assert set(runs) == {"zero1", "acco-adaptive"}
    assert runs["zero1"]["steps"] == 6 and runs["zero1"]["samples_per_s"] > 0
    assert runs["acco-adaptive"]["steps"] == 6 and runs["acco-adaptive"]["samples_per_s"] > 0
    goals = {g[0]: g[2] for g in raw["analysis"]["goals"]}
    assert "acco adaptive samples/s >= 90% of compute-only at every rate" in goals
    het = raw["analysis"]["hetero"]["rows"]
    assert set(het) == {"zero1", "acco-adaptive"}
    assert het["zero1"]["slow_extra_s"][1] > 0 and het["zero1"]["slow_extra_s"][0] == 0
    # adaptive mode: the slowed rank computes fewer micro-batches than the fast one (ZeRO-1: the same)
    assert het["acco-adaptive"]["slow_extra_s"][1] > 0
    mb = het["acco-adaptive"]["rank_micro_batches"]
    assert het["zero1"]["rank_micro_batches"][0] == het["zero1"]["rank_micro_batches"][1]
    assert mb[0] > mb[1], (
        f"adaptive micro-batches per rank {mb}; samples/s per rank {het['acco-adaptive']['rank_samples_per_s']}"
    )
