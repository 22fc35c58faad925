"""A NaN/Inf in one rank's gradient: the round's update is skipped on every rank alike, reported
through the engine's ``overflow``/``skipped_steps``, and training goes on (docs/RELIABILITY.md).

One launch of 2 ranks (the ``deepspeed`` launcher, gloo) runs every scenario on the toy model.
The claims tested, with E the engine step whose data holds the bad micro-batch:

1. The run with the fault equals, step for step, the run that never saw step E's micro-batches (on
   any rank) and restarted its pipeline where step E would have begun, in the modes and halves
   where that is the spec's consequence: ``sync``, ``dpu``, and ``acco`` when the bad micro-batch is in
   the first half of the step (the g~ of the peek). The committed parameters and the Adam moments
   stay unchanged across the skipped step, and the LR schedule follows the applied steps.
2. In every scenario, including ``acco`` with the bad micro-batch in g (second half), where the
   peek before the skip already moved the point the next g~ is computed at, the run equals the
   single-process reference of docs/ALGORITHM.md's equations with a skipped update for a non-finite gradient.
3. ``overflow`` is True at exactly one engine step (``sync``: step E; ``acco``/``dpu``: step E + 1,
   when the commit launched at E has finished), ``engine.skipped_steps`` and ACCO's own count are
   1, on every rank, and every rank holds the same final parameters.
4. Adaptive accumulation: the same counts, and every micro-batch computed is committed or
   discarded (none lost).
5. With the host summaries read one job late (``defer_host_reads``, what CUDA does so the host never
   waits for the job the next round needs), the AdamW step count and LR of each job are decided on
   the device: the trajectory and moments are bit for bit those of the run that read at once, and
   the skip reaches the engine at the same step (overflow flags, skipped_steps, LR schedule); the gradient norm
   each step reports is the same at every step (the norm of the commit the step waited for, not one step late).
"""

from __future__ import annotations

import pytest
import torch

from acco_ds.core.reference import RefHyper, reference_trajectory
from tests.ranks import toy
from tests.ranks.launch import REPO, run_local

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

WORLD, STEPS, GAS, E = 2, 8, 4, 3
LR, WD, CLIP = 0.02, 0.1, 0.5
TOL = 2e-6  # fp32, summation order only


def config(
    mode: str, scheduler: bool = True, accumulation: str = "fixed", compression: dict | None = None
) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "optimizer": {
            "type": "ACCO",
            "params": {"lr": LR, "weight_decay": WD, "mode": mode, "accumulation": accumulation},
        },
        "zero_optimization": {"stage": 1},
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
    }
    if compression is not None:
        cfg["optimizer"]["params"]["compression"] = compression
    if scheduler:  # the LR changes at every step: a schedule that ignored a skip would show
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": LR / 8, "warmup_max_lr": LR, "warmup_num_steps": 3 * STEPS},
        }
    return cfg


# name: (mode, fault, scheduler); the fault is in engine step E of every scenario
FAULTS = {
    "sync": ("sync", {"rank": 1, "step": E, "micro": 2, "kind": "nan"}, True),
    "dpu": ("dpu", {"rank": 0, "step": E, "micro": 0, "kind": "inf"}, True),
    "acco_tilde": ("acco", {"rank": 1, "step": E, "micro": 1, "kind": "nan"}, True),  # first half: g~
    "acco_g": ("acco", {"rank": 0, "step": E, "micro": 3, "kind": "inf"}, False),  # second half: g
}
# compressed rounds (int8 blocks with error feedback): the non-finite value makes its block's scale non-finite,
# and the skip path is the same (claim 3)
INT8 = {"commit": "int8", "peek": "int8", "block_size": 16}
FAULTS_INT8 = {
    "sync_int8": ("sync", FAULTS["sync"][1], {**INT8, "peek": "none"}),
    "acco_tilde_int8": ("acco", FAULTS["acco_tilde"][1], INT8),
    "acco_g_int8": ("acco", FAULTS["acco_g"][1], {**INT8, "all_gather": "int8"}),
}
NEVER_SAW = ("sync", "dpu", "acco_tilde")  # claim 1 holds for these
DEFERRED = ("sync", "dpu", "acco_tilde", "acco_g")  # claim 5: the same fault with late host reads


