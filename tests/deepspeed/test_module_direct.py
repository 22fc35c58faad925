"""Loops that call the wrapped module directly (``loss = engine.module(x, y)``, then ``engine.backward(loss)`` and
``engine.step()``), as DeepSpeed allows and as programs training several engines in one process do, with several
engines trained alternately in one process; and fp16's public face (``optimizer.loss_scaler``,
``dynamic_loss_scale``, ``cur_scale``) against DeepSpeed's ZeRO-1. One launch of 2 CPU ranks
(tests/ranks/module_direct_worker.py), the toy model, GAS 2, no clipping.

Per precision (fp32, bf16, fp16 with planted overflows: a hysteresis drop, a halving and a growth of the scale), one
process trains a sync, a dpu and an acco engine and DeepSpeed's ZeRO-1 AdamW alternately, module-direct; another
trains the three ACCO engines through ``engine(x, y)``. Module-direct equals ``engine(x, y)`` bit for bit in every mode
and precision (committed weights, moments, norms, skips, loss-scale attributes, the module's own weights); sync
module-direct equals ZeRO-1 within the tolerances of tests/core/test_trajectories.py and
tests/core/test_fp16_trajectories.py; the loss-scale attributes read on ACCO sync (from the ``loss_scaler`` object
taken before training, as DeepSpeed's own tests keep it) equal ZeRO-1's at every step, with dynamic and with a static
fp16 scale (``"loss_scale": 128``) and without fp16."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.ranks import toy
from tests.ranks.launch import REPO, rank_env, run_local
from tests.ranks.toy_config import optimizer, toy_config

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

WORLD, GAS, LR, WD = 2, 2, 0.02, 0.1
MODES = ("sync", "dpu", "acco")
# a scale growing every 2 good steps, hysteresis 2; overflows planted at steps 1 and 2 (0-based): the first drops
# the hysteresis, the second halves the scale, and the scale grows again at step 5
FP16 = {
    "enabled": True,
    "initial_scale_power": 8,
    "loss_scale_window": 2,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": FP16}}
STEPS = {"fp32": 3, "bf16": 3, "fp16": 6}
POISON = {"fp16": [1, 2]}
STATIC = {"fp16": {"enabled": True, "loss_scale": 128}}
# the project's tolerances for sync against ZeRO-1: parameters (max abs), moments (max rel), norms (rel)
TOL = {"fp32": 2e-6, "bf16": 2e-3, "fp16": 2e-3}
MOMENT_RELS = {
    "fp32": {"exp_avg": 1e-4, "exp_avg_sq": 1e-4},
    "bf16": {"exp_avg": 2**-8, "exp_avg_sq": 2**-7},
    "fp16": {"exp_avg": 2e-2, "exp_avg_sq": 2e-2},
}
NORM_REL = {"fp32": 1e-5, "bf16": 1e-3, "fp16": 1e-2}


def config(mode: str, precision: dict) -> dict:
    return toy_config(optimizer(mode, lr=LR, weight_decay=WD), GAS, **precision)


def scenarios() -> list:
    out = []
    for d, precision in PRECISIONS.items():
        common = {"steps": STEPS[d], "poison": POISON.get(d, [])}
        out.append(
            {
                "name": f"{d}_module",
                "configs": [config(m, precision) for m in MODES] + [config("zero1", precision)],
                "seeds": [0, 1, 2, 0],  # the ZeRO-1 engine trains the sync engine's model on its data
                "call": "module",
                **common,
            }
        )
        out.append(
            {
                "name": f"{d}_engine",
                "configs": [config(m, precision) for m in MODES],
                "seeds": [0, 1, 2],
                "call": "engine",
                **common,
            }
        )
    for d in ("fp32", "bf16"):
        out.append(
            {
                "name": f"{d}_shared",
                "configs": [config(m, PRECISIONS[d]) for m in MODES] + [config("zero1", PRECISIONS[d])],
                "seeds": [0, 1, 2, 0],
                "call": "shared",
                "steps": STEPS[d],
            }
        )
    out.append(
        {
            "name": "fp16_static_module",
            "configs": [config("sync", STATIC), config("zero1", STATIC)],
            "seeds": [0, 0],
            "call": "module",
            "steps": 3,
        }
    )
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("module_direct")
    (tmp / "scenarios.json").write_text(json.dumps(scenarios()))
    args = ["--scenarios", tmp / "scenarios.json", "--out", tmp]
    run_local(REPO / "tests" / "ranks" / "module_direct_worker.py", WORLD, args, env=rank_env(), timeout=900)
    return torch.load(tmp / "results.pt", weights_only=False)


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    if scale == 0:
        return 0.0 if got.abs().max().item() == 0 else math.inf
    return (got - want).abs().max().item() / scale


def same_norm(got, want, rel: float) -> bool:
    if want is None or not math.isfinite(want):
        return got is None or not math.isfinite(got)
    return got is not None and got == pytest.approx(want, rel=rel)


def scaler_fields(step: dict) -> dict:
    return {k: v for k, v in step.items() if k not in ("params", "exp_avg", "exp_avg_sq", "norm")}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_module_direct_equals_engine_call(results, precision, mode):
    """Module-direct trains exactly as ``engine(x, y)``: every step's committed weights, moments, norm, skips and
    loss-scale attributes, and the module's weights at the end, bit for bit, with other engines trained in between."""
    e = MODES.index(mode)
    direct = results[f"{precision}_module"]["engines"][e]
    called = results[f"{precision}_engine"]["engines"][e]
    assert len(direct["steps"]) == len(called["steps"]) == STEPS[precision]
    for t, (a, b) in enumerate(zip(direct["steps"], called["steps"])):
        for key in ("params", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[key], b[key]), f"step {t + 1}: {key} differs from the engine(x, y) run"
        assert a["norm"] == b["norm"] or (a["norm"] != a["norm"] and b["norm"] != b["norm"]), (
            f"step {t + 1}: norm"
        )
        assert scaler_fields(a) == scaler_fields(b), f"step {t + 1}"
    assert torch.equal(direct["final_model"], called["final_model"])
    initial = toy.flat(toy.trainable(toy.build(seed=e)))
    assert (direct["steps"][-1]["params"] - initial).abs().max() > LR / 2, "the run did not train"
    if precision == "fp16":
        assert direct["steps"][-1]["skipped_steps"] >= 1, "no planted overflow was skipped"


