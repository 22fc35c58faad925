"""The engine's boundaries with fp16 (docs/ALGORITHM.md, "fp16: loss scaling" and "When the engine ends a step
early"): steps of 1 to 5 micro-batches marked by the loop, held in ``no_sync()``, inside
``coalesce_grad_reduction()`` or ended by ``engine.step()`` alone, with the model in fp16 under a loss scale
(tests/ranks/boundary_worker.py, 2 ranks, the toy model, no clipping: the moments carry the gradient's scale).

sync equals DeepSpeed's ZeRO-1 fp16 step by step (parameters, moments, gradient norm, loss scale), and every mode
equals the single-process reference at the fp16 parameters: each round is unscaled by its own scale, whatever the
step's length. The scale is 2**8 with a window longer than the run, so no step overflows or grows it (overflows are
tests/core/test_fp16_trajectories.py's)."""

from __future__ import annotations

import pytest

from tests.deepspeed.test_engine_boundary import (
    GAS,
    SIZES,
    assert_equals_reference,
    assert_equals_zero1,
    assert_runs_identical,
    config,
    launch,
    reference,
    reference_cases,
)

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
    return launch(tmp, scenarios)


def test_sync_equals_deepspeed_zero1_fp16(results):
    assert_equals_zero1(results, "sync vs ZeRO-1 fp16", MOMENT_TOL, NORM_TOL, TOL)


@pytest.mark.parametrize(
    ("name", "mode", "k"),
    reference_cases(["sync_manual", "acco_manual", "dpu_late", "acco_no_sync", "sync_coalesce"]),
)
def test_matches_reference(results, name, mode, k):
    res = results[name]
    ref = reference(mode, res["lrs"], k, fp16=True)
    assert_equals_reference(res, ref, name, MOMENT_TOL, TOL)
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
    assert_runs_identical(held, bare, "acco_no_sync")
