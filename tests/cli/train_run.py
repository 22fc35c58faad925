"""One real acco-train run (``python -m acco_ds.train``) from a test: its options, its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# the tiny settings of the 2-rank runs: a 1-layer TinyGPT of width 64 (2 heads, context 64), micro-batch 4, 2
# micro-batches a step, 2 warm-up steps, LR 3e-3, 16 validation windows
TINY = ["--n-layer", "1", "--d-model", "64", "--n-head", "2", "--context", "64", "--micro-batch", "4"]
TINY += ["--grad-accum", "2", "--warmup-steps", "2", "--lr", "3e-3", "--eval-windows", "16"]


def run_train(tmp_path: Path, options: list, timeout: int = 600):
    """acco-train with ``options``, its output in ``tmp_path/out``, no progress bar; asserts it exits 0 (else shows
    the end of its output). Returns the finished process, the run's summary.json and its metrics.jsonl records."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "acco_ds.train", *options, "--out", str(out), "--no-progress"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return proc, summary, lines
