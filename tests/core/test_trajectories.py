"""docs/ALGORITHM.md properties 1-4 on real DeepSpeed engines, ranks started as the deepspeed launcher starts them:
sync/dpu/acco trajectories equal the single-process reference (W = 1, 2, 3; fp32 and bf16; tied
weights, a frozen parameter, a parameter count divisible by neither 2 nor 3; an LR warm-up), with
gradient clipping off and with clipping that acts at every step; sync equals DeepSpeed's own ZeRO-1;
acco step 1 equals sync step 1; the optimizer state per rank is 1/W of the full state plus padding.
Compressed rounds (optimizer.params.compression: int8 blocks with error feedback, docs/ALGORITHM.md
"Compressed rounds") ride in the same launches: every mode, fp32 and bf16, against the reference with the
same quantizer and per-rank residuals; the replicas stay bitwise identical; stats() counts the bytes.

Every step compares the parameters, BOTH Adam moments and the reported global gradient norm. The
parameters alone cannot see a wrong gradient scale: AdamW is nearly invariant to a constant factor
on the gradient, and clipping erases it. The moments and the norm carry the scale."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from acco_ds.core.buffers import GroupLayout, padded_numel
from acco_ds.core.reference import (
    RefCompression,
    RefHyper,
    RefRun,
    RefState,
    _Adam,
    _avg,
    _Exchange,
    reference_run,
)
from acco_ds.ops.quantize import num_blocks, quantize
from tests.ranks import toy
from tests.ranks.launch import run_scenarios

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

STEPS, GAS, LR, WD = 10, 4, 0.02, 0.1
MODES = ("sync", "dpu", "acco")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Parameter and communication dtypes that differ: the buffers then keep parameters and gradients apart
# and fold each .grad into the gradient buffer with a hook (core.buffers). name -> (model dtype,
# optimizer.params.comm_dtype, the tolerances of); run with clipping acting.
MIXED = {"bf16p_fp32c": ("bf16", "fp32"), "fp32p_bf16c": ("fp32", "bf16")}
# "clip" acts at every step (the toy's averaged gradient norms are 1.3 to 3); "noclip" sets
# gradient_clipping 0 explicitly (DeepSpeed's default is 1.0, which would clip).
CLIPS = {"noclip": 0.0, "clip": 0.5}
# Max abs difference to the reference allowed on the fp32 master weights after every step.
# fp32: summation order only. bf16: the model computes (and ACCO accumulates) in bf16, the reference
# sums the same bf16 micro-batch gradients in fp64: Adam-normalised updates of size ~lr differ.
TOL = {"fp32": 2e-6, "bf16": 2e-3}
# Moments: max abs difference relative to the largest reference value of that moment at that step.
MOMENT_TOL = {"fp32": 1e-5, "bf16": 2e-2}
# Gradient norm: relative difference.
NORM_TOL = {"fp32": 1e-5, "bf16": 1e-2}


def name_of(mode: str, dtype: str, clip: str) -> str:
    return f"{mode}_{dtype}_{clip}"


def model_dtype(precision: str) -> str:
    return MIXED[precision][0] if precision in MIXED else precision


def tol_class(precision: str) -> str:
    """Tolerances: fp32 only when parameters and gradients are both fp32."""
    return "bf16" if precision in MIXED else precision


def ds_config(optimizer: dict, dtype: str, clip: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "optimizer": optimizer,
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": LR / 4, "warmup_max_lr": LR, "warmup_num_steps": 4},
        },
        "zero_optimization": {"stage": 1},
        "gradient_clipping": CLIPS[clip],
        "bf16": {"enabled": model_dtype(dtype) == "bf16"},
        "steps_per_print": 10**9,
    }


def acco_opt(mode: str, comm_dtype: str = "auto") -> dict:
    return {"type": "ACCO", "params": {"lr": LR, "weight_decay": WD, "mode": mode, "comm_dtype": comm_dtype}}


# Compressed rounds: name -> (mode, precision, optimizer.params.compression); gradient clipping off, so
# that what the exchange loses reaches the moments. Blocks much smaller than a shard (the toy's shards are
# 80 to 240 elements), block sizes that divide it and that do not (short blocks).
COMPRESSED = {
    f"{m}_{d}_int8": (m, d, {"commit": "int8", "peek": "int8" if m == "acco" else "none", "block_size": b})
    for m, b in (("acco", 16), ("dpu", 7), ("sync", 16))
    for d in DTYPES
}
COMPRESSED["acco_fp32_int8_commit_only_no_ef"] = (
    "acco",
    "fp32",
    {"commit": "int8", "peek": "none", "block_size": 32, "error_feedback": False},
)
# compressed peeks, exact commits: the commit sends what the peeks withheld (no quantization error is committed)
COMPRESSED["acco_fp32_int8_peek_only"] = (
    "acco",
    "fp32",
    {"commit": "none", "peek": "int8", "block_size": 16},
)
# the parameter all-gather as int8 differences to the replicas: with and without the gradients compressed
COMPRESSED["acco_bf16_int8_all_gather"] = (
    "acco",
    "bf16",
    {"commit": "int8", "peek": "int8", "all_gather": "int8", "block_size": 16},
)
# four bits where the estimate and the parameter differences tolerate it (two values per byte on the wire)
COMPRESSED["acco_fp32_int4_peek_and_all_gather"] = (
    "acco",
    "fp32",
    {"commit": "int8", "peek": "int4", "all_gather": "int4", "block_size": 16},
)
COMPRESSED["dpu_fp32_all_gather_only"] = (
    "dpu",
    "fp32",
    {"commit": "none", "all_gather": "int8", "block_size": 7},
)
COMPRESSED["sync_fp32_int8_all_gather"] = (
    "sync",
    "fp32",
    {"commit": "int8", "all_gather": "int8", "block_size": 16},
)
# The collective form of the compressed exchanges (NCCL's: all-to-all / all-gather of the values and the
# scales) run on gloo: the same bits as the point-to-point form the twin took (compressed_comm.point_to_point)
COLLECTIVE_TWINS = {
    "acco_fp32_int8_collective": "acco_fp32_int8",
    "acco_fp32_int4_peek_and_all_gather_collective": "acco_fp32_int4_peek_and_all_gather",
}
# The uncompressed rounds' collective form (NCCL's: reduce_scatter_single into this rank's slice of the buffer,
# all_gather_single in place; round_job.collectives) run on gloo, every mode, fp32 and bf16, clipping acting
UNCOMPRESSED_COLLECTIVE_TWINS = {
    f"{name_of(m, d, 'clip')}_collective": name_of(m, d, "clip") for m in MODES for d in DTYPES
}
# The owner's sum of the quantized chunks stored once (round_job.UNSTORED_SUM_MAX_WORLD, as from W = 4 on) rather
# than read by the norm's and the step's passes: the same bits but the norm's fp64 order (clipping is off)
STORED_SUM_TWINS = {
    "acco_bf16_int8_stored_sum": "acco_bf16_int8",
    "acco_bf16_int8_all_gather_stored_sum": "acco_bf16_int8_all_gather",
    "dpu_fp32_int8_stored_sum": "dpu_fp32_int8",
}
# The round's job quantizing its gradients (compression.fuse_round_end=false) rather than its last backward's
# gradient hooks (core.fused_round_end, what the runs above do): the same bits
UNFUSED_TWINS = {
    "acco_bf16_int8_unfused": "acco_bf16_int8",
    "dpu_fp32_int8_unfused": "dpu_fp32_int8",
    "acco_fp32_int4_peek_and_all_gather_unfused": "acco_fp32_int4_peek_and_all_gather",
    "acco_fp32_int8_peek_only_unfused": "acco_fp32_int8_peek_only",
}
# acco's estimate a longer step ahead (optimizer.params.peek_lr_scale): the peeks' LR times the factor, the commits'
# as scheduled; clipping acting, so the peek's clip coefficient is the one that scales with it
PEEK_LR = {f"acco_{d}_clip_peek_lr_x1.5": (d, 1.5) for d in DTYPES}
LONG_STEPS = 40  # the replicas after many compressed steps
LONG = (
    "acco_bf16_int8_long",
    "acco",
    "bf16",
    {"commit": "int8", "peek": "int8", "all_gather": "int8", "block_size": 16},
)


def ref_compression(spec: dict, precision: str) -> RefCompression:
    return RefCompression(
        commit=spec.get("commit", "none") != "none",
        peek=spec.get("peek", "none") != "none",
        block_size=spec["block_size"],
        # residuals exist where a gradient exchange is compressed
        error_feedback=spec.get("error_feedback", True)
        and spec.get("commit", "none") + spec.get("peek", "none") != "nonenone",
        comm_dtype=DTYPES[precision],
        gas=GAS,
        all_gather=spec.get("all_gather", "none") != "none",
        commit_bits=4 if spec.get("commit") == "int4" else 8,
        peek_bits=4 if spec.get("peek") == "int4" else 8,
        all_gather_bits=4 if spec.get("all_gather") == "int4" else 8,
    )


def scenarios(world: int) -> list:
    out = [
        {"name": name_of(m, d, c), "steps": STEPS, "config": ds_config(acco_opt(m), d, c)}
        for m in MODES
        for d in DTYPES
        for c in CLIPS
    ]
    out += [
        {
            "name": name_of(m, p, "clip"),
            "steps": STEPS,
            "config": ds_config(acco_opt(m, MIXED[p][1]), p, "clip"),
        }
        for m in MODES
        for p in MIXED
    ]
    for name, (m, d, comp) in COMPRESSED.items():
        opt = acco_opt(m)
        opt["params"]["compression"] = comp
        out.append({"name": name, "steps": STEPS, "config": ds_config(opt, d, "noclip")})
    for name, twin in COLLECTIVE_TWINS.items():
        m, d, comp = COMPRESSED[twin]
        opt = acco_opt(m)
        opt["params"]["compression"] = comp
        config = ds_config(opt, d, "noclip")
        out.append({"name": name, "steps": STEPS, "config": config, "collective_exchange": True})
    for name, twin in UNCOMPRESSED_COLLECTIVE_TWINS.items():
        m, d = twin.split("_")[:2]
        out.append(
            {
                "name": name,
                "steps": STEPS,
                "config": ds_config(acco_opt(m), d, "clip"),
                "collective_exchange": True,
            }
        )
    for name, twin in STORED_SUM_TWINS.items():
        m, d, comp = COMPRESSED[twin]
        opt = acco_opt(m)
        opt["params"]["compression"] = comp
        out.append({"name": name, "steps": STEPS, "config": ds_config(opt, d, "noclip"), "stored_sum": True})
    for name, twin in UNFUSED_TWINS.items():
        m, d, comp = COMPRESSED[twin]
        opt = acco_opt(m)
        opt["params"]["compression"] = {**comp, "fuse_round_end": False}
        out.append({"name": name, "steps": STEPS, "config": ds_config(opt, d, "noclip")})
    for name, (d, scale) in PEEK_LR.items():
        opt = acco_opt("acco")
        opt["params"]["peek_lr_scale"] = scale
        out.append({"name": name, "steps": STEPS, "config": ds_config(opt, d, "clip")})
    name, m, d, comp = LONG
    opt = acco_opt(m)
    opt["params"]["compression"] = comp
    out.append({"name": name, "steps": LONG_STEPS, "config": ds_config(opt, d, "noclip")})
    if world == 2:
        zero1 = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}
        out += [
            {"name": name_of("zero1", d, c), "steps": STEPS, "config": ds_config(zero1, d, c)}
            for d in DTYPES
            for c in CLIPS
        ]
    return out


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"W{w}")
def run(request, tmp_path_factory):
    world = request.param
    return world, run_scenarios(world, scenarios(world), tmp_path_factory.mktemp(f"traj_w{world}"))


@cache
def reference(
    mode: str,
    dtype: str,
    world: int,
    clip: str,
    lrs: tuple,
    compression: RefCompression | None = None,
    peek_lr_scale: float = 1.0,
) -> RefRun:
    compute = DTYPES[model_dtype(dtype)]
    theta0 = toy.flat(toy.trainable(toy.build().to(compute)))
    return reference_run(
        mode,
        [theta0],
        toy.make_grad_fn(compute),
        world_size=world,
        micro_batches_per_round=GAS // 2 if mode == "acco" else GAS,
        steps=STEPS,
        hypers=lambda t: [RefHyper(lrs[t], (0.9, 0.999), 1e-8, WD)],
        clip=CLIPS[clip],
        compute_dtype=compute,
        compression=compression,
        peek_lr_scale=peek_lr_scale,
    )


def test_modes_are_distinguishable():
    """The three modes' reference trajectories differ by far more than the tolerance, so a mode
    that ran the wrong equations could not pass test_matches_reference."""
    lrs = (LR,) * STEPS
    final = {m: reference(m, "fp32", 2, "clip", lrs).params[-1][0] for m in MODES}
    for a in MODES:
        for b in MODES:
            if a < b:
                assert (final[a] - final[b]).abs().max() > 100 * TOL["fp32"], (a, b)


def test_clip_settings_do_what_they_say():
    """ "clip" acts at every step of every mode, "noclip" never rescales (so a wrong gradient scale
    reaches the moments)."""
    lrs = (LR,) * STEPS
    for mode in MODES:
        norms = reference(mode, "fp32", 2, "clip", lrs).norms
        assert min(norms) > 2 * CLIPS["clip"], (mode, norms)


def test_param_count_is_odd():
    n = toy.flat(toy.trainable(toy.build())).numel()
    assert n % 2 and n % 3, n


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| relative to max |want|."""
    scale = want.abs().max().item()
    assert scale > 0, "the reference moment is all zeros: nothing to compare"
    return (got - want).abs().max().item() / scale


