"""The engine decides where an optimizer step ends (docs/ALGORITHM.md, "When the engine ends a step early"):
steps of 1 to 5 micro-batches with gradient_accumulation_steps=4, marked by the loop
(``set_gradient_accumulation_boundary``), held in ``no_sync()``, inside ``coalesce_grad_reduction()``, or
ended by ``engine.step()`` alone. 2 ranks on CPU, one launch (tests/ranks/boundary_worker.py), the toy model
in fp32 with no clipping (the moments then carry the gradient's scale).

sync equals DeepSpeed's ZeRO-1 + AdamW step by step (a short step's gradient is sum / (W * GAS), as
``engine.backward`` divided each loss by GAS), and every mode equals the single-process reference
(``reference_run(step_sizes=...)``). Nothing changes the weights before the boundary in sync/dpu or inside
``no_sync()``; ``engine.optimizer.state`` holds ZeRO-1's keys with ACCO's own moment shards; a refused
``engine.step()`` changes nothing and training goes on."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
import torch

from acco_ds.core.reference import RefHyper, reference_run
from tests.ranks import toy
from tests.ranks.launch import REPO, rank_env, run_local
from tests.ranks.toy_config import optimizer, toy_config

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

WORLD, GAS, LR, WD = 2, 4, 0.02, 0.1
# a full step, a step of GAS/2 (acco: the boundary at its PEEK round's last micro-batch), one micro-batch right
# after (a prologue ended by the boundary), a full step from a prologue, 3 (a short stage-1 round), 5 (longer
# than GAS), 1 in a running pipeline, a full step
SIZES = [4, 2, 1, 4, 3, 4, 5, 1, 4]
TOL, MOMENT_TOL, NORM_TOL = 2e-6, 1e-5, 1e-5
ZERO1_MOMENT_TOL = 1e-4  # as tests/core/test_trajectories.py: DeepSpeed reduces in another order
# (mode, style): mode "zero1" is DeepSpeed's own AdamW
RUNS = [
    ("zero1", "manual"),
    ("sync", "manual"),
    ("dpu", "manual"),
    ("acco", "manual"),
    ("sync", "no_sync"),
    ("acco", "no_sync"),
    ("dpu", "no_sync"),
    ("sync", "coalesce"),
    ("acco", "coalesce"),
    ("dpu", "coalesce"),
    ("dpu", "late"),
    ("acco", "late"),
]
PROBED = {"zero1", "sync", "acco"}  # their manual runs also read optimizer.state (and, ACCO, refuse a step)
# the micro-batches of a mode's rounds: acco's peek round ends at GAS/2, the others' one round at the boundary
ROUND = {"sync": GAS, "dpu": GAS, "acco": GAS // 2}


def _variant(**params) -> dict:
    cfg = config("acco")
    cfg["optimizer"]["params"].update(params.pop("acco", {}))
    cfg.update(params)
    return cfg


def variants() -> dict:
    return {
        "acco_bf16": _variant(bf16={"enabled": True}),
        "acco_int8": _variant(acco={"compression": {"commit": "int8", "peek": "int8", "block_size": 16}}),
        "acco_adaptive": _variant(acco={"accumulation": "adaptive", "max_micro_batches_per_round": GAS // 2}),
    }


def config(mode: str) -> dict:
    return toy_config(optimizer(mode, lr=LR, weight_decay=WD), GAS, warmup=(LR / 4, LR, 4))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("boundary")
    scenarios = [
        {
            "name": f"{mode}_{style}",
            "config": config(mode),
            "sizes": SIZES,
            "style": style,
            "probe": style == "manual" and mode in PROBED,
        }
        for mode, style in RUNS
    ]
    # acco variants whose held micro-batches must run the marked loop's rounds too: bf16, int8 rounds, and adaptive
    # accumulation with rounds capped at their share (so where they end does not depend on timing)
    for variant, cfg in variants().items():
        for style in ("manual", "no_sync", "coalesce"):
            scenarios.append({"name": f"{variant}_{style}", "config": cfg, "sizes": SIZES, "style": style})
    # every step ends at its peek round's share: acco commits each alone, one round per step (the notice's case)
    scenarios.append(
        {"name": "acco_short", "config": config("acco"), "sizes": [GAS // 2] * 6, "style": "manual"}
    )
    # memory_state on in a bare loop, with and without its step records (one node: no copies)
    memory_root = Path("/dev/shm") / f"acco_boundary_{uuid.uuid4().hex}"
    for recorded in (False, True):
        name = f"acco_memory_{'recorded' if recorded else 'unrecorded'}"
        memory = {"memory_state": {"enabled": True, "dir": str(memory_root), "run_id": name}}
        scenarios.append(
            {
                "name": name,
                "config": _variant(acco=memory),
                "sizes": SIZES,
                "style": "manual",
                "record_steps": recorded,
            }  # fmt: skip
        )
    try:
        return launch(tmp, scenarios)
    finally:
        shutil.rmtree(memory_root, ignore_errors=True)


def launch(tmp, scenarios: list) -> dict:
    """One launch of tests/ranks/boundary_worker.py over ``scenarios`` (written to ``tmp``): its results."""
    import json

    (tmp / "scenarios.json").write_text(json.dumps(scenarios))
    args = ["--scenarios", tmp / "scenarios.json", "--out", tmp]
    run_local(REPO / "tests" / "ranks" / "boundary_worker.py", WORLD, args, env=rank_env())
    return torch.load(tmp / "results.pt", weights_only=False)


def reference(mode: str, lrs, k: int, fp16: bool = False):
    """The single-process reference of SIZES' steps at the LRs ``lrs``, ``k`` micro-batches a round; ``fp16``:
    from the toy's fp16 parameters, computed in fp16."""
    model = toy.build().half() if fp16 else toy.build()
    return reference_run(
        mode,
        [toy.flat(toy.trainable(model))],
        toy.make_grad_fn(torch.float32),
        world_size=WORLD,
        micro_batches_per_round=k,
        steps=len(SIZES),
        hypers=lambda t: [RefHyper(lrs[t], (0.9, 0.999), 1e-8, WD)],
        step_sizes=SIZES,
        **({"compute_dtype": torch.float16} if fp16 else {}),
    )


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    assert scale > 0
    return (got - want).abs().max().item() / scale


