"""ACCO with DeepSpeed AutoTP: tensor parallelism inside a group of ranks, ACCO's data
parallelism across the groups. 4 CPU ranks (TP 2 x DP 2) and 2 (TP 1 x DP 2) through the deepspeed
launcher, a tiny Llama built from a transformers config.

- ``sync`` at TP 2 x DP 2 equals DeepSpeed's ZeRO-1 AdamW + AutoTP on the same config and data: every
  rank's parameter slices, both Adam moments and the reported gradient norm, with clipping off and
  with clipping that acts (the norm must count each split parameter on every tensor-parallel rank and
  each replicated one once).
- ``acco`` and ``dpu`` at TP 2 x DP 2 give, rebuilt over the tensor-parallel group, the trajectory of the
  same mode at TP 1 x DP 2 on the unsplit model (fp32: equal up to rounding): weights, moments, norms.
- fp16 with dynamic loss scaling, overflows planted on one rank of one tensor-parallel group (its loss times inf)
  and a scale that grows between them: ``sync`` at TP 2 x DP 2 equals DeepSpeed's ZeRO-1 fp16 + AutoTP (the same
  skipped steps and loss scale at every step, weights and moments within fp16 rounding); ``acco`` at TP 2 x DP 2
  skips and scales alike on every rank, step for step, as ``acco`` at TP 1 x DP 2 with the same overflows planted,
  and its replicas end at the same weights.
- Adaptive accumulation with one replica slowed: the ranks of a tensor-parallel group end every round at
  the same micro-batch, the replicas accumulate different counts, and no rank hangs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.ranks.launch import REPO, run_local

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

STEPS, GAS, LR, CLIP, EPS = 4, 2, 1e-2, 0.3, 1e-4
# Against ZeRO-1 + AutoTP (the same tensor-parallel split): summation order only.
TOL, MOMENT_REL, NORM_REL = 2e-6, 1e-4, 1e-5
# Against TP 1: the split matmuls round differently (gradients differ by ~1e-7 relative; sync shows the
# same gaps), which Adam turns into parameter gaps of up to ~1e-5 where a gradient is tiny (eps 1e-4
# bounds that amplification).
TP1_TOL, TP1_MOMENT_REL = 2e-5, 5e-4


# fp16: a first scale of 2**8 (the tiny Llama never overflows under 2**11), doubled after every good step
# (window 1), halved at each overflow (hysteresis 1); overflows planted ([dp_rank, tp_rank, micro-batch]) on one
# tensor-parallel rank of replica 0 in step 2 (acco: its g round) and of replica 1 in step 6 (acco: its g~ round)
FP16_STEPS = 7
FP16 = {
    "enabled": True,
    "initial_scale_power": 8,
    "loss_scale_window": 1,
    "hysteresis": 1,
    "min_loss_scale": 1,
}
POISON_TP = [[0, 1, 1 * GAS + 1], [1, 0, 5 * GAS]]
POISON_TP1 = [[d, 0, i] for d, _, i in POISON_TP]
# fp16 parameters: the fp32 masters of sync and ZeRO-1 differ by summation order in fp16 gradients (measured
# 1.5e-4); acco's at TP 2 and at TP 1 by the split matmuls' fp16 rounding, which Adam turns into up to ~1.1e-3 here
FP16_TOL, FP16_MOMENT_REL, FP16_NORM_REL = 2e-3, 2e-2, 1e-2


def fp16(cfg: dict) -> dict:
    return {**cfg, "fp16": FP16}


def config(optimizer: dict, tp: int, clip: float) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "optimizer": optimizer,
        "zero_optimization": {"stage": 1},
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
    }
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def acco(mode: str, **extra) -> dict:
    return {"type": "ACCO", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.1, "mode": mode, **extra}}


ZERO1 = {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.1}}


def launch(tmp, world: int, scenarios: list) -> dict:
    spec = tmp / f"w{world}.json"
    spec.write_text(json.dumps(scenarios))
    out = tmp / f"w{world}"
    out.mkdir()
    run_local(REPO / "tests" / "ranks" / "tp_worker.py", world, ["--scenarios", spec, "--out", out])
    return torch.load(out / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    tp = [
        {"name": f"sync_{c}", "steps": STEPS, "config": config(acco("sync"), 2, v)}
        for c, v in (("noclip", 0.0), ("clip", CLIP))
    ]
    tp += [
        {"name": f"zero1_{c}", "steps": STEPS, "config": config(ZERO1, 2, v)}
        for c, v in (("noclip", 0.0), ("clip", CLIP))
    ]
    tp += [{"name": m, "steps": STEPS, "config": config(acco(m), 2, CLIP)} for m in ("acco", "dpu")]
    tp += [
        {"name": f"{kind}_mpu", "model": "mpu_mlp", "tp": 2, "steps": STEPS, "config": config(opt, 1, CLIP)}
        for kind, opt in (("sync", acco("sync")), ("zero1", ZERO1))
    ]
    tp.append(
        {
            "name": "acco_adaptive",
            "adaptive_steps": STEPS,
            "lagging_rank": 1,
            "config": config(acco("acco", accumulation="adaptive"), 2, CLIP),
        }
    )
    tp += [
        {"name": f"ckpt_{m}", "steps": STEPS, "save_after": 2, "config": config(acco(m), 2, CLIP)}
        for m in ("sync", "dpu", "acco")
    ]
    tp += [
        {
            "name": f"{kind}_fp16",
            "steps": FP16_STEPS,
            "config": fp16(config(opt, 2, CLIP)),
            "poison": POISON_TP,
        }
        for kind, opt in (("sync", acco("sync")), ("zero1", ZERO1), ("acco", acco("acco")))
    ]
    dp = [{"name": m, "steps": STEPS, "config": config(acco(m), 1, CLIP)} for m in ("acco", "dpu")]
    dp.append(
        {
            "name": "acco_fp16",
            "steps": FP16_STEPS,
            "config": fp16(config(acco("acco"), 1, CLIP)),
            "poison": POISON_TP1,
        }
    )
    four = launch(tmp, 4, tp)
    # the TP 2 x DP 2 acco checkpoint resumed at TP 2 x DP 1 (another data-parallel size)
    dp.append(
        {
            "name": "load_tp2_dp1",
            "load_from": str(tmp / "w4" / "ckpt_acco_ckpt"),
            "config": config(acco("acco"), 2, CLIP),
        }
    )
    return four, launch(tmp, 2, dp)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


@pytest.mark.parametrize("clip", ["noclip", "clip", "mpu"])
def test_sync_equals_deepspeed_zero1_with_autotp(runs, clip):
    """AutoTP with clipping off and acting, and a user's Megatron-style mpu (clipping acting)."""
    tp, _ = runs
    ours, theirs = tp[f"sync_{clip}"], tp[f"zero1_{clip}"]
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        for t, (sa, sb) in enumerate(zip(a["steps"], b["steps"])):
            for name, want in sb["params"].items():
                d = (sa["params"][name] - want).abs().max().item()
                assert d <= TOL, f"rank {rank} step {t + 1} {name}: max |diff| {d:.3e}"
                for key in ("exp_avg", "exp_avg_sq"):
                    r = rel(sa[key][name], sb[key][name])
                    assert r <= MOMENT_REL, f"rank {rank} step {t + 1} {name} {key}: rel {r:.3e}"
            assert sa["norm"] == pytest.approx(sb["norm"], rel=NORM_REL), f"rank {rank} step {t + 1} norm"
    if clip != "noclip":  # clipping acted
        assert min(s["norm"] for s in theirs[0]["steps"]) > CLIP