def assert_steps_close(ours: dict, theirs: dict, precision: str) -> None:
    """Step by step, one engine's parameters and moments are the other's within the precision's tolerances."""
    for t, (a, b) in enumerate(zip(ours["steps"], theirs["steps"])):
        diff = (a["params"] - b["params"]).abs().max().item()
        assert diff <= TOL[precision], f"step {t + 1}: parameters max |diff| {diff:.3e}"
        for key, rel in MOMENT_RELS[precision].items():
            assert max_rel(a[key], b[key]) <= rel, (
                f"step {t + 1}: {key} rel diff {max_rel(a[key], b[key]):.3e}"
            )


@pytest.mark.parametrize("precision", PRECISIONS)
def test_sync_module_direct_equals_zero1(results, precision):
    """sync, module-direct with other engines in the process, follows DeepSpeed's ZeRO-1 AdamW trained the same way
    (the same model and data): weights, moments and norms within the project's tolerances, the same skips."""
    ours, theirs = (results[f"{precision}_module"]["engines"][i] for i in (0, len(MODES)))
    assert_steps_close(ours, theirs, precision)
    for t, (a, b) in enumerate(zip(ours["steps"], theirs["steps"])):
        assert same_norm(a["norm"], b["norm"], NORM_REL[precision]), (
            f"step {t + 1}: {a['norm']} vs {b['norm']}"
        )
        assert a["skipped_steps"] == b["skipped_steps"], f"step {t + 1}: skipped steps"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_loss_scaler_attributes_equal_zero1(results, precision):
    """``optimizer.loss_scaler`` (the object taken before training, read after every step), ``dynamic_loss_scale``,
    ``cur_scale`` and ``loss_scale`` on ACCO sync equal ZeRO-1's at every step: DeepSpeed's DynamicLossScaler fields
    with fp16 through planted overflows, its static LossScaler of scale 1.0 with fp32 and bf16."""
    ours, theirs = (results[f"{precision}_module"]["engines"][i] for i in (0, len(MODES)))
    for t, (a, b) in enumerate(zip(ours["steps"], theirs["steps"])):
        assert scaler_fields(a) == scaler_fields(b), f"step {t + 1}"
    fields = [scaler_fields(s) for s in theirs["steps"]]
    if precision != "fp16":
        assert all(
            f["is_static_scaler"] and f["cur_scale"] == 1.0 and not f["dynamic_loss_scale"] for f in fields
        )
        return
    scales = [f["loss_scaler.cur_scale"] for f in fields]
    hysteresis = [f["loss_scaler.cur_hysteresis"] for f in fields]
    assert fields[0]["is_dynamic_scaler"] and fields[0]["dynamic_loss_scale"]
    assert [f["loss_scaler.cur_iter"] for f in fields] == list(range(1, STEPS["fp16"] + 1))
    assert 1 in hysteresis and min(scales) < 2**8 and scales[-1] > min(scales), (
        "the scale did not drop and grow"
    )
    assert fields[-1]["loss_scaler.last_overflow_iter"] == POISON["fp16"][-1]


def test_static_loss_scale_attributes_equal_zero1(results):
    """A static fp16 scale (``"loss_scale": 128``): ``loss_scaler.loss_scale`` and ``cur_scale`` are 128 and
    ``dynamic_loss_scale`` is False at every step, as ZeRO-1's, whose run sync follows."""
    ours, theirs = results["fp16_static_module"]["engines"]
    for t, (a, b) in enumerate(zip(ours["steps"], theirs["steps"])):
        assert scaler_fields(a) == scaler_fields(b), f"step {t + 1}"
        assert a["loss_scaler.loss_scale"] == a["cur_scale"] == 128.0 and not a["dynamic_loss_scale"]
        assert a["is_static_scaler"] and not a["is_dynamic_scaler"]
        diff = (a["params"] - b["params"]).abs().max().item()
        assert diff <= TOL["fp16"], f"step {t + 1}: parameters max |diff| {diff:.3e}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_shared_loss_with_bare_backward(results, precision):
    """Several engines under one loss run backward by torch itself, then each engine's ``_backward_epilogue()`` and
    ``step()`` (DeepSpeed's own multiple-models loop): ACCO adopts the gradients autograd left in fresh ``.grad``
    tensors; sync follows ZeRO-1 trained the same way, and every mode trains (finite weights that moved)."""
    engines = results[f"{precision}_shared"]["engines"]
    assert_steps_close(engines[0], engines[len(MODES)], precision)
    for e, engine in enumerate(engines[: len(MODES)]):
        first, last = engine["steps"][0]["params"], engine["steps"][-1]["params"]
        assert torch.isfinite(last).all() and (last - first).abs().max() > 10 * TOL[precision], MODES[e]