def reported_norms(res: dict, mode: str) -> list:
    """The gradient norm of commit t as the run reported it: ``get_global_grad_norm()`` at step t in
    sync; at step t + 1 in acco/dpu (the commit launched at a boundary is still on the comm side),
    and for the last commit the norm ``finish()`` applied."""
    norms = res["norms"]
    if mode == "sync":
        return norms
    assert norms[0] is None, f"{mode}: step 1 reported a norm {norms[0]} before any commit finished"
    return norms[1:] + [res["final_norm"]]


def assert_matches_reference(
    res: dict,
    mode: str,
    dtype: str,
    world: int,
    clip: str,
    tol: float,
    moment_tol: float,
    norm_tol: float,
    compression: RefCompression | None = None,
    peek_lr_scale: float = 1.0,
) -> None:
    """Every step of the run is within tolerance of the reference: parameters (max abs ``tol``), both
    Adam moments (max abs relative to the moment's scale, ``moment_tol``) and the reported global
    gradient norm (relative, ``norm_tol``)."""
    ref = reference(mode, dtype, world, clip, tuple(res["lrs"]), compression, peek_lr_scale)
    where = f"{mode}/{dtype}/{clip} W={world}" + ("" if compression is None else f" {compression}")
    assert len(res["traj"]) == STEPS
    for t, (got, (want,)) in enumerate(zip(res["traj"], ref.params)):
        diff = (got - want).abs().max().item()
        assert diff <= tol, f"{where} step {t + 1}: parameters max |diff| {diff:.3e} > {tol}"
    for key in ("exp_avg", "exp_avg_sq"):
        for t, (got, (want,)) in enumerate(zip(res["moments"][key], getattr(ref, key))):
            rel = max_rel(got, want)
            assert rel <= moment_tol, f"{where} step {t + 1}: {key} max rel diff {rel:.3e} > {moment_tol}"
    for t, (got, want) in enumerate(zip(reported_norms(res, mode), ref.norms)):
        assert got == pytest.approx(want, rel=norm_tol), f"{where} commit {t + 1}: grad norm {got} vs {want}"