def scenarios() -> list:
    out = []
    for name, (mode, fault, sched) in FAULTS.items():
        out.append({"name": f"{name}_fault", "steps": STEPS, "config": config(mode, sched), "fault": fault})
        if name in DEFERRED:
            out.append(
                {
                    "name": f"{name}_deferred",
                    "steps": STEPS,
                    "config": config(mode, sched),
                    "fault": fault,
                    "defer_host_reads": True,
                }
            )
        if name in NEVER_SAW:
            out.append(
                {
                    "name": f"{name}_never_saw",
                    "steps": STEPS,
                    "config": config(mode, sched),
                    "skip_steps": [E],
                    "restart_after": E - 1,
                }
            )
    for name, (mode, fault, comp) in FAULTS_INT8.items():
        out.append(
            {
                "name": f"{name}_fault",
                "steps": STEPS,
                "config": config(mode, True, compression=comp),
                "fault": fault,
            }
        )
    out.append(
        {
            "name": "adaptive_fault",
            "steps": STEPS,
            "config": config("acco", True, "adaptive"),
            "fault": {"rank": 1, "step": E, "micro": 1, "kind": "nan"},
        }
    )
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import json

    tmp = tmp_path_factory.mktemp("nonfinite")
    spec = tmp / "scenarios.json"
    spec.write_text(json.dumps(scenarios()))
    run_local(REPO / "tests" / "ranks" / "faults_worker.py", WORLD, ["--scenarios", spec, "--out", tmp])
    return torch.load(tmp / "results.pt", weights_only=False)


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", NEVER_SAW)
def test_skip_equals_run_that_never_saw_the_step(results, name):
    bad, clean = results[f"{name}_fault"], results[f"{name}_never_saw"]
    assert len(bad["traj"]) == STEPS and len(clean["traj"]) == STEPS - 1
    for key in ("traj", "exp_avg", "exp_avg_sq"):
        # before the fault: the same run
        for t in range(E):
            assert maxdiff(bad[key][t], clean[key][t]) <= TOL, (name, key, t)
        # the skipped step changed neither the parameters nor the optimizer state
        assert torch.equal(bad[key][E], bad[key][E - 1]), (name, key)
        # after it: the run that never saw step E's micro-batches, one step behind
        for t in range(E + 1, STEPS):
            d = maxdiff(bad[key][t], clean[key][t - 1])
            assert d <= TOL, f"{name} {key} step {t}: max |diff| {d:.3e} to the run that never saw step {E}"
    # training went on after the skip
    assert maxdiff(bad["traj"][-1], bad["traj"][E]) > 100 * TOL
    assert all(torch.isfinite(t).all() for t in bad["traj"])


def _lr_after(results, name: str):
    """lr after k LR-schedule steps (read from the run that never skipped), or the constant LR."""
    mode, _, sched = FAULTS[name]
    if not sched:
        return lambda k: LR
    lrs = results[f"{name}_never_saw"]["lrs"]
    return lambda k: lrs[k]


@pytest.mark.parametrize("name", list(FAULTS))
def test_matches_reference_with_skipped_update(results, name):
    mode, fault, _ = FAULTS[name]
    bad = results[f"{name}_fault"]
    base = toy.make_grad_fn(torch.float32)
    bad_index = fault["step"] * GAS + fault["micro"]

    def grad_fn(views, rank, index):
        grads = base(views, rank, index)
        if (rank, index) == (fault["rank"], bad_index):
            return [torch.full_like(g, float("nan")) for g in grads]
        return grads

    lr_after = _lr_after(results, name)
    ref = reference_trajectory(
        mode,
        [toy.flat(toy.trainable(toy.build()))],
        grad_fn,
        world_size=WORLD,
        micro_batches_per_round=GAS // 2 if mode == "acco" else GAS,
        steps=STEPS,
        # commit t follows t applied steps before E and t - 1 after the skipped one
        hypers=lambda t: [RefHyper(lr_after(t if t <= E else t - 1), (0.9, 0.999), 1e-8, WD)],
        clip=CLIP,
    )
    for t, (got, (want,)) in enumerate(zip(bad["traj"], ref)):
        d = maxdiff(got, want)
        assert d <= TOL, f"{name} step {t}: max |diff| {d:.3e} to the reference"
    assert torch.equal(ref[E][0], ref[E - 1][0])  # the oracle skipped that step too