def assert_steps_equal(
    got: list, params, exp_avg, exp_avg_sq, where: str, moment_tol=MOMENT_TOL, tol=TOL
) -> None:
    assert len(got) == len(SIZES)
    for t, step in enumerate(got):
        diff = (step["params"] - params[t]).abs().max().item()
        assert diff <= tol, f"{where} step {t + 1} ({SIZES[t]} micro-batches): parameters |diff| {diff:.3e}"
        for key, want in (("exp_avg", exp_avg[t]), ("exp_avg_sq", exp_avg_sq[t])):
            rel = max_rel(step[key], want)
            assert rel <= moment_tol, (
                f"{where} step {t + 1} ({SIZES[t]} micro-batches): {key} rel diff {rel:.3e}"
            )


def assert_equals_zero1(results, where: str, moment_tol=ZERO1_MOMENT_TOL, norm_tol=NORM_TOL, tol=TOL) -> None:
    """The marked sync run's LRs, parameters, moments and gradient norms are ZeRO-1's, step by step."""
    ours, zero1 = results["sync_manual"], results["zero1_manual"]
    assert ours["lrs"] == pytest.approx(zero1["lrs"])
    want = zero1["steps"]
    assert_steps_equal(
        ours["steps"],
        [s["params"] for s in want],
        [s["exp_avg"] for s in want],
        [s["exp_avg_sq"] for s in want],
        where,
        moment_tol,
        tol,
    )
    for t, (got, ref) in enumerate(zip(ours["norms"], zero1["norms"])):
        assert got == pytest.approx(ref, rel=norm_tol), f"step {t + 1}: grad norm {got} vs ZeRO-1 {ref}"


def assert_equals_reference(res: dict, ref, name: str, moment_tol=MOMENT_TOL, tol=TOL) -> None:
    """The run's parameters and moments are the reference's (``reference()``), step by step."""
    assert_steps_equal(
        res["steps"],
        [p[0] for p in ref.params],
        [m[0] for m in ref.exp_avg],
        [v[0] for v in ref.exp_avg_sq],
        name,
        moment_tol,
        tol,
    )


