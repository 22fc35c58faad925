"""The engine's boundaries with fp16 (docs/ALGORITHM.md, "fp16: loss scaling" and "When the engine ends a step
early"): steps of 1 to 5 micro-batches marked by the loop, held in ``no_sync()``, inside
``coalesce_grad_reduction()`` or ended by ``engine.step()`` alone, with the model in fp16 under a loss scale
(tests/ranks/boundary_worker.py, 2 ranks, the toy model, no clipping: the moments carry the gradient's scale).

sync equals DeepSpeed's ZeRO-1 fp16 step by step (parameters, moments, gradient norm, loss scale), and every mode
equals the single-process reference at the fp16 parameters: each round is unscaled by its own scale, whatever the
step's length. The scale is 2**8 with a window longer than the run, so no step overflows or grows it (overflows are
tests/core/test_fp16_trajectories.py's)."""

from __future__ import annotations

import json

import pytest
import torch

from acco_ds.core.reference import RefHyper, reference_run
from tests.deepspeed.test_engine_boundary import GAS, SIZES, WD, WORLD, config, max_rel
from tests.ranks import toy
from tests.ranks.launch import REPO, rank_env, run_local

pytestmark = pytest.mark.launcher

FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
TOL, MOMENT_TOL, NORM_TOL = 2e-3, 2e-2, 1e-2
RUNS = [
    ("zero1", "manual"),
    ("sync", "manual"),
    ("acco", "manual"),
    ("dpu", "late"),
    ("acco", "no_sync"),
    ("sync", "coalesce"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("boundary_fp16")
    scenarios = [
        {
            "name": f"{mode}_{style}",
            "config": {**config(mode), "fp16": FP16},
            "sizes": SIZES,
            "style": style,
            "probe": False,
        }
        for mode, style in RUNS
    ]
    (tmp / "scenarios.json").write_text(json.dumps(scenarios))
    args = ["--scenarios", tmp / "scenarios.json", "--out", tmp]
    run_local(REPO / "tests" / "ranks" / "boundary_worker.py", WORLD, args, env=rank_env())
    return torch.load(tmp / "results.pt", weights_only=False)


def reference(mode: str, lrs, k: int):
    theta0 = toy.flat(toy.trainable(toy.build().half()))
    return reference_run(
        mode,
        [theta0],
        toy.make_grad_fn(torch.float32),
        world_size=WORLD,
        micro_batches_per_round=k,
        steps=len(SIZES),
        hypers=lambda t: [RefHyper(lrs[t], (0.9, 0.999), 1e-8, WD)],
        step_sizes=SIZES,
        compute_dtype=torch.float16,
    )


def assert_close(got: list, params, exp_avg, exp_avg_sq, where: str) -> None:
    assert len(got) == len(SIZES)
    for t, step in enumerate(got):
        diff = (step["params"] - params[t]).abs().max().item()
        assert diff <= TOL, f"{where} step {t + 1} ({SIZES[t]} micro-batches): parameters |diff| {diff:.3e}"
        for key, want in (("exp_avg", exp_avg[t]), ("exp_avg_sq", exp_avg_sq[t])):
            rel = max_rel(step[key], want)
            assert rel <= MOMENT_TOL, f"{where} step {t + 1}: {key} rel diff {rel:.3e}"


def test_sync_equals_deepspeed_zero1_fp16(results):
    ours, zero1 = results["sync_manual"], results["zero1_manual"]
    assert ours["lrs"] == pytest.approx(zero1["lrs"])
    want = zero1["steps"]
    assert_close(
        ours["steps"],
        [s["params"] for s in want],
        [s["exp_avg"] for s in want],
        [s["exp_avg_sq"] for s in want],
        "sync vs ZeRO-1 fp16",
    )
    for t, (got, ref) in enumerate(zip(ours["norms"], zero1["norms"])):
        assert got == pytest.approx(ref, rel=NORM_TOL), f"step {t + 1}: grad norm {got} vs ZeRO-1 {ref}"


@pytest.mark.parametrize(
    ("name", "mode", "k"),
    [
        ("sync_manual", "sync", GAS),
        ("acco_manual", "acco", GAS // 2),
        ("dpu_late", "dpu", GAS),
        ("acco_no_sync", "acco", GAS // 2),
        ("sync_coalesce", "sync", GAS),
    ],
)
def test_matches_reference(results, name, mode, k):
    res = results[name]
    ref = reference(mode, res["lrs"], k)
    assert_close(
        res["steps"],
        [p[0] for p in ref.params],
        [m[0] for m in ref.exp_avg],
        [v[0] for v in ref.exp_avg_sq],
        name,
    )
    assert res["stats"]["skipped_steps"] == 0
    assert res["stats"]["micro_batches_local"] == sum(SIZES)


def test_no_sync_runs_the_bare_loops_rounds_fp16(results):
    """Under no_sync() between boundaries (accelerate's accumulate()), acco's peek rounds still end by count: the
    run is the marked loop's, bit for bit (weights, moments, norms), with the same rounds."""
    held, bare = results["acco_no_sync"], results["acco_manual"]
    assert (
        held["stats"]["rounds"]
        == bare["stats"]["rounds"]
        == 2 * len(SIZES) - sum(s <= GAS // 2 for s in SIZES)
    )
    for t, (a, b) in enumerate(zip(held["steps"], bare["steps"])):
        for key in ("params", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[key], b[key]), f"step {t + 1}: {key} differs from the marked loop's"
    assert held["norms"] == bare["norms"]
