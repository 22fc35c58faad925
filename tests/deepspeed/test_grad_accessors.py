"""DeepSpeed's gradient API on ACCO (``acco_ds.deepspeed.accessors``), against DeepSpeed's own ZeRO-1 AdamW with the
same config, at 1 rank (in this process) and 2 ranks (one launch of tests/ranks/grad_access_worker.py), fp32 and
bf16.

``sync``: between the boundary's ``engine.backward`` and ``engine.step()``, ``safe_get_full_grad`` gives ZeRO-1's
gradient (averaged over the ranks, fp32); ``safe_set_full_grad`` and ``safe_update_full_grad_vectorized`` change
the gradient the step uses as in ZeRO-1 (the trajectories stay equal after an edit; an element set to 0 leaves
``exp_avg = beta1 * exp_avg``); a NaN written is a skipped step on every rank (``skipped_steps``, no LR scheduler
step, weights unchanged); after ``engine.step()`` both raise a ValueError; ``safe_get_local_grad`` is ZeRO-3's and
refused alike. Inside a step (after its first backward) both read this rank's sum so far. With bf16 parameters
and fp32 communication (no ``.grad`` views) ACCO serves the same reads and writes.

``acco`` / ``dpu``: right after a micro-batch that ended a round the accessors raise, naming the mode and what is
allowed; between backwards inside a round they read this rank's sum.

``bf16.check_grad_overflow=false`` (ZeRO-1 then applies a NaN gradient, shown here) is refused by name.
"""

from __future__ import annotations

import deepspeed
import pytest
import torch

from acco_ds.config import ACCOConfigError
from tests.deepspeed.grad_access_runs import runs_fixtures
from tests.ranks import grad_access_worker as worker
from tests.ranks import toy
from tests.ranks.inproc import ensure_single_rank_group

STEPS, GAS = 5, 2
EDITS = {1: "mask", 2: "nan", 3: "vectorized"}
MASK_STEP, NAN_STEP = 1, 2
ZERO1 = {"type": "AdamW", "params": {"lr": worker.LR, "weight_decay": worker.WD}}
# fp32: DeepSpeed's AdamW and ACCO's round differently in the last bit, and the gradients follow the weights
GRAD_TOL = {"fp32": 1e-6, "bf16": 1e-6}
PARAM_TOL = 2e-6
MOMENT_REL = 1e-4  # as tests/deepspeed/test_engine_boundary.py against ZeRO-1: its AdamW rounds otherwise


def acco(mode: str, **extra) -> dict:
    return {"type": "ACCO", "params": {"lr": worker.LR, "weight_decay": worker.WD, "mode": mode, **extra}}


def scenarios() -> list:
    out = []
    for dtype in ("fp32", "bf16"):
        for name, opt in (("zero1", ZERO1), ("sync", acco("sync"))):
            out.append(
                {
                    "name": f"{name}_{dtype}",
                    "optimizer": opt,
                    "bf16": dtype == "bf16",
                    "gas": GAS,
                    "steps": STEPS,
                }
                | {"edits": EDITS}
            )
    out.append(
        {
            "name": "sync_bf16_comm_fp32",
            "optimizer": acco("sync", comm_dtype="fp32"),
            "bf16": True,
            "gas": GAS,
        }
        | {"steps": STEPS, "edits": EDITS}
    )
    for mode in ("acco", "dpu"):
        out.append(
            {"name": f"probe_{mode}", "optimizer": acco(mode), "gas": 4, "steps": 2, "probe_modes": True}
        )
    return out


one_rank, two_ranks, runs = runs_fixtures(scenarios, "grad_access")


