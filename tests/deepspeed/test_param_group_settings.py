"""Per-group AdamW settings through the engine: ``deepspeed.initialize(model_parameters=[groups])`` with three groups of
different lr, betas and weight_decay, and a LambdaLR that scales each group's own lr (the engine's scheduler).
ACCO ``sync`` against DeepSpeed's ZeRO-1 AdamW with the same groups: the lrs, the committed weights and both Adam
moments after every step, at 1 rank (in this process) and 2 ranks (one launch of tests/ranks/grad_access_worker.py).
The comparison can see a group stepped with another group's settings: ZeRO-1 with every parameter in the first
group's settings ends far outside the tolerance."""

from __future__ import annotations

import pytest

from tests.deepspeed.grad_access_runs import runs_fixtures

STEPS, GAS = 4, 2
# toy.trainable: emb.weight (tied to out.weight), fc1.weight | fc1.bias, fc2.weight | fc2.bias, out.bias
GROUPS = [
    [0, 2, {"lr": 0.02, "betas": [0.9, 0.999], "weight_decay": 0.1}],
    [2, 4, {"lr": 0.005, "betas": [0.8, 0.95], "weight_decay": 0.0}],
    [4, 6, {"lr": 0.05, "betas": [0.5, 0.9], "weight_decay": 0.3}],
]
FLAT = [[0, 6, GROUPS[0][2]]]  # every parameter with the first group's settings
PARAM_TOL = 2e-6
MOMENT_REL = 1e-4  # as tests/deepspeed/test_engine_boundary.py against ZeRO-1: its AdamW rounds otherwise


def scenarios() -> list:
    base = {"gas": GAS, "steps": STEPS, "lr_decay": True}
    return [
        {"name": "zero1", "optimizer": {"type": "AdamW", "params": {}}, "groups": GROUPS, **base},
        {"name": "sync", "optimizer": {"type": "ACCO", "params": {"mode": "sync"}}, "groups": GROUPS, **base},
        {"name": "zero1_flat", "optimizer": {"type": "AdamW", "params": {}}, "groups": FLAT, **base},
    ]


one_rank, two_ranks, runs = runs_fixtures(scenarios, "param_groups")


def test_group_lrs_follow_the_schedule(runs):
    base = [g[2]["lr"] for g in GROUPS]
    for t, (z, a) in enumerate(zip(runs["zero1"]["steps"], runs["sync"]["steps"])):
        assert a["lrs"] == z["lrs"] == pytest.approx([lr / (1 + t) for lr in base], rel=1e-12), t


def test_sync_steps_each_group_with_its_settings(runs):
    for t, (z, a) in enumerate(zip(runs["zero1"]["steps"], runs["sync"]["steps"])):
        diff = (z["params"] - a["params"]).abs().max().item()
        assert diff <= PARAM_TOL, f"step {t + 1}: weights |diff| {diff:.3e}"
        for key in ("exp_avg", "exp_avg_sq"):
            rel = (z[key] - a[key]).abs().max().item() / z[key].abs().max().item()
            assert rel <= MOMENT_REL, f"step {t + 1}: {key} rel diff {rel:.2e}"


def test_the_comparison_sees_one_groups_settings_everywhere(runs):
    grouped, flat = runs["zero1"]["steps"][-1], runs["zero1_flat"]["steps"][-1]
    assert (grouped["params"] - flat["params"]).abs().max().item() > 100 * PARAM_TOL
    for key in ("exp_avg", "exp_avg_sq"):
        rel = (grouped[key] - flat[key]).abs().max().item() / grouped[key].abs().max().item()
        assert rel > 100 * MOMENT_REL, key