PRECISION_CLIPS = [(d, c) for d in DTYPES for c in CLIPS] + [(p, "clip") for p in MIXED]


@pytest.mark.parametrize(("dtype", "clip"), PRECISION_CLIPS, ids=[f"{d}-{c}" for d, c in PRECISION_CLIPS])
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference(run, mode, dtype, clip):
    world, results = run
    res = results[name_of(mode, dtype, clip)]
    t = tol_class(dtype)
    assert_matches_reference(res, mode, dtype, world, clip, TOL[t], MOMENT_TOL[t], NORM_TOL[t])
    # the run moved: a comparison of two frozen trajectories would prove nothing
    assert (res["traj"][-1] - res["traj"][0]).abs().max() > 10 * TOL[t]


@pytest.mark.parametrize("name", PEEK_LR)
def test_peek_lr_scale_matches_reference(run, name):
    """peek_lr_scale: every step equals the reference whose peeks step with the scaled LR, and the run is not acco's
    (the factor reached the peeks: the estimates, hence the g~ halves and the commits, moved)."""
    world, results = run
    dtype, scale = PEEK_LR[name]
    res, t = results[name], tol_class(dtype)
    assert_matches_reference(
        res, "acco", dtype, world, "clip", TOL[t], MOMENT_TOL[t], NORM_TOL[t], None, scale
    )
    plain = results[name_of("acco", dtype, "clip")]
    moved = max((a - b).abs().max().item() for a, b in zip(res["traj"], plain["traj"]))
    assert moved > 3 * TOL[t], f"{name}: within {moved:.2e} of acco's run: the factor did not reach the peeks"


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sync_matches_deepspeed_zero1(run, dtype, clip):
    world, results = run
    if world != 2:
        pytest.skip("the ZeRO-1 baseline runs in the W=2 launch")
    ours, theirs = results[name_of("sync", dtype, clip)], results[name_of("zero1", dtype, clip)]
    # safe_get_full_optimizer_state returns the same Adam moments as DeepSpeed's ZeRO-1 at every step;
    # in bf16 the gradients differ by up to one bf16 ulp (acco_ds sums the ranks' bf16 gradients in fp32),
    # so exp_avg by 2**-8 relative and exp_avg_sq (of g * g) by twice that
    rels = (
        {"exp_avg": 2**-8, "exp_avg_sq": 2**-7} if dtype == "bf16" else {"exp_avg": 1e-4, "exp_avg_sq": 1e-4}
    )
    assert_sync_matches_zero1(ours, theirs, dtype, rels, f"sync vs ZeRO-1 {dtype}/{clip}")


