"""DeepSpeed's monitor section receives ACCO's figures: with ``csv_monitor`` enabled,
the engine writes lr and ACCO writes loss, grad norm, rounds, micro-batches per round per rank and the
time the compute side waited for the communication, on the engine's x axis (samples)."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from tests.ranks import toy
from tests.ranks.launch import run_scenarios

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

STEPS, GAS, WORLD = 4, 4, 2


def config(mode: str, out) -> dict:
    return {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "ACCO", "params": {"lr": 0.01, "mode": mode}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        "csv_monitor": {"enabled": True, "output_path": str(out), "job_name": mode},
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("monitor")
    logs = tmp / "logs"
    scenarios = [{"name": m, "steps": STEPS, "config": config(m, logs)} for m in ("acco", "dpu")]
    return logs, run_scenarios(WORLD, scenarios, tmp)


def read(logs, mode: str, event: str) -> list:
    """[(x, value)] of one event's CSV file (DeepSpeed's csv monitor: one file per event name)."""
    path = logs / mode / (event.replace("/", "_") + ".csv")
    assert path.exists(), f"no {path.name} in {sorted(p.name for p in (logs / mode).iterdir())}"
    with open(path) as f:
        rows = list(csv.reader(f))[1:]
    return [(int(x), float(v)) for x, v in rows]


@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_acco_events_share_the_engine_x_axis(run, mode):
    logs, _ = run
    lr_x = [x for x, _ in read(logs, mode, "Train/Samples/lr")]
    assert lr_x == [(k + 1) * GAS * WORLD * toy.MICRO_BATCH for k in range(STEPS)]
    for event in ("Train/Samples/train_loss", "ACCO/rounds", "ACCO/comm_wait_ms", "ACCO/committed_steps"):
        assert [x for x, _ in read(logs, mode, event)] == lr_x, event


@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_acco_figures(run, mode):
    logs, results = run
    rounds_per_step, share = (2, GAS // 2) if mode == "acco" else (1, GAS)
    assert [v for _, v in read(logs, mode, "ACCO/rounds")] == [
        rounds_per_step * (k + 1) for k in range(STEPS)
    ]
    for rank in range(WORLD):
        counts = [v for _, v in read(logs, mode, f"ACCO/micro_batches_per_round/rank_{rank}")]
        assert counts == [share] * len(counts) and len(counts) >= STEPS - 1, counts
    assert all(v >= 0 for _, v in read(logs, mode, "ACCO/comm_wait_ms"))
    losses = [v for _, v in read(logs, mode, "Train/Samples/train_loss")]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)
    # step 1 computes at theta^0 in every mode: rank 0's mean loss over its GAS micro-batches
    model = toy.build()
    with torch.no_grad():
        first = sum(model(*toy.micro_batch(0, i)).item() for i in range(GAS)) / GAS
    assert losses[0] == pytest.approx(first, rel=1e-5)
    # the grad norm written is the one the engine reports after each step (worker.py records it)
    want = [n for n in results[mode]["norms"] if n is not None]
    got = [v for _, v in read(logs, mode, "Train/Samples/grad_norm")]
    assert len(want) >= STEPS - 1 and got == pytest.approx(want, rel=1e-6)
