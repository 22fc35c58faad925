"""acco-train --tp N: DeepSpeed AutoTP inside groups of N consecutive ranks and ACCO's data
parallelism across them, out of the box on CPU ranks; the options are checked before any rank starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from acco_ds.cli.args import parse
from acco_ds.cli.dsconfig import Knobs, build_config

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def test_tp_options_are_checked(capsys):
    a = parse(["--model", "llama", "--tp", "2", "--world-size", "4", "--n-head", "4", "--out", "x"])
    assert a.tp == 2
    for bad, msg in (
        (["--tp", "2", "--world-size", "4"], "needs --model gpt2 or llama"),
        (["--model", "llama", "--tp", "3", "--world-size", "4"], "--tp 3 does not divide --world-size 4"),
        (
            ["--model", "gpt2", "--tp", "2", "--world-size", "2", "--n-head", "3", "--d-model", "96"],
            "--n-head (3)",
        ),
        (["--model", "llama", "--tp", "0"], "--tp must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            parse(bad + ["--out", "x"])
        assert msg in capsys.readouterr().err


def test_tp_config():
    cfg = build_config("acco", Knobs(micro_batch=2, grad_accum=2, world_size=4, tp=2))
    assert cfg["tensor_parallel"] == {"autotp_size": 2} and "train_batch_size" not in cfg
    assert "tensor_parallel" not in build_config("zero1", Knobs(micro_batch=2, grad_accum=2, world_size=4))


@pytest.mark.launcher
def test_acco_train_tensor_parallel_run(tmp_path):
    """TP 2 x DP 2 on 4 CPU ranks, a tiny Llama, 3 steps of acco (about a minute on 2 cores)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "acco_ds.train", "--model", "llama", "--tp", "2", "--world-size", "4"]
    cmd += ["--n-layer", "1", "--d-model", "64", "--n-head", "4", "--context", "32", "--mode", "acco"]
    cmd += ["--steps", "3", "--micro-batch", "2", "--grad-accum", "2", "--eval-windows", "8"]
    cmd += ["--out", str(out), "--no-progress"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads((out / "summary.json").read_text())["runs"]["acco"]
    assert run["steps"] == 3
    ranks = [json.loads((out / "runs" / "acco" / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["tp"] == 2 for r in ranks)
    # samples count the data-parallel replicas only: 3 steps x 2 micro-batches x 2 sequences x 2 replicas
    assert run["samples"] == 24, run
    assert [r["stats"]["micro_batches_committed"] for r in ranks] == [12] * 4  # global over the 2 replicas