def assert_runs_identical(got: dict, bare: dict, name: str) -> None:
    """The run's weights, moments and gradient norms are the marked loop's (``bare``), bit for bit."""
    for t, (a, b) in enumerate(zip(got["steps"], bare["steps"])):
        for key in ("params", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[key], b[key]), f"{name} step {t + 1}: {key} differs from the marked loop's"
    assert got["norms"] == bare["norms"]


def test_reference_sees_short_steps():
    """The step lengths matter: the reference with SIZES differs from one with every step full, in every mode,
    by far more than the tolerance (so a run that ignored the engine's boundaries could not pass)."""
    lrs = [LR] * len(SIZES)
    for mode, k in ROUND.items():
        sized = reference(mode, lrs, k).params[-1][0]
        full = reference_run(
            mode,
            [toy.flat(toy.trainable(toy.build()))],
            toy.make_grad_fn(torch.float32),
            world_size=WORLD,
            micro_batches_per_round=k,
            steps=len(SIZES),
            hypers=lambda t: [RefHyper(LR, (0.9, 0.999), 1e-8, WD)],
        ).params[-1][0]
        assert (sized - full).abs().max() > 100 * TOL, mode


def test_sync_equals_deepspeed_zero1(results):
    """sync with steps of 1-5 micro-batches marked by the loop ends at DeepSpeed ZeRO-1 + AdamW's parameters,
    moments and gradient norms, step by step."""
    assert_equals_zero1(results, "sync vs ZeRO-1")


def reference_cases(names: list) -> list:
    """``(name, mode, k)`` of the runs ``names`` (``<mode>_<style>``): ``k``, the micro-batches of the mode's rounds."""
    return [(name, name.split("_")[0], ROUND[name.split("_")[0]]) for name in names]


@pytest.mark.parametrize(
    ("name", "mode", "k"),
    reference_cases(
        ["sync_manual", "dpu_manual", "acco_manual", "dpu_late", "acco_late", "sync_no_sync", "sync_coalesce"]
        # held to its boundary, an acco step runs the rounds of the marked loop: its peek round ends by count
        + ["acco_no_sync", "dpu_no_sync", "acco_coalesce", "dpu_coalesce"]
    ),
)
def test_matches_reference(results, name, mode, k):
    res = results[name]
    ref = reference(mode, res["lrs"], k)
    assert_equals_reference(res, ref, name)
    if mode == "sync":
        for t, (got, want) in enumerate(zip(res["norms"], ref.norms)):
            assert got == pytest.approx(want, rel=NORM_TOL), f"{name} step {t + 1}: grad norm {got} vs {want}"
    assert res["stats"]["micro_batches_local"] == sum(SIZES) + (4 if "refused" in res else 0)


@pytest.mark.parametrize("name", [f"{m}_{s}" for m, s in RUNS if m in ("zero1", "sync", "dpu")])
def test_nothing_moves_before_the_boundary(results, name):
    """In sync and dpu (and DeepSpeed's ZeRO-1) no backward before the engine's boundary changes the weights,
    inside no_sync() or not (acco's peek round end changes them mid-step by design, inside no_sync() too)."""
    assert results[name]["moved_before_boundary"] == 0


@pytest.mark.parametrize("held", ["no_sync", "coalesce"])
@pytest.mark.parametrize("variant", ["acco_bf16", "acco_int8", "acco_adaptive"])
def test_held_variants_run_the_bare_loops_rounds(results, variant, held):
    """bf16, int8 rounds (fused round ends declared inside no_sync() too) and capped adaptive rounds: held in
    no_sync() or a coalesced reduction, the run is the marked loop's, bit for bit, with the same rounds."""
    got, bare = results[f"{variant}_{held}"], results[f"{variant}_manual"]
    assert got["stats"]["rounds"] == bare["stats"]["rounds"] and got["stats"]["rounds"] > len(SIZES)
    assert got["stats"]["micro_batches_held"] > 0 and bare["stats"]["micro_batches_held"] == 0
    assert_runs_identical(got, bare, f"{variant}_{held}")


