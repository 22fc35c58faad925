"""fp16 with dynamic loss scaling (docs/ALGORITHM.md, "fp16: loss scaling") on real DeepSpeed engines, ranks started
as the deepspeed launcher starts them (W = 1, 2, 3): every mode, with and without clipping, against the
single-process reference with DeepSpeed's scaler rule (``reference_run(loss_scale=...)``), with overflows planted at
chosen micro-batches (a loss times inf on one rank: every rank must skip), in a g~ round and in a g round of acco,
two in a row (the hysteresis) and a grown scale; and ``sync`` against DeepSpeed's own ZeRO-1 fp16 step by step,
with the planted overflows and with the natural overflows of a scale of 2**16.

Compared at every step: the committed parameters, both Adam moments, the reported gradient norm, the loss scale and
the engine's skipped_steps; the final parameters are the same on every rank. A skipped step advances neither the LR
schedule nor Adam's step count: the reference's commit t takes the schedule after the commits applied before it.
"""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch
from deepspeed.runtime.lr_schedules import WarmupLR

from acco_ds.core.loss_scale import LossScaleSpec
from acco_ds.core.reference import RefCompression, RefHyper, reference_run
from tests.core.test_trajectories import max_rel
from tests.ranks import toy
from tests.ranks.launch import run_scenarios

pytestmark = pytest.mark.launcher

STEPS, GAS, LR, WD = 10, 4, 0.02, 0.1
MODES = ("sync", "dpu", "acco")
CLIPS = {"noclip": 0.0, "clip": 0.5}
WARMUP = {"warmup_min_lr": LR / 4, "warmup_max_lr": LR, "warmup_num_steps": 4}
# a scale far from the toy's natural overflows, growing every 2 good steps, hysteresis 2
FP16 = {
    "enabled": True,
    "initial_scale_power": 8,
    "loss_scale_window": 2,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
SPEC = LossScaleSpec(True, 2.0**8, window=2, hysteresis=2, min_scale=1.0)


# (rank, micro-batch index): after the scale grew (steps 2 and 3), step 4 in its first half (acco: the g~ round),
# step 5 in its second half (the g round) on the last rank (two in a row: the hysteresis runs out, the scale halves),
# step 8 in its second half
def poison(world: int, whole: bool = False) -> list:
    """``whole``: every poison on the whole loss (the linear model has one parameter)."""
    return [[0, 4 * GAS + 0], [world - 1, 5 * GAS + 3], [0, 8 * GAS + 2] + ([] if whole else [ONE_SHARD])]


# an overflow in one parameter only: the last trainable one, which lies in the last rank's shard (at W > 1 only that
# rank's reduced shard is non-finite, yet every rank must skip)
ONE_SHARD = "fc2.bias"


# Master weights: the model computes in fp16, the reference in fp32 at the fp16-rounded parameters.
TOL, MOMENT_TOL, NORM_TOL = 2e-3, 2e-2, 1e-2
# the linear loss's exact gradients: the fused AdamW against torch's, in fp32; acco's commit also adds its g~ to its g
# in fp16 (the communication dtype), the reference in fp64. A residual left in another round's scale moves the
# parameters by 1.6e-4 to 1.9e-4 and exp_avg by 3e-3 relative here (measured with that bug planted).
EXACT = {"dpu": (2e-6, 1e-5, 1e-5), "acco": (5e-5, 1e-3, 1e-3)}
# natural overflows: DeepSpeed's default power 16 overflows the toy's first steps
NATURAL = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 3}


def ds_config(optimizer: dict, clip: str, fp16: dict = FP16) -> dict:
    return {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "optimizer": optimizer,
        "scheduler": {"type": "WarmupLR", "params": WARMUP},
        "zero_optimization": {"stage": 1},
        "gradient_clipping": CLIPS[clip],
        "fp16": fp16,
        "steps_per_print": 10**9,
    }