@pytest.mark.parametrize("name", list(FAULTS) + list(FAULTS_INT8))
def test_skip_reported_counted_and_alike_on_every_rank(results, name):
    mode = FAULTS[name][0] if name in FAULTS else FAULTS_INT8[name][0]
    bad = results[f"{name}_fault"]
    when = E if mode == "sync" else E + 1  # acco/dpu: the commit launched at E finishes in the next round
    assert bad["overflow"] == [t == when for t in range(STEPS)], bad["overflow"]
    assert bad["skipped_steps"][-1] == 1 and bad["engine_skipped_steps"] == 1
    finals = [r["final_model"] for r in bad["per_rank"]]
    for r, f in enumerate(finals):
        assert torch.equal(f, finals[0]), f"rank {r} holds other parameters than rank 0"
        stats = bad["per_rank"][r]["stats"]
        assert stats["skipped_steps"] == 1, stats
        assert stats["skipped_peeks"] == (1 if name.startswith("acco_tilde") else 0), stats
        assert stats["applied_steps"] == STEPS - 1
    # the skipped commit's micro-batches are discarded, not committed
    stats = bad["stats"]
    computed = sum(r["stats"]["micro_batches_local"] for r in bad["per_rank"])
    assert computed == stats["micro_batches_committed"] + stats["micro_batches_discarded"]
    assert stats["micro_batches_discarded"] >= WORLD * GAS


def test_adaptive_skip(results):
    bad = results["adaptive_fault"]
    assert sum(bad["overflow"]) == 1 and bad["engine_skipped_steps"] == 1
    per_rank = bad["per_rank"]
    for r in per_rank:
        assert r["stats"]["skipped_steps"] == 1
        assert torch.equal(r["final_model"], per_rank[0]["final_model"])
    assert torch.isfinite(per_rank[0]["final_model"]).all()
    assert maxdiff(bad["traj"][-1], bad["traj"][E + 1]) > 100 * TOL  # went on after the skip
    stats = bad["stats"]
    computed = sum(r["stats"]["micro_batches_local"] for r in per_rank)
    assert computed == stats["micro_batches_committed"] + stats["micro_batches_discarded"]


@pytest.mark.parametrize("name", DEFERRED)
def test_late_host_reads_change_nothing_of_the_math(results, name):
    late, now = results[f"{name}_deferred"], results[f"{name}_fault"]
    for key in ("traj", "exp_avg", "exp_avg_sq"):
        for t, (a, b) in enumerate(zip(late[key], now[key])):
            assert torch.equal(a, b), f"{name} {key} step {t}: late host reads changed the result"
    assert torch.equal(late["final_model"], now["final_model"])
    # the skip reaches the engine at the step that swapped its commit in, as when every summary is read at once:
    # the same overflow flags, skipped_steps and LR schedule at every step
    assert late["overflow"] == now["overflow"], (late["overflow"], now["overflow"])
    assert late["skipped_steps"] == now["skipped_steps"], (late["skipped_steps"], now["skipped_steps"])
    assert late["lrs"] == now["lrs"]
    # the reported norm is not late: each step reports the norm of the commit it waited for (inf/NaN when skipped)
    assert [repr(n) for n in late["norms"]] == [repr(n) for n in now["norms"]]  # repr: a NaN equals a NaN
    if name == "sync":  # sync reports its own commit's norm at every step
        assert None not in late["norms"]
    else:  # acco/dpu: the commit launched at step t finishes during step t + 1
        assert late["norms"][0] is None and None not in late["norms"][1:]
    assert sum(late["overflow"]) == 1 and late["engine_skipped_steps"] == 1
    for key in ("skipped_steps", "micro_batches_committed", "micro_batches_discarded", "applied_steps"):
        assert late["stats"][key] == now["stats"][key], key