@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_tensor_parallel_equals_data_parallel_only(runs, mode):
    tp, dp = runs
    ref = dp[mode][0]
    for rank, res in enumerate(tp[mode]):
        want_rank = dp[mode][res["dp_rank"]]
        for t, (got, want) in enumerate(zip(res["steps"], want_rank["steps"])):
            for name, w in want["full_params"].items():
                d = (got["full_params"][name] - w).abs().max().item()
                assert d <= TP1_TOL, f"{mode} rank {rank} step {t + 1} {name}: max |diff| {d:.3e}"
                for key in ("exp_avg", "exp_avg_sq"):
                    r = rel(got[f"full_{key}"][name], want[f"full_{key}"][name])
                    assert r <= TP1_MOMENT_REL, f"{mode} rank {rank} step {t + 1} {name} {key}: rel {r:.3e}"
            if want["norm"] is None:
                assert got["norm"] is None
            else:
                assert got["norm"] == pytest.approx(want["norm"], rel=NORM_REL), f"{mode} step {t + 1} norm"
        assert res["final_norm"] == pytest.approx(ref["final_norm"], rel=NORM_REL)
        for name, w in ref["final"].items():
            assert (res["final"][name] - w).abs().max().item() <= TP1_TOL, name


def test_adaptive_tensor_parallel_groups_end_rounds_together(runs):
    tp, _ = runs
    res = tp["acco_adaptive"]
    by_replica: dict = {}
    for r in res:
        by_replica.setdefault(r["dp_rank"], []).append(r)
    for replica, ranks in by_replica.items():
        assert len(ranks) == 2
        a, b = ranks
        assert a["rounds_of_micro"] == b["rounds_of_micro"], (
            f"replica {replica}: rounds ended at other micro-batches"
        )
        assert a["stats"]["micro_batches_local"] == b["stats"]["micro_batches_local"], replica
        assert a["stats"]["rounds"] == b["stats"]["rounds"], replica
    fast, slow = (
        by_replica[0][0]["stats"]["micro_batches_local"],
        by_replica[1][0]["stats"]["micro_batches_local"],
    )
    assert fast > slow, (fast, slow)
    stats = res[0]["stats"]
    computed = fast + slow
    assert stats["micro_batches_committed"] + stats["micro_batches_discarded"] == computed
    finals = [r["final"] for r in res]
    for f in finals[1:]:
        for name, w in finals[0].items():
            assert torch.equal(f[name], w), name