def assert_sync_matches_zero1(ours: dict, theirs: dict, dtype: str, moment_rels: dict, what: str) -> None:
    """``ours`` (acco_ds sync) against ``theirs`` (DeepSpeed ZeRO-1) step by step: the LR schedule, the fp32
    parameters within TOL[dtype], the gradient norm, and each Adam moment within ``moment_rels[key]`` relative."""
    assert ours["lrs"] == theirs["lrs"]
    for t, (a, b) in enumerate(zip(ours["traj"], theirs["traj"])):
        diff = (a - b).abs().max().item()
        assert diff <= TOL[dtype], f"{what} step {t + 1}: max |diff| {diff:.3e}"
    for t, (a, b) in enumerate(zip(ours["norms"], theirs["norms"])):
        assert a == pytest.approx(b, rel=1e-3 if dtype == "bf16" else 1e-5), f"grad norm step {t + 1}"
    for key, rel in moment_rels.items():
        for t, (a, b) in enumerate(zip(ours["moments"][key], theirs["moments"][key])):
            assert max_rel(a, b) <= rel, f"{key} step {t + 1}: max rel diff {max_rel(a, b):.3e} > {rel:.3e}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_acco_step1_equals_sync_step1(run, dtype):
    _, results = run
    for clip in CLIPS:
        a = results[name_of("acco", dtype, clip)]["traj"][0]
        s = results[name_of("sync", dtype, clip)]["traj"][0]
        assert (a - s).abs().max().item() <= TOL[dtype], clip


def test_state_is_sharded(run):
    world, results = run
    n = toy.flat(toy.trainable(toy.build())).numel()
    layout = GroupLayout.build(toy.trainable(toy.build()), world)
    for name, res in results.items():
        if "state_numel" not in res:
            continue
        assert res["state_numel"] == 3 * layout.shard_numel, name
        assert layout.shard_numel * world == layout.padded_numel
        assert layout.padded_numel - n < world * 16  # padding only to the alignment
        for shapes in res["state_shapes"]:
            assert all(s == (layout.shard_numel,) for s in shapes), shapes