def acco(mode: str) -> dict:
    return {"type": "ACCO", "params": {"lr": LR, "weight_decay": WD, "mode": mode}}


ZERO1 = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}


# compressed rounds (int8 with error feedback; the residual follows the scale): name -> (mode, compression)
COMPRESSED = {
    "acco_int8": ("acco", {"commit": "int8", "peek": "int8", "block_size": 16}),
    "dpu_int8": ("dpu", {"commit": "int8", "block_size": 7}),
    # compressed peeks, an uncompressed commit: the kept g~ (not predivided) joins a predivided commit
    "acco_int8_peek_only": ("acco", {"commit": "none", "peek": "int8", "block_size": 16}),
    # the round's job quantizes (the fused round end's twin)
    "acco_int8_unfused": (
        "acco",
        {"commit": "int8", "peek": "int8", "block_size": 16, "fuse_round_end": False},
    ),
}


def scenarios(world: int) -> list:
    out = [
        {"name": f"{m}_{c}", "steps": STEPS, "config": ds_config(acco(m), c), "poison": poison(world)}
        for m in MODES
        for c in CLIPS
    ]
    for name, (m, comp) in COMPRESSED.items():
        opt = acco(m)
        opt["params"]["compression"] = comp
        config = ds_config(opt, "noclip")
        out.append(
            {"name": name, "steps": STEPS, "config": config, "poison": poison(world, True), "model": "linear"}
        )
    adaptive = acco("acco")
    adaptive["params"]["accumulation"] = "adaptive"
    out.append(
        {
            "name": "acco_adaptive",
            "steps": STEPS,
            "config": ds_config(adaptive, "clip"),
            "poison": poison(world),
        }
    )
    if world == 2:
        # the host summaries read one job late, as on CUDA (``defer_host_reads``): the same run, skips reported at
        # the same steps
        out += [
            {
                "name": f"{m}_noclip_deferred",
                "steps": STEPS,
                "config": ds_config(acco(m), "noclip"),
                "poison": poison(world),
                "defer_host_reads": True,
            }
            for m in MODES
        ]
        out += [
            {"name": f"zero1_{c}", "steps": STEPS, "config": ds_config(ZERO1, c), "poison": poison(world)}
            for c in CLIPS
        ]
        out += [
            {"name": f"{m}_natural", "steps": STEPS, "config": ds_config(opt, "clip", NATURAL)}
            for m, opt in (("sync", acco("sync")), ("zero1", ZERO1))
        ]
    return out


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"W{w}")
def run(request, tmp_path_factory):
    world = request.param
    return world, run_scenarios(world, scenarios(world), tmp_path_factory.mktemp(f"fp16_w{world}"))