@pytest.mark.parametrize("held", ["no_sync", "coalesce"])
@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_held_micro_batches_run_the_bare_loops_rounds(results, mode, held):
    """Inside no_sync() (accelerate's accumulate() enters it between boundaries) or coalesce_grad_reduction(), no
    step ends, yet the rounds that end by count do: acco's peek after GAS/2 micro-batches. The run is the marked
    loop's bit for bit (weights, moments, norms) with the same number of rounds: two per acco step, not one."""
    name = f"{mode}_{held}"
    got, bare = results[name], results[f"{mode}_manual"]
    short = sum(1 for s in SIZES if s <= GAS // 2)  # an acco step this short is committed alone: one round
    assert got["stats"]["rounds"] == (2 * len(SIZES) - short if mode == "acco" else len(SIZES))
    assert_runs_identical(got, bare, name)


def test_no_overlap_is_said_once_with_its_cause(results):
    """A run whose every step ends at GAS/2 micro-batches runs one round per step in acco mode: the optimizer says
    so (its cause and what to do) and reports the figure; the runs with two rounds per step, no_sync() included,
    name no round-count cause (the toy's rounds may still wait for gloo: that cause is tests/core/test_overlap.py's)."""
    short = results["acco_short"]
    assert short["stats"]["rounds_per_step"] == 1.0
    notice = short["overlap_notice"]
    assert notice is not None and f"at most {GAS // 2} micro-batches" in notice, notice
    for name in ("acco_manual", "acco_no_sync", "acco_coalesce", "dpu_no_sync"):
        said = results[name]["overlap_notice"] or ""
        assert "one round per optimizer step" not in said and "at most" not in said, (name, said)
    assert results["acco_no_sync"]["stats"]["rounds_per_step"] > 1.5
    assert results["acco_no_sync"]["stats"]["micro_batches_held"] == sum(SIZES) - len(SIZES)


def test_a_loop_that_records_no_step_is_told_so(results):
    """memory_state on in a loop that never calls ``record_step``: the commits are recorded but a restart would find
    no step to resume at; the optimizer says so at its fifth step, naming the call, and the run is the plain one's
    bit for bit, with the bare loop's rounds (two per acco step, one for a step committed alone). The same loop
    calling ``record_step`` after each step is told nothing."""
    said = results["acco_memory_unrecorded"]["memory_notice"]
    assert said is not None and "record_step(engine, step, client_state)" in said, said
    assert results["acco_memory_recorded"]["memory_notice"] is None
    assert results["acco_manual"]["memory_notice"] is None
    # a step this short is committed alone: one round (acco_manual's probe steps once more: not its count)
    short = sum(1 for s in SIZES if s <= GAS // 2)
    for name in ("acco_memory_unrecorded", "acco_memory_recorded"):
        assert_runs_identical(results[name], results["acco_manual"], name)
        assert results[name]["stats"]["rounds"] == 2 * len(SIZES) - short, name


@pytest.mark.parametrize("mode", sorted(PROBED))
def test_optimizer_state_as_zero1(results, mode):
    """engine.optimizer.state: per flat fp32 shard, ZeRO-1's keys; ACCO's moments are its own shards (views)
    and "step" counts the commits in them (acco: the commit launched at the last boundary too, once
    finished): the steps taken, as ZeRO-1's."""
    state = results[f"{mode}_manual"]["state"]
    assert state["keys"] == [["exp_avg", "exp_avg_sq", "step"]] * len(state["keys"])
    assert state["step"] == [float(len(SIZES))] * len(state["step"])
    if mode != "zero1":
        assert all(state["views"])


def test_refused_step_changes_nothing(results):
    """engine.step() with no backward since the last step is refused, names what is allowed, and leaves the
    weights, the committed state, ACCO's and the engine's counters and the LR as they were; training goes
    on after it."""
    refused = results["acco_manual"]["refused"]
    assert (
        refused["error"] is not None
        and "Allowed" in refused["error"]
        and "engine.backward" in refused["error"]
    )
    before, after = refused["before"], refused["after"]
    assert torch.equal(before["module"], after["module"])
    for key in ("params", "exp_avg", "exp_avg_sq"):
        assert torch.equal(before["committed"][key], after["committed"][key]), key
    assert before["counts"] == after["counts"]
    assert before["lr"] == after["lr"]
    assert before["engine"] == after["engine"]
    moved = (results["acco_manual"]["after_refusal"]["params"] - after["committed"]["params"]).abs().max()
    assert moved > 10 * TOL
