"""The ``zero1-overlap`` contender: DeepSpeed ZeRO-1 with ``overlap_comm``, the
strongest exact DeepSpeed baseline. Its config (only the ZeRO section differs from ``zero1``), what
DeepSpeed makes of it, and a tiny acco-train run of it beside ``zero1`` on 2 launched CPU ranks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from acco_ds.cli import dsconfig
from acco_ds.cli.args import parse

ROOT = Path(__file__).resolve().parents[2]


def test_config_is_zero1_with_overlapped_reduce_buckets():
    k = dsconfig.Knobs(micro_batch=4, grad_accum=4, world_size=2, num_params=10**6)
    z1, ov = dsconfig.build_config("zero1", k), dsconfig.build_config("zero1-overlap", k)
    assert ov["zero_optimization"] == {
        "stage": 1,
        "reduce_scatter": True,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": 250_000,  # a quarter of the model: the first buckets reduce during the backward
        "allgather_bucket_size": 10**6,  # one all-gather after the step
    }
    assert z1["zero_optimization"]["overlap_comm"] is False
    assert {k: v for k, v in ov.items() if k != "zero_optimization"} == {
        k: v for k, v in z1.items() if k != "zero_optimization"
    }
    assert dsconfig.config_mode(ov) == ("zero1-overlap", "fixed")
    assert dsconfig.config_mode(z1) == ("zero1", "fixed")
    assert dsconfig.label("zero1-overlap", "fixed") == "zero1-overlap"
    # a small model keeps DeepSpeed's 50k-element floor for the buckets
    small = dsconfig.build_config("zero1-overlap", dsconfig.Knobs(micro_batch=1, grad_accum=1, world_size=2))
    assert small["zero_optimization"]["reduce_bucket_size"] == 50_000


def test_deepspeed_reads_it_as_stage_1_with_overlap_comm():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    k = dsconfig.Knobs(micro_batch=4, grad_accum=4, world_size=2, num_params=10**6)
    zero = DeepSpeedZeroConfig(**dsconfig.build_config("zero1-overlap", k)["zero_optimization"])
    assert int(zero.stage) == 1 and zero.overlap_comm is True and zero.reduce_bucket_size == 250_000


def test_acco_train_accepts_the_mode():
    assert parse(["--mode", "zero1-overlap", "--out", "x"]).mode == ["zero1-overlap"]


@pytest.mark.launcher
def test_acco_train_tiny_run_of_zero1_overlap(tmp_path):
    """zero1 and zero1-overlap on 2 launched CPU ranks (about a minute on 2 cores): both train, the
    overlap run's engine got overlap_comm, and - an exact baseline - it reaches ZeRO-1's losses."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "acco_ds.train", "--mode", "zero1", "zero1-overlap", "--steps", "8"]
    cmd += ["--n-layer", "1", "--d-model", "64", "--n-head", "2", "--context", "32", "--micro-batch", "4"]
    cmd += ["--grad-accum", "2", "--warmup-steps", "2", "--lr", "3e-3", "--eval-windows", "16"]
    cmd += ["--world-size", "2", "--out", str(out), "--no-progress"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((out / "summary.json").read_text())["runs"]
    cfg = json.loads((out / "runs" / "zero1-overlap" / "ds_config.json").read_text())
    assert cfg["zero_optimization"]["overlap_comm"] is True and cfg["zero_optimization"]["stage"] == 1
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    curves = {m: [x["loss"] for x in lines if x["mode"] == m] for m in ("zero1", "zero1-overlap")}
    ov = runs["zero1-overlap"]
    assert ov["steps"] == 8 and ov["samples"] == 8 * 2 * 4 * 2
    assert curves["zero1-overlap"][-1] < curves["zero1-overlap"][0] - 0.5
    assert ov["val_loss"] < math.log(256)
    # same model, data and AdamW: the reduction is only scheduled differently (fp32, 2 ranks)
    assert curves["zero1-overlap"] == [pytest_approx(x) for x in curves["zero1"]]
    assert ov["val_loss"] == pytest_approx(runs["zero1"]["val_loss"])


def pytest_approx(x):
    import pytest

    return pytest.approx(x, rel=1e-5, abs=1e-6)
