"""Two epochs whose last accumulation is short, under the Hugging Face Trainer and under accelerate's own loop
(``accelerator.accumulate`` over a prepared data loader): 2 ranks, 22 micro-batches per rank per epoch,
gradient_accumulation_steps=4, so each epoch is 5 full steps and one of 2 micro-batches, which the Trainer and
accelerate mark as a boundary (docs/ALGORITHM.md, "When the engine ends a step early").

DeepSpeed's own AdamW makes 12 optimizer steps; so does ACCO in every mode. sync ends at AdamW's weights (a
short step's gradient is sum / (W * GAS), as ZeRO-1's); acco (fixed) and adaptive accumulation train through.
One launch runs the six runs (tests/ranks/epochs_worker.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.integrations.trainer_config import AUTO, trainer_ds_config
from tests.ranks.launch import REPO, run_local

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

WORLD, GAS, MICRO, SAMPLES, EPOCHS = 2, 4, 2, 88, 2
BATCHES = SAMPLES // (WORLD * MICRO)  # 22 micro-batches per rank per epoch
STEPS = EPOCHS * -(-BATCHES // GAS)  # 2 x ceil(22 / 4) = 12
ACCO = {
    "sync": {"mode": "sync"},
    "acco": {"mode": "acco"},
    "adaptive": {"mode": "acco", "accumulation": "adaptive"},
}


def accelerate_config(optimizer: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": optimizer,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }


HYPERS = {"lr": 3e-3, "weight_decay": 0.01}
CONFIGS = {
    "trainer": {
        "adamw": trainer_ds_config({"type": "AdamW", "params": AUTO}),
        **{n: trainer_ds_config({"type": "ACCO", "params": {**AUTO, **p}}) for n, p in ACCO.items()},
    },
    "accelerate": {
        "adamw": accelerate_config({"type": "AdamW", "params": HYPERS}),
        "sync": accelerate_config({"type": "ACCO", "params": {**HYPERS, **ACCO["sync"]}}),
        "acco": accelerate_config({"type": "ACCO", "params": {**HYPERS, **ACCO["acco"]}}),
    },
}
RUNS = [f"{kind}_{name}" for kind, configs in CONFIGS.items() for name in configs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("epochs")
    (tmp / "configs.json").write_text(json.dumps(CONFIGS))
    args = ["--output_dir", tmp, "--configs", tmp / "configs.json", "--samples", SAMPLES, "--epochs", EPOCHS]
    run_local(
        REPO / "tests" / "ranks" / "epochs_worker.py", WORLD, args + ["--gradient_accumulation_steps", GAS]
    )
    return torch.load(tmp / "result.pt", weights_only=False)


@pytest.mark.parametrize("run", RUNS)
def test_two_epochs_make_every_step(runs, run):
    res = runs[run]
    assert (res["optimizer_type"] == "ACCOZeroOptimizer") == (not run.endswith("adamw"))
    assert res["global_step"] == STEPS
    if run.startswith("trainer"):
        losses = [h["loss"] for h in res["log_history"] if "loss" in h]
        assert len(losses) == STEPS
    else:
        assert res["batches"] == BATCHES
        losses = res["losses"]
        assert len(losses) == EPOCHS * BATCHES
    assert all(math.isfinite(v) for v in losses)
    if "stats" in res:  # every micro-batch of both epochs went through ACCO's rounds
        assert res["stats"]["micro_batches_local"] == EPOCHS * BATCHES


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_sync_ends_at_deepspeed_adamw(runs, kind):
    """sync with the two short steps ends where DeepSpeed's ZeRO-1 + AdamW ends (fp32, max |diff| 1e-5)."""
    ours, theirs = runs[f"{kind}_sync"]["committed"], runs[f"{kind}_adamw"]["committed"]
    assert ours.keys() == theirs.keys()
    for n in ours:
        diff = (ours[n] - theirs[n]).abs().max().item()
        assert diff <= 1e-5, f"{kind} {n}: max |diff| {diff:.3e}"
    acco = runs[f"{kind}_acco"]["committed"]
    moved = max((theirs[n] - acco[n]).abs().max().item() for n in ours)
    assert moved > 1e-4  # acco trains another trajectory: the comparison above tells them apart