def max_diff(a: list, b: list) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_sync_reads_zero1s_gradient(runs, dtype):
    """At every boundary (before any edit) and after each step's first backward: ZeRO-1's values."""
    zero1, sync = runs[f"zero1_{dtype}"]["steps"], runs[f"sync_{dtype}"]["steps"]
    for t, (z, a) in enumerate(zip(zero1, sync)):
        scale = max(g.abs().max().item() for g in z["grads"])
        assert scale > 0 and not any(torch.equal(g, torch.zeros_like(g)) for g in a["grads"]), t
        assert max_diff(z["grads"], a["grads"]) <= GRAD_TOL[dtype] * scale, f"step {t}: boundary gradient"
        assert max_diff(z["local"], a["local"]) <= GRAD_TOL[dtype] * scale, f"step {t}: sum after 1 backward"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_sync_edits_take_effect_as_in_zero1(runs, dtype):
    """The edits are read back, the trajectories (weights, moments) stay ZeRO-1's, and the masked-to-zero elements
    entered the step as zeros: exp_avg there is beta1 times the previous one."""
    zero1, sync = runs[f"zero1_{dtype}"]["steps"], runs[f"sync_{dtype}"]["steps"]
    for t, kind in EDITS.items():
        if kind == "nan":
            continue
        for run in (zero1, sync):
            want = [
                g * worker.mask_like(p).reshape(-1)
                for g, p in zip(run[t]["grads"], toy.trainable(toy.build()))
            ]
            assert max_diff(run[t]["edited"], want) == 0.0, f"step {t} ({kind}): the edit is not read back"
    for t, (z, a) in enumerate(zip(zero1, sync)):
        assert (z["params"] - a["params"]).abs().max().item() <= PARAM_TOL, f"step {t}: weights"
        for key in ("exp_avg", "exp_avg_sq"):
            rel = (z[key] - a[key]).abs().max().item() / z[key].abs().max().item()
            assert rel <= MOMENT_REL, f"step {t}: {key} rel diff {rel:.2e}"
    masked = torch.cat([worker.mask_like(p).reshape(-1) for p in toy.trainable(toy.build())]) == 0
    before, after = sync[MASK_STEP - 1]["exp_avg"][masked], sync[MASK_STEP]["exp_avg"][masked]
    assert before.abs().max() > 0
    assert torch.allclose(after, 0.9 * before, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize(
    "name", ["zero1_fp32", "sync_fp32", "zero1_bf16", "sync_bf16", "sync_bf16_comm_fp32"]
)
def test_a_nan_written_skips_the_step(runs, name):
    steps = runs[name]["steps"]
    nan, before = steps[NAN_STEP], steps[NAN_STEP - 1]
    assert [s["skipped_steps"] for s in steps] == [0] * NAN_STEP + [1] * (STEPS - NAN_STEP)
    assert torch.equal(nan["params"], before["params"]) and torch.equal(nan["exp_avg"], before["exp_avg"])
    assert nan["lr_after"] == nan["lrs"], "the LR scheduler stepped on a skipped step"
    assert before["lr_after"] != before["lrs"], "the scheduler is expected to move on applied steps"
    assert nan["global_steps"] == NAN_STEP + 1
    assert torch.isfinite(steps[-1]["params"]).all()
    if "stats" in runs[name]:
        assert runs[name]["stats"]["skipped_steps"] == 1


def test_after_the_step_and_local_api_refused_alike(runs):
    for dtype in ("fp32", "bf16"):
        zero1, sync = runs[f"zero1_{dtype}"], runs[f"sync_{dtype}"]
        if "after" in zero1["steps"][0]:  # one rank: see grad_access_worker
            assert zero1["steps"][0]["after"].startswith("ValueError: Gradients are only available")
        assert sync["steps"][0]["after"].startswith(
            "GradientNotAvailable: safe_get_full_grad with optimizer.params"
        )
        assert "engine.step()" in sync["steps"][0]["after"]
        assert zero1["local_grad_error"] == sync["local_grad_error"]
        assert sync["local_grad_error"].startswith("AssertionError: This API is only defined for ZeRO-3")


def test_bf16_parameters_with_fp32_communication(runs):
    """No ``.grad`` views there: every read and write goes through ACCO's methods; ZeRO-1 accumulates in bf16, so
    the values agree to bf16's precision."""
    zero1, mixed = runs["zero1_bf16"]["steps"], runs["sync_bf16_comm_fp32"]["steps"]
    for t, (z, a) in enumerate(zip(zero1, mixed)):
        scale = max(g.abs().max().item() for g in z["grads"])
        assert max_diff(z["grads"], a["grads"]) <= 2e-2 * scale, f"step {t}: boundary gradient"
        assert max_diff(z["local"], a["local"]) <= 2e-2 * scale, f"step {t}: sum after 1 backward"
    want = [
        g * worker.mask_like(p).reshape(-1)
        for g, p in zip(mixed[MASK_STEP]["grads"], toy.trainable(toy.build()))
    ]
    assert max_diff(mixed[MASK_STEP]["edited"], want) <= 1e-6 * max(g.abs().max().item() for g in want)


@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_acco_and_dpu_refuse_where_a_round_ended(runs, mode):
    """gas 4: acco's rounds are 2 micro-batches (the prologue, then the peek / commit rounds), dpu's the step; a
    round's end makes the read and the write raise, naming the mode; inside a round they read (None: no error)."""
    probes = [p for s in runs[f"probe_{mode}"]["steps"] for p in s["probes"]]
    ends = {1, 3, 5, 7} if mode == "acco" else {3, 7}
    for i, (got, wrote) in enumerate(probes):
        if i in ends:
            for err in (got, wrote):
                assert err is not None and err.startswith("GradientNotAvailable:"), (i, err)
                assert (
                    f"optimizer.params.mode={mode!r}" in err
                    and "Allowed: optimizer.params.mode='sync'" in err
                )
        else:
            assert got is None and wrote is None, (i, got)


def test_check_grad_overflow_false_is_refused():
    ensure_single_rank_group()
    sc = {
        "optimizer": acco("sync"),
        "bf16": True,
        "gas": 1,
        "steps": 1,
        "bf16_extra": {"check_grad_overflow": False},
    }
    with pytest.raises(
        ACCOConfigError, match=r"bf16\.check_grad_overflow=false: .* Allowed: bf16\.check_grad_overflow=true"
    ):
        model = toy.build().to(torch.bfloat16)
        deepspeed.initialize(model=model, config=worker.config(sc), model_parameters=toy.trainable(model))
    sc["bf16_extra"] = {"check_grad_overflow": True}
    sc["edits"] = {0: "nan"}
    assert worker.run_scenario(sc, 0)["steps"][0]["skipped_steps"] == 1


def test_zero1_applies_a_nan_without_check_grad_overflow():
    """Why the refusal: with false, DeepSpeed's ZeRO-1 steps with the NaN and it reaches the weights."""
    ensure_single_rank_group()
    sc = {"optimizer": ZERO1, "bf16": True, "gas": 1, "steps": 1, "edits": {0: "nan"}}
    sc["bf16_extra"] = {"check_grad_overflow": False}
    step = worker.run_scenario(sc, 0)["steps"][0]
    assert step["skipped_steps"] == 0 and torch.isnan(step["params"]).any()