@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
def test_checkpoint_resume_is_exact_at_tp2_dp2(runs, mode):
    tp, _ = runs
    for rank, res in enumerate(tp[f"ckpt_{mode}"]):
        for name, want in res["final_uninterrupted"].items():
            assert torch.equal(res["final_resumed"][name], want), f"{mode} rank {rank} {name}"


@pytest.mark.parametrize("mode", ["dpu", "acco"])
def test_autotp_export_holds_the_committed_weights(runs, mode):
    """AutoTP's consolidated export (what HF/accelerate save for a tensor-parallel model), taken while acco
    holds its estimate, is the committed model, full size; transformers reloads it; and training went on
    exactly (the resumed run, which never exported, ends at the same weights: checked above)."""
    tp, _ = runs
    res = tp[f"ckpt_{mode}"][0]
    if mode == "acco":
        assert res["model_holds_at_export"] == "estimate"
    for name, want in res["committed_at_export"].items():
        got = res["export"][name]
        assert got.shape == want.shape and torch.equal(got, want), name
        assert torch.equal(res["reloaded"][name], want), name


def test_checkpoint_loads_at_another_data_parallel_size(runs):
    """Saved at TP 2 x DP 2, loaded at TP 2 x DP 1: the committed weights come back exactly (re-sharded
    over the new data-parallel group, docs/CHECKPOINTS.md)."""
    tp, dp = runs
    want = tp["ckpt_acco"][0]["committed_at_export"]
    for res in dp["load_tp2_dp1"]:
        for name, w in want.items():
            assert torch.equal(res["committed"][name], w), name