@cache
def lr_after(k: int) -> float:
    """The WarmupLR schedule's lr after k scheduler steps."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = WarmupLR(opt, **WARMUP)
    for _ in range(k):
        sched.step()
    return float(opt.param_groups[0]["lr"])


@cache
def reference(mode: str, world: int, clip: str, compression: RefCompression | None = None):
    linear = compression is not None
    if linear:  # exact gradients: the compressed rounds compare to fp32 rounding
        theta0, base = torch.zeros(toy.LINEAR_DIM), toy.linear_grad_fn
    else:
        theta0, base = toy.flat(toy.trainable(toy.build().to(torch.float16))), toy.make_grad_fn(torch.float32)
    planted = {tuple(p[:2]): (p[2] if len(p) == 3 else None) for p in poison(world, whole=linear)}
    names = [n for n, p in toy.build().named_parameters() if p.requires_grad]
    sizes = [p.numel() for p in toy.trainable(toy.build())]

    def grad_fn(views, rank, index):
        grads = base(views, rank, index)
        if (rank, index) not in planted:
            return grads
        name = planted[(rank, index)]
        if name is None:
            return [torch.full_like(g, math.inf) for g in grads]
        (g,) = grads
        start = sum(sizes[: names.index(name)])
        g = g.clone()
        g[start : start + sizes[names.index(name)]] = math.inf
        return [g]

    return reference_run(
        mode,
        [theta0],
        grad_fn,
        world_size=world,
        micro_batches_per_round=GAS // 2 if mode == "acco" else GAS,
        steps=STEPS,
        hypers=lambda a: [RefHyper(lr_after(a), (0.9, 0.999), 1e-8, WD)],
        clip=CLIPS[clip],
        compute_dtype=torch.float16,
        loss_scale=SPEC,
        compression=compression,
    )


def ref_compression(spec: dict) -> RefCompression:
    return RefCompression(
        commit=spec.get("commit", "none") != "none",
        peek=spec.get("peek", "none") != "none",
        block_size=spec["block_size"],
        error_feedback=True,
        comm_dtype=torch.float16,
        gas=GAS,
    )


def same_norm(got: float, want: float, rel: float) -> bool:
    if not math.isfinite(want):
        return not math.isfinite(got)
    return got == pytest.approx(want, rel=rel)


def test_reference_plants_skips_and_moves_the_scale():
    """The planted overflows skip steps in every mode, the scale both grows and halves: a run that ignored the
    overflows or never updated its scale could not match."""
    for mode in MODES:
        ref = reference(mode, 2, "noclip")
        assert sum(ref.skipped) >= 3, (mode, ref.skipped)
        assert max(ref.scales) > SPEC.init_scale and min(ref.scales) < max(ref.scales), (mode, ref.scales)


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference(run, mode, clip):
    world, results = run
    assert_matches(results[f"{mode}_{clip}"], reference(mode, world, clip), mode, f"{mode}/{clip} W={world}")


@pytest.mark.parametrize("mode", MODES)
def test_deferred_host_reads_match_reference(run, mode):
    """With each job's host summary read one job late (what the pipeline does on CUDA), every step still reports
    what the reference says: the loss scale, the engine's skipped_steps (sync at the step that overflowed, as
    ZeRO-1), the norms, parameters and moments; and the run is the one that read every summary at once."""
    world, results = run
    if world != 2:
        pytest.skip("the deferred runs are in the W=2 launch")
    late, now = results[f"{mode}_noclip_deferred"], results[f"{mode}_noclip"]
    assert_matches(late, reference(mode, world, "noclip"), mode, f"{mode}/noclip deferred W={world}")
    assert late["skipped"] == now["skipped"] and late["scales"] == now["scales"] and late["lrs"] == now["lrs"]
    for t, (a, b) in enumerate(zip(late["traj"], now["traj"])):
        assert torch.equal(a, b), f"{mode} step {t + 1}: deferred host reads changed the parameters"


@pytest.mark.parametrize("name", COMPRESSED)
def test_compressed_matches_reference(run, name):
    """Compressed rounds under a moving scale, on the linear loss (gradients exact in fp16, times any scale): the
    quantization of a scaled round is the scaled quantization of the unscaled one, and the error-feedback residual
    is re-expressed in each round's scale, so the run follows the compressed reference (which quantizes the
    unscaled gradients) to fp32 rounding; a residual left in another round's scale would be off by a quantization
    error, orders of magnitude more."""
    world, results = run
    mode, comp = COMPRESSED[name]
    ref = reference(mode, world, "noclip", ref_compression(comp))
    assert_matches(results[name], ref, mode, f"{name} W={world}", tol=EXACT[mode])


def test_adaptive_ranks_agree(run):
    """Adaptive accumulation: the ranks end rounds at different micro-batches, yet every rank computes each round
    under the same scale and skips the same commits (the state changes only at swap-ins of the same jobs)."""
    world, results = run
    res = results["acco_adaptive"]
    finals = res["final_model_per_rank"]
    assert all(torch.equal(f, finals[0]) for f in finals), "the ranks ended with different parameters"
    skips = {s["skipped_steps"] for s in res["stats_per_rank"]}
    assert len(skips) == 1 and skips.pop() >= 2, res["stats_per_rank"]
    assert (res["traj"][-1] - res["traj"][0]).abs().max() > 2 * TOL


def assert_matches(res: dict, ref, mode: str, where: str, tol=None) -> None:
    param_tol, moment_tol, norm_tol = tol or (TOL, MOMENT_TOL, NORM_TOL)
    assert len(res["traj"]) == STEPS
    for t, (got, (want,)) in enumerate(zip(res["traj"], ref.params)):
        diff = (got - want).abs().max().item()
        assert diff <= param_tol, f"{where} step {t + 1}: parameters max |diff| {diff:.3e} > {param_tol}"
    for key in ("exp_avg", "exp_avg_sq"):
        for t, (got, (want,)) in enumerate(zip(res["moments"][key], getattr(ref, key))):
            if want.abs().max() == 0:  # nothing applied yet (the first steps skipped)
                assert got.abs().max() == 0, f"{where} step {t + 1}: {key} moved before any applied step"
                continue
            rel = max_rel(got, want)
            assert rel <= moment_tol, f"{where} step {t + 1}: {key} max rel diff {rel:.3e}"
    # what the engine saw at step t: sync its own commit; acco/dpu the commit before (the last one at finish)
    lag = 0 if mode == "sync" else 1
    scales = ([SPEC.init_scale] * lag + ref.scales)[:STEPS]
    assert res["scales"] == scales, f"{where}: loss scale per step {res['scales']} vs {scales}"
    assert res["final_scale"] == ref.scales[-1]
    skipped = [sum(ref.skipped[: t + 1 - lag]) for t in range(STEPS)]
    assert res["skipped"] == skipped, f"{where}: skipped_steps per step {res['skipped']} vs {skipped}"
    norms = res["norms"] if mode == "sync" else res["norms"][1:] + [res["final_norm"]]
    for t, (got, want) in enumerate(zip(norms, ref.norms)):
        assert same_norm(got, want, norm_tol), f"{where} commit {t + 1}: grad norm {got} vs {want}"
    stats = res["stats"]
    assert stats["skipped_steps"] == sum(ref.skipped)
    finals = res["final_model_per_rank"]
    assert all(torch.equal(f, finals[0]) for f in finals), "the ranks ended with different parameters"


@pytest.mark.parametrize("name", ["noclip", "clip", "natural"])
def test_sync_is_deepspeed_zero1_fp16(run, name):
    world, results = run
    if world != 2:
        pytest.skip("the ZeRO-1 baseline runs in the W=2 launch")
    ours, theirs = results[f"sync_{name}"], results[f"zero1_{name}"]
    assert ours["skipped"] == theirs["skipped"], "skipped steps differ"
    assert ours["scales"] == theirs["scales"], "loss scales differ"
    assert ours["lrs"] == theirs["lrs"], "the LR schedules differ"
    assert theirs["skipped"][-1] >= 2, "no step was skipped: the comparison proves nothing about overflows"
    for t, (a, b) in enumerate(zip(ours["traj"], theirs["traj"])):
        diff = (a - b).abs().max().item()
        assert diff <= TOL, f"sync vs ZeRO-1 fp16 {name} step {t + 1}: max |diff| {diff:.3e}"
    for t, (a, b) in enumerate(zip(ours["norms"], theirs["norms"])):
        assert same_norm(a, b, 1e-2), f"grad norm step {t + 1}: {a} vs {b}"
    for key in ("exp_avg", "exp_avg_sq"):
        for t, (a, b) in enumerate(zip(ours["moments"][key], theirs["moments"][key])):
            if b.abs().max() == 0:
                assert a.abs().max() == 0
                continue
            assert max_rel(a, b) <= MOMENT_TOL, f"{key} step {t + 1}: max rel diff {max_rel(a, b):.3e}"