def test_acco_model_holds_estimate_at_boundary(run):
    _, results = run
    assert results[name_of("acco", "fp32", "clip")]["model_holds_at_boundary"] == "estimate"
    assert results[name_of("sync", "fp32", "clip")]["model_holds_at_boundary"] == "theta"


def test_finish_loads_committed_parameters(run):
    _, results = run
    for mode in MODES:
        for clip in CLIPS:
            res = results[name_of(mode, "fp32", clip)]
            assert torch.equal(res["final_model"], res["traj"][-1]), (mode, clip)


# -- compressed rounds (docs/ALGORITHM.md, "Compressed rounds") --------------------------------------------
@cache
def toy_grad_fn(dtype: str):
    return toy.make_grad_fn(DTYPES[dtype])


def replay_step(mode: str, dtype: str, world: int, spec: RefCompression, t: int, before: dict) -> dict:
    """Commit t of a compressed run recomputed by the reference's pieces (``reference._Exchange``, AdamW on
    unsharded fp32 master weights) from the run's own state before it: ``before`` holds theta^t, both
    moments, the residual of every rank, where the rounds of commit t computed (``at``: theta~^t in acco,
    theta^{t-1} in dpu, theta^t in sync; ``theta_at``: theta^t in acco) as the run's replicas held them, and
    ``base``: what the replicas held when commit t's job started (compressed all-gather). Returns the
    parameters, moments, norm, every rank's residual after commit t, the estimate theta~^{t+1} of the next
    step (acco, exact) and the replicas of theta^{t+1} the all-gather leaves from ``base`` and the run's
    theta^{t+1} (``new_theta``; ``replica``)."""
    hyper = [RefHyper(before["lr"], (0.9, 0.999), 1e-8, WD)]
    theta = before["theta"]
    adam = _Adam([theta], 0.0, RefState([before["exp_avg"]], [before["exp_avg_sq"]], t))
    ex = _Exchange(spec, world, [theta])
    if spec.error_feedback:
        ex.residuals = [[r.clone()] for r in before["residuals"]]
    grad_fn, compute = toy_grad_fn(model_dtype(dtype)), DTYPES[model_dtype(dtype)]
    next_mb = [t * GAS] * world
    out = {}
    if mode == "acco":
        per_rank, n_tilde = ex.accumulate([before["at"]], GAS // 2, compute, grad_fn, next_mb)
        g_tilde = ex.reduce(per_rank, spec.peek, commit=False, bits=spec.peek_bits)
        out["estimate"] = adam.peek(_avg(g_tilde, n_tilde), hyper)[0]
        per_rank, n = ex.accumulate([before["theta_at"]], GAS // 2, compute, grad_fn, next_mb)
        g = ex.reduce(per_rank, spec.commit, bits=spec.commit_bits)
        adam.commit(_avg([g[0] + g_tilde[0]], n + n_tilde), hyper)
    else:
        per_rank, n = ex.accumulate([before["at"]], GAS, compute, grad_fn, next_mb)
        adam.commit(_avg(ex.reduce(per_rank, spec.commit, bits=spec.commit_bits), n), hyper)
    out.update(
        theta=adam.theta()[0],
        exp_avg=adam.moment("exp_avg")[0],
        exp_avg_sq=adam.moment("exp_avg_sq")[0],
        norm=adam.last_norm,
        residuals=[r[0] for r in ex.residuals] if spec.error_feedback else None,
    )
    if (
        spec.all_gather
    ):  # from the run's own theta^{t+1} (``new_theta``): rounding decisions are discontinuous
        ex.replicas = [before["base"].to(compute)]
        out["replica"] = ex.publish([before["new_theta"]], compute)[0].float()
    return out


@pytest.mark.parametrize("name", COMPRESSED)
def test_compressed_steps_match_reference(run, name):
    """Each commit of a compressed run equals the reference's (the same quantizer, one error-feedback residual
    per simulated rank) recomputed from the run's own state before it: parameters, both moments, the norm,
    every rank's residual (bit for bit: each rank's buffer is the reference's, bit for bit) and, in acco, the
    estimate of the next step.

    Why step by step and not one free-running reference: quantization is discontinuous. The run and the
    reference differ by a few fp32 ulps after a step (summation order), and such a difference flips a rounding
    decision now and then (a value at k + 1/2 of a quantization step), which moves one gradient element by a
    whole step: the free-running trajectories then part by as much as what the test must detect."""
    world, results = run
    mode, dtype, comp = COMPRESSED[name]
    spec = ref_compression(comp, dtype)
    res = results[name]
    theta0 = toy.flat(toy.trainable(toy.build().to(DTYPES[model_dtype(dtype)])))
    zeros = torch.zeros_like(theta0)
    thetas = [theta0] + res["traj"]
    moments = {k: [zeros] + res["moments"][k] for k in ("exp_avg", "exp_avg_sq")}
    padded = padded_numel(theta0.numel(), world)
    per_rank = res["residuals_per_rank"]
    norms = reported_norms(res, mode)
    # theta^t as the replicas hold it: the fp32 master cast, or, with a compressed all-gather, the run's replicas
    held = [theta0] + (res["committed_replica"] if spec.all_gather else res["traj"])
    for t in range(STEPS):
        at = {"sync": held[t], "dpu": held[max(t - 1, 0)]}.get(mode)
        if mode == "acco":
            at = theta0 if t == 0 else res["model_at_boundary"][t - 1]
        before = {
            "lr": res["lrs"][t],
            "theta": thetas[t],
            "theta_at": held[t],
            "new_theta": res["traj"][t],
            # the MODEL buffer when commit t's job started: acco, the estimate the peek of step t left
            "base": res["model_at_boundary"][t] if mode == "acco" else held[t],
            "exp_avg": moments["exp_avg"][t],
            "exp_avg_sq": moments["exp_avg_sq"][t],
            "at": at,
            "residuals": [
                torch.zeros(padded, dtype=DTYPES[dtype]) if t == 0 else per_rank[r][t - 1]
                for r in range(world)
            ],
        }
        want = replay_step(mode, dtype, world, spec, t, before)
        where = f"{name} W={world} commit {t + 1}"
        diff = (res["traj"][t] - want["theta"]).abs().max().item()
        assert diff <= TOL[dtype], f"{where}: parameters max |diff| {diff:.3e} > {TOL[dtype]}"
        for key in ("exp_avg", "exp_avg_sq"):
            rel = max_rel(res["moments"][key][t], want[key])
            assert rel <= MOMENT_TOL[dtype], f"{where}: {key} max rel diff {rel:.3e}"
        assert norms[t] == pytest.approx(want["norm"], rel=NORM_TOL[dtype]), f"{where}: grad norm"
        if spec.error_feedback:
            for r in range(world):
                got = per_rank[r][t]
                assert torch.equal(got, want["residuals"][r]), (
                    f"{where}: rank {r}'s residual differs, max |diff| "
                    f"{(got.double() - want['residuals'][r].double()).abs().max().item():.3e}"
                )
            if spec.commit:
                assert any(bool(per_rank[r][t].ne(0).any()) for r in range(world)), (
                    f"{where}: all residuals zero"
                )
            else:  # an uncompressed commit sent what the peeks withheld
                assert all(not per_rank[r][t].any() for r in range(world)), f"{where}: a residual left"
        if spec.all_gather:  # the replicas of theta^{t+1}: the same dequantized differences, bit for bit
            got = res["committed_replica"][t]
            assert torch.equal(got, want["replica"]), (
                f"{where}: replicas of theta differ from base + deq(Q(theta - base)), max |diff| "
                f"{(got - want['replica']).abs().max().item():.3e}"
            )
        if mode == "acco" and t + 1 < STEPS:  # the model holds the estimate theta~^{t+1} at boundary t
            held_est, exact = res["model_at_boundary"][t], want["estimate"].to(DTYPES[dtype]).float()
            slack = TOL[dtype]
            if spec.all_gather:  # within half a quantization step of the difference to theta^t's replicas
                slack += est_quantization_bound(
                    exact - held[t], world, comp["block_size"], spec.all_gather_bits
                )
            d = (held_est - exact).abs() - slack
            assert d.max().item() <= 0, f"{where}: estimate off by {d.max().item():.3e} beyond {TOL[dtype]}"
    assert (res["traj"][-1] - res["traj"][0]).abs().max() > 10 * TOL[dtype]
    if spec.all_gather:  # the replicas trail the master: not equal to it, but close
        gap = (res["committed_replica"][-1] - res["traj"][-1]).abs().max().item()
        assert 0 < gap < 0.05 * (res["traj"][-1] - res["traj"][0]).abs().max().item(), f"{name}: gap {gap}"


def est_quantization_bound(diff: torch.Tensor, world: int, block_size: int, bits: int = 8) -> torch.Tensor:
    """Per element, half the quantization step of its block of ``diff`` laid out as the all-gather cuts it
    (chunks of the padded layout, blocks inside each chunk), plus fp32 rounding."""
    n = diff.numel()
    full = torch.zeros(padded_numel(n, world))
    full[:n] = diff
    steps = []
    for chunk in full.view(world, -1):
        _, scales = quantize(chunk, block_size, bits=bits)
        steps.append(scales.repeat_interleave(block_size)[: chunk.numel()])
    return torch.cat(steps)[:n] * 0.5001 + 1e-7


@pytest.mark.parametrize("name", ["acco_fp32_int8", "dpu_fp32_int8", "sync_fp32_int8"])
def test_compression_and_error_feedback_are_visible(name):
    """The compressed reference differs from the uncompressed one, and from the same compression without
    error feedback, by far more than the tolerance: a run that skipped the quantization or dropped the
    residuals could not pass test_compressed_matches_reference."""
    mode, dtype, comp = COMPRESSED[name]
    lrs = (LR,) * STEPS
    spec = ref_compression(comp, dtype)
    with_ef = reference(mode, dtype, 2, "noclip", lrs, spec).params[-1][0]
    plain = reference(mode, dtype, 2, "noclip", lrs).params[-1][0]
    no_ef = reference(
        mode, dtype, 2, "noclip", lrs, ref_compression({**comp, "error_feedback": False}, dtype)
    )
    assert (with_ef - plain).abs().max() > 10 * TOL[dtype], name
    assert (with_ef - no_ef.params[-1][0]).abs().max() > 10 * TOL[dtype], name


@pytest.mark.parametrize("name", ["dpu_fp32_all_gather_only", "sync_fp32_int8_all_gather"])
def test_compressed_all_gather_is_visible(name):
    """The reference whose replicas receive int8 differences differs from the one whose replicas receive the
    parameters, by far more than the tolerance: a run that gathered the exact parameters could not pass
    test_compressed_steps_match_reference's free check of the gradients' points either."""
    mode, dtype, comp = COMPRESSED[name]
    lrs = (LR,) * STEPS
    packed = reference(mode, dtype, 2, "noclip", lrs, ref_compression(comp, dtype)).params[-1][0]
    exact = reference(
        mode, dtype, 2, "noclip", lrs, ref_compression({**comp, "all_gather": "none"}, dtype)
    ).params[-1][0]
    assert (packed - exact).abs().max() > 10 * TOL[dtype], name


def test_compressed_replicas_are_bitwise_identical(run):
    """After many compressed steps every rank holds the same parameters, bit for bit."""
    world, results = run
    for name in list(COMPRESSED) + [LONG[0]]:
        models = results[name]["final_model_per_rank"]
        assert len(models) == world
        for r, m in enumerate(models):
            assert torch.equal(m, models[0]), f"{name}: rank {r}'s parameters differ from rank 0's"
    long = results[LONG[0]]
    assert long["stats"]["committed_steps"] == LONG_STEPS
    assert (long["traj"][-1] - long["traj"][0]).abs().max() > 0.1  # it trained


def wire_bytes(world: int, precision: str, block_size: int | None, params_block: int | None = None) -> int:
    """Bytes one rank sends (and receives) in a round of the toy model: the gradient exchange ((W-1)
    chunks: comm dtype, or int8 plus one fp32 scale per block of ``block_size``) and the parameter
    all-gather (the parameter dtype, or int8 plus a scale per block of ``params_block``)."""
    shard = padded_numel(toy.flat(toy.trainable(toy.build())).numel(), world) // world
    size = DTYPES[precision].itemsize

    def packed(block):
        return shard * size if block is None else shard + 4 * num_blocks(shard, block)

    return (world - 1) * (packed(block_size) + packed(params_block))


@pytest.mark.parametrize("mode", MODES)
def test_stats_count_bytes_per_round(run, mode):
    """stats() counts what each rank sent and received, at the send/receive calls, per round and in total;
    compressed rounds send int8 plus a scale per block, and the parameter all-gather as before."""
    world, results = run
    for dtype in DTYPES:
        plain = results[name_of(mode, dtype, "noclip")]
        comp = COMPRESSED[f"{mode}_{dtype}_int8"][2]
        packed = results[f"{mode}_{dtype}_int8"]
        for res, block in ((plain, None), (packed, comp["block_size"])):
            want = wire_bytes(world, dtype, block)
            for r, st in enumerate(res["stats_per_rank"]):
                assert st["last_round_bytes_sent"] == want, (
                    mode,
                    dtype,
                    block,
                    r,
                    st["last_round_bytes_sent"],
                )
                assert st["last_round_bytes_received"] == want
                assert st["bytes_sent"] == st["rounds"] * want
                assert st["bytes_received"] == st["rounds"] * want
        if world > 1:
            assert packed["stats"]["last_round_bytes_sent"] < plain["stats"]["last_round_bytes_sent"]
    if mode == "acco":  # int8 commits, int4 peeks and parameter differences: two rounds of different sizes
        shard = padded_numel(toy.flat(toy.trainable(toy.build())).numel(), world) // world
        res = results["acco_fp32_int4_peek_and_all_gather"]
        int4 = (shard + 1) // 2 + 4 * num_blocks(shard, 16)
        commit, peek = (world - 1) * (shard + 4 * num_blocks(shard, 16) + int4), (world - 1) * 2 * int4
        for st in res["stats_per_rank"]:
            assert st["last_round_bytes_sent"] in (commit, peek)
            assert st["bytes_sent"] == st["rounds"] // 2 * (commit + peek) + st["rounds"] % 2 * peek, st
    name = {"acco": "acco_bf16_int8_all_gather", "dpu": "dpu_fp32_all_gather_only"}.get(
        mode, "sync_fp32_int8_all_gather"
    )
    _, dtype, comp = COMPRESSED[name]
    block = comp["block_size"]
    want = wire_bytes(world, dtype, block if comp.get("commit") == "int8" else None, block)
    for st in results[name]["stats_per_rank"]:
        assert st["last_round_bytes_sent"] == want == st["last_round_bytes_received"], (name, st, want)


@pytest.mark.parametrize("name", COLLECTIVE_TWINS)
def test_collective_exchange_gives_the_point_to_point_bits(run, name):
    """The compressed exchanges in their collective form (NCCL's all-to-all / all-gather, here on gloo) give the
    point-to-point form's run bit for bit: parameters, moments, norms, every rank's residual and replica, and
    the same bytes counted."""
    world, results = run
    got, want = results[name], results[COLLECTIVE_TWINS[name]]
    for key in ("traj", "norms", "residuals_per_rank", "final_model_per_rank"):
        assert _same(got[key], want[key]), f"{name} W={world}: {key} differs from the point-to-point run"
    for key in ("exp_avg", "exp_avg_sq"):
        assert _same(got["moments"][key], want["moments"][key]), f"{name} W={world}: {key} differs"
    for a, b in zip(got["stats_per_rank"], want["stats_per_rank"]):
        assert (a["bytes_sent"], a["bytes_received"]) == (b["bytes_sent"], b["bytes_received"]), (a, b)


@pytest.mark.parametrize("name", UNCOMPRESSED_COLLECTIVE_TWINS)
def test_uncompressed_collectives_give_the_point_to_point_bits(run, name):
    """The branch NCCL takes (the in-place reduce-scatter into this rank's slice, the all-gather into the flat
    buffer), run on gloo ranks: the reference, as the point-to-point run; at W <= 2 the point-to-point run bit for
    bit (parameters, moments, norms, every rank's final model). At W = 3 gloo's reduce-scatter adds the three ranks'
    values in another order than the point-to-point sum (own, rank - 1, rank - 2): the bits differ by that rounding,
    every rank still ends with the same model. The same bytes counted either way."""
    world, results = run
    got, want = results[name], results[UNCOMPRESSED_COLLECTIVE_TWINS[name]]
    mode, dtype = UNCOMPRESSED_COLLECTIVE_TWINS[name].split("_")[:2]
    assert_matches_reference(got, mode, dtype, world, "clip", TOL[dtype], MOMENT_TOL[dtype], NORM_TOL[dtype])
    finals = got["final_model_per_rank"]
    assert all(torch.equal(f, finals[0]) for f in finals), f"{name} W={world}: the ranks' models differ"
    for a, b in zip(got["stats_per_rank"], want["stats_per_rank"]):
        assert (a["bytes_sent"], a["bytes_received"]) == (b["bytes_sent"], b["bytes_received"]), (a, b)
    if world > 2:
        return
    for key in ("traj", "norms", "final_model_per_rank"):
        assert _same(got[key], want[key]), f"{name} W={world}: {key} differs from the point-to-point run"
    for key in ("exp_avg", "exp_avg_sq"):
        assert _same(got["moments"][key], want["moments"][key]), f"{name} W={world}: {key} differs"


@pytest.mark.parametrize("name", STORED_SUM_TWINS)
def test_stored_sum_gives_the_unstored_bits(run, name):
    """The owner's sum of the quantized chunks stored once (the many-rank path) gives the run whose norm and step
    read the chunks (acco_ds.ops.quantized_sum_step) bit for bit: parameters, moments, every rank's residual and
    replica; the reported norms within the order of their fp64 additions."""
    world, results = run
    got, want = results[name], results[STORED_SUM_TWINS[name]]
    for key in ("traj", "residuals_per_rank", "final_model_per_rank"):
        assert _same(got[key], want[key]), f"{name} W={world}: {key} differs from the unstored run"
    for key in ("exp_avg", "exp_avg_sq"):
        assert _same(got["moments"][key], want["moments"][key]), f"{name} W={world}: {key} differs"
    assert len(got["norms"]) == len(want["norms"])
    for t, (a, b) in enumerate(zip(got["norms"], want["norms"])):
        close = a is None or abs(a - b) <= 1e-6 * abs(b)
        assert (a is None) == (b is None) and close, f"{name} W={world}: norm of step {t}: {a} vs {b}"


@pytest.mark.parametrize("name", UNFUSED_TWINS)
def test_fused_round_end_gives_the_job_quantized_bits(run, name):
    """Compressed rounds quantized in their last backward's gradient hooks (the default, core.fused_round_end) give
    the run whose jobs quantize them, bit for bit: parameters, moments, norms, every rank's residual and replica;
    every compressed round of the fused run was fused, none of the other's."""
    world, results = run
    got, want = results[name], results[UNFUSED_TWINS[name]]
    for key in ("traj", "norms", "residuals_per_rank", "final_model_per_rank"):
        assert _same(got[key], want[key]), f"{name} W={world}: {key} differs from the fused run"
    for key in ("exp_avg", "exp_avg_sq"):
        assert _same(got["moments"][key], want["moments"][key]), f"{name} W={world}: {key} differs"
    _, _, comp = COMPRESSED[UNFUSED_TWINS[name]]
    for fused, plain in zip(want["stats_per_rank"], got["stats_per_rank"]):
        exact_commits = fused["rounds"] // 2 if comp.get("commit", "none") == "none" else 0
        assert fused["fused_round_ends"] == fused["rounds"] - exact_commits > 0, fused
        assert plain["fused_round_ends"] == 0, plain


def _same(a, b) -> bool:
    """Equal, bit for bit, through nested lists (tensors compared with torch.equal)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