def assert_scale_halved_and_grew(per_step: list) -> None:
    scales = [s for s, _ in per_step]
    moves = list(zip(scales, scales[1:]))
    assert any(b < a for a, b in moves) and any(b > a for a, b in moves), scales


def scales_and_skips(res: list) -> list:
    """Per rank, (loss scale, skipped steps) after every engine step."""
    return [[(s["scale"], s["skipped"]) for s in r["steps"]] for r in res]


def test_fp16_sync_equals_deepspeed_zero1_with_autotp(runs):
    tp, _ = runs
    ours, theirs = tp["sync_fp16"], tp["zero1_fp16"]
    assert all(r["param_dtype"] == "torch.float16" for r in ours + theirs)
    want = scales_and_skips(theirs)
    assert scales_and_skips(ours) == want, "loss scale / skipped steps per step differ from ZeRO-1's"
    # the comparison covers every planted overflow, a halved and a grown scale (ZeRO-1's own record)
    assert want[0][-1][1] == len(POISON_TP), want[0]
    assert_scale_halved_and_grew(want[0])
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        for t, (sa, sb) in enumerate(zip(a["steps"], b["steps"])):
            for name, w in sb["params"].items():
                d = (sa["params"][name] - w).abs().max().item()
                assert d <= FP16_TOL, f"rank {rank} step {t + 1} {name}: max |diff| {d:.3e}"
                for key in ("exp_avg", "exp_avg_sq"):
                    if sb[key][name].abs().max() == 0:  # before ZeRO-1's first applied step
                        assert sa[key][name].abs().max() == 0, f"rank {rank} step {t + 1} {name} {key}"
                        continue
                    r = rel(sa[key][name], sb[key][name])
                    assert r <= FP16_MOMENT_REL, f"rank {rank} step {t + 1} {name} {key}: rel {r:.3e}"
            if not math.isfinite(sb["norm"]):  # an overflowed step: inf in ZeRO-1, nan or inf in ACCO
                assert not math.isfinite(sa["norm"]), f"rank {rank} step {t + 1}: norm {sa['norm']}"
            else:
                assert sa["norm"] == pytest.approx(sb["norm"], rel=FP16_NORM_REL), f"rank {rank} step {t + 1}"


def test_fp16_acco_tensor_parallel_ranks_agree(runs):
    """Every rank of every tensor-parallel group (and both replicas) the same scale and skips at every step, those
    of acco at TP 1 x DP 2 with the same overflows planted, and its weights within fp16 rounding of that run's (the
    split matmuls round differently in fp16); the replicas end at the same full weights."""
    tp, dp = runs
    res = tp["acco_fp16"]
    assert all(r["param_dtype"] == "torch.float16" for r in res)
    per_rank = scales_and_skips(res)
    assert all(p == per_rank[0] for p in per_rank), per_rank
    assert per_rank == scales_and_skips(dp["acco_fp16"])[:1] * len(res)
    assert per_rank[0][-1][1] >= len(POISON_TP), per_rank[0]  # every planted overflow skipped a step
    assert_scale_halved_and_grew(per_rank[0])
    for r in res:
        want = dp["acco_fp16"][r["dp_rank"]]
        for t, (got, w) in enumerate(zip(r["steps"], want["steps"])):
            for name, p in w["full_params"].items():
                d = (got["full_params"][name] - p).abs().max().item()
                assert d <= FP16_TOL, f"rank {r['rank']} step {t + 1} {name}: max |diff| {d:.3e} against TP 1"
    assert all(r["stats"]["skipped_steps"] == res[0]["stats"]["skipped_steps"] for r in res)
    assert all(r["final_scale"] == res[0]["final_scale"] for r in res)
    for r in res[1:]:
        for name, w in res[0]["final"].items():
            assert torch.equal(r["final"][name], w), f"rank {r['rank']} {name}"
            assert torch.isfinite(w).all(), name
