"""The Hugging Face Trainer, weight decay 0.01, with its own decay / no-decay parameter groups handed to DeepSpeed
(tests/ranks/hf_groups_worker.py), ``"type": "ACCO"`` in ``sync`` mode, 2 ranks on CPU: the engine's optimizer
holds the two groups with their weight decays, and every committed step moved each parameter by AdamW with its
own group's decay: ``theta_t = theta_{t-1} (1 - lr_t wd_g) - lr_t m^_t / (sqrt(v^_t) + eps)``, from the moments the
optimizer holds after the step. So the no-decay group (norm weights, near 1, where a decay of lr * 0.01 is far
above the tolerance) is not decayed, and the decay group is."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.integrations.trainer_config import AUTO, trainer_ds_config
from tests.ranks.launch import REPO, run_local

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

WORLD, STEPS, WD = 2, 4, 0.01
BETAS, EPS = (0.9, 0.999), 1e-8  # TrainingArguments' defaults (adam_beta1/2, adam_epsilon)
ABS, REL = 1e-7, 2e-6


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_groups")
    cfg = tmp / "ds_config.json"
    cfg.write_text(json.dumps(trainer_ds_config({"type": "ACCO", "params": {**AUTO, "mode": "sync"}})))
    args = ["--output_dir", tmp, "--deepspeed", cfg, "--max_steps", STEPS]
    run_local(REPO / "tests" / "ranks" / "hf_groups_worker.py", WORLD, args)
    return torch.load(tmp / "result.pt", weights_only=False)


def predicted(prev, m, v, lr, wd, step):
    """AdamW's update (torch.optim.AdamW's form) in float64."""
    prev, m, v = prev.double(), m.double(), v.double()
    bc1, bc2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
    return prev * (1 - lr * wd) - (lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + EPS)


def test_the_engine_holds_the_trainers_groups(result):
    assert result["optimizer_type"] == "ACCOZeroOptimizer"
    decay, no_decay = result["names"]
    assert decay and no_decay
    assert all("norm" in n or n.endswith("bias") for n in no_decay), no_decay
    assert not any("norm" in n for n in decay)
    assert [s["weight_decay"] for s in result["settings"]] == [WD, 0.0]
    assert all(tuple(s["betas"]) == BETAS and s["eps"] == EPS for s in result["settings"])


def test_each_group_decays_with_its_own_setting(result):
    steps = result["steps"]
    assert len(steps) == STEPS and [s["skipped_steps"] for s in steps] == [0] * STEPS
    moved = 0
    for t, step in enumerate(steps, start=1):
        prev = result["start"] if t == 1 else steps[t - 2]["params"]
        for g, (names, wd) in enumerate(zip(result["names"], (WD, 0.0))):
            lr = step["lrs"][g]
            for n in names:
                got = step["params"][n].double()
                want = predicted(prev[n], step["exp_avg"][n], step["exp_avg_sq"][n], lr, wd, t)
                tol = ABS + REL * prev[n].double().abs()
                assert ((got - want).abs() <= tol).all(), f"step {t}, {n} (weight_decay {wd})"
                # the other group's decay would be seen: the identity then fails on this parameter
                other = predicted(prev[n], step["exp_avg"][n], step["exp_avg_sq"][n], lr, WD - wd, t)
                if lr > 0 and wd == 0.0 and prev[n].abs().max() > 0.5:
                    assert ((got - other).abs() > tol).any(), f"step {t}, {n}: decay invisible here"
                    moved += 1
    assert moved > 0, "no no-decay parameter where a decay would have shown"
