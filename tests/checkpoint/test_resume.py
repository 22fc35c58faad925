"""Checkpoints through ``engine.save_checkpoint`` / ``engine.load_checkpoint`` (docs/ALGORITHM.md,
properties 5 and 6), ranks started as the deepspeed launcher starts them, on CPU with gloo.

One launch saves mid-run in every mode (sync, dpu, acco; fp32 and bf16; at an accumulation boundary,
and inside a step with a peek in flight and gradients half accumulated; adaptive accumulation with a
slow rank; with zero_optimization.offload_optimizer turned on or off across the save), a second launch (a new
process group) resumes from the files, a third with another world
size loads the committed state (tests/checkpoint/test_reshard.py tests that in depth) and the weights
alone.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from acco_ds.core.host_step import STAGING_ENV
from tests.ranks import toy
from tests.ranks.ckpt_worker import linear_vector
from tests.ranks.launch import REPO, rank_env, run_local

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

WORLD, STEPS, GAS = 2, 6, 4
SAVE_STEP = 3
# bf16 resume: the restored buffers are bit-exact, so the continuation is expected to be too; the
# tolerance is that of the trajectory tests, for platforms whose bf16 kernels are not deterministic.
TOL = {"fp32": 0.0, "bf16": 2e-3}
ADAPTIVE_STEPS, ADAPTIVE_SAVE = 6, 3


def acco_config(mode: str, dtype: str, compression: dict | None = None) -> dict:
    """A warm-up LR schedule that changes across the save, clipping and weight decay."""
    params = {"lr": 0.02, "weight_decay": 0.1, "mode": mode}
    if compression is not None:
        params["compression"] = compression
    return {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "ACCO", "params": params},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.005, "warmup_max_lr": 0.02, "warmup_num_steps": 5},
        },
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 0.5,
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 10**9,
    }


def scenarios() -> list:
    out = []
    for mode in ("sync", "dpu", "acco"):
        for dtype in ("fp32", "bf16"):
            out.append(
                {
                    "name": f"{mode}_{dtype}",
                    "dtype": dtype,
                    "steps": STEPS,
                    "save_micro": SAVE_STEP * GAS,
                    "config": acco_config(mode, dtype),
                    "other_world": (mode, dtype) == ("acco", "fp32"),
                }
            )
    # inside a step: acco after GAS/2 + 1 micro-batches (the peek of this step in flight, one
    # micro-batch accumulated into the commit round); dpu after 1 (a commit in flight, one accumulated)
    for mode, extra in (("acco", GAS // 2 + 1), ("dpu", 1)):
        out.append(
            {
                "name": f"{mode}_fp32_inside_step",
                "dtype": "fp32",
                "steps": STEPS,
                "save_micro": SAVE_STEP * GAS + extra,
                "config": acco_config(mode, "fp32"),
            }
        )
    # compressed rounds with error feedback: the residuals are in-flight state (at a boundary, inside a step
    # with the peek in flight; bf16 sync), and a resume on another world size drops them; with the parameter
    # all-gather compressed (inside a step, sync) the replicas, which trail the master, resume as they were
    int8 = {"commit": "int8", "peek": "int8", "block_size": 16}
    for name, mode, dtype, extra in (
        ("acco_fp32_int8", "acco", "fp32", 0),
        ("acco_fp32_int8_inside_step", "acco", "fp32", GAS // 2 + 1),
        ("sync_bf16_int8", "sync", "bf16", 0),
    ):
        comp = int8 if mode == "acco" else {**int8, "peek": "none"}
        if name != "acco_fp32_int8":
            comp = {**comp, "all_gather": "int8"}
        out.append(
            {
                "name": name,
                "dtype": dtype,
                "steps": STEPS,
                "save_micro": SAVE_STEP * GAS + extra,
                "config": acco_config(mode, dtype, comp),
                "other_world": name == "acco_fp32_int8",
            }
        )
    # zero_optimization.offload_optimizer turned on or off across the save (the ranks run the staged host step a GPU
    # rank runs, ACCO_DS_HOST_STEP_STAGING=1: the checkpoint's layout is the same, and so is the continuation)
    offload = {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    for name, mode, dtype, extra, save_offloaded in (
        ("acco_fp32_offload_to_plain", "acco", "fp32", GAS // 2 + 1, True),
        ("sync_bf16_plain_to_offload", "sync", "bf16", 0, False),
    ):
        plain = acco_config(mode, dtype)
        offloaded = {**plain, "zero_optimization": offload}
        out.append(
            {
                "name": name,
                "dtype": dtype,
                "steps": STEPS,
                "save_micro": SAVE_STEP * GAS + extra,
                "config": offloaded if save_offloaded else plain,
                "resume_config": plain if save_offloaded else offloaded,
                "other_world": save_offloaded,  # loaded with offload on 1 rank
            }
        )
    for mode in ("acco", "dpu"):
        out.append(
            {
                "name": f"{mode}_adaptive",
                "adaptive": True,
                "steps": ADAPTIVE_STEPS,
                "save_commits": ADAPTIVE_SAVE,
                "slow_ms": 40,
                "config": {
                    "train_micro_batch_size_per_gpu": 1,
                    "gradient_accumulation_steps": 2,
                    "optimizer": {
                        "type": "ACCO",
                        "params": {"lr": 0.01, "mode": mode, "accumulation": "adaptive"},
                    },
                    "zero_optimization": {"stage": 1},
                    "steps_per_print": 10**9,
                },
            }
        )
    return out


SCENARIOS = scenarios()
FIXED = [s for s in SCENARIOS if not s.get("adaptive")]
ADAPTIVE = [s for s in SCENARIOS if s.get("adaptive")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import json

    out = tmp_path_factory.mktemp("ckpt")
    spec = out / "scenarios.json"
    spec.write_text(json.dumps(SCENARIOS))
    worker = REPO / "tests" / "ranks" / "ckpt_worker.py"
    res = {}
    for phase, world in (("first", WORLD), ("resume", WORLD), ("other_world", 1)):
        env = rank_env(**{STAGING_ENV: "1"})
        run_local(worker, world, ["--scenarios", spec, "--out", out, "--phase", phase], env=env)
        res[phase] = torch.load(out / f"{phase}.pt", weights_only=False)
    return out, res


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("sc", FIXED, ids=lambda s: s["name"])
def test_save_does_not_perturb_the_run(runs, sc):
    """Saving waits for the job in flight without swapping it in: the run that saved goes on exactly
    like the one that did not, and the model keeps computing at the same parameters."""
    _, res = runs
    r = res["first"][0][sc["name"]]
    assert torch.equal(r["model_after_save"], r["model_before_save"])
    assert torch.equal(r["committed_after_save"], r["at_save"])
    assert len(r["traj_b"]) == len(r["traj_a"]) == STEPS
    for t, (a, b) in enumerate(zip(r["traj_a"], r["traj_b"])):
        assert torch.equal(a, b), f"step {t + 1}: max |diff| {max_diff(a, b):.3e}"
    assert torch.equal(r["a_final"], r["b_final"])


@pytest.mark.parametrize("sc", FIXED, ids=lambda s: s["name"])
def test_resume_matches_uninterrupted(runs, sc):
    """Saved at step SAVE_STEP (or inside step SAVE_STEP + 1), loaded by a new launch into a model
    initialised differently, continued: the same parameters after every later step as the run never
    interrupted (bitwise in fp32)."""
    _, res = runs
    first, resumed = res["first"][0][sc["name"]], res["resume"][0][sc["name"]]
    tol = TOL[sc["dtype"]]
    assert torch.equal(resumed["loaded"], first["at_save"])
    done = sc["save_micro"] // GAS
    assert resumed["global_steps"] == done
    want = first["traj_a"][done:]
    assert len(resumed["traj_c"]) == len(want) == STEPS - done
    for t, (got, ref) in enumerate(zip(resumed["traj_c"], want)):
        d = max_diff(got, ref)
        assert d <= tol, f"{sc['name']} step {done + t + 1}: max |diff| {d:.3e} > {tol}"
    assert max_diff(resumed["c_final"], first["a_final"]) <= tol
    # the run moved after the resume: equal frozen trajectories would prove nothing
    assert max_diff(want[-1], first["at_save"]) > 1e-3


@pytest.mark.parametrize("sc", FIXED, ids=lambda s: s["name"])
def test_counts_survive_the_resume(runs, sc):
    """ACCO's counters continue across the save: the resumed run ends with the stats of the run
    never interrupted (rounds, micro-batches committed, peeked, discarded, steps)."""
    _, res = runs
    a = res["first"][0][sc["name"]]["a_stats"]
    c = res["resume"][0][sc["name"]]["c_stats"]
    for key in (
        "rounds",
        "micro_batches_local",
        "micro_batches_committed",
        "micro_batches_peeked",
        "micro_batches_discarded",
        "skipped_steps",
        "committed_steps",
        "applied_steps",
        "bytes_sent",
        "bytes_received",
    ):
        assert c[key] == a[key], f"{key}: resumed {c[key]} vs uninterrupted {a[key]}"
    assert a["committed_steps"] == STEPS


@pytest.mark.parametrize("sc", FIXED, ids=lambda s: s["name"])
def test_saved_module_weights_are_committed(runs, sc):
    """module.state_dict() (what DeepSpeed saves as the module, and what HF/accelerate export) holds
    the committed parameters theta, also while the model computes at acco's estimate."""
    _, res = runs
    r = res["first"][0][sc["name"]]
    dtype = torch.bfloat16 if sc["dtype"] == "bf16" else torch.float32
    if sc["config"]["optimizer"]["params"].get("compression", {}).get("all_gather") == "int8":
        # the module holds theta as the replicas do: within half a quantization step of the master, not equal
        gap = max_diff(r["state_dict_at_save"], r["at_save"].to(dtype).float())
        assert 0 < gap < 0.05 * max_diff(r["at_save"], toy.flat(toy.trainable(toy.build()))), gap
        return
    assert torch.equal(r["state_dict_at_save"], r["at_save"].to(dtype).float())
    if sc["name"] == "acco_fp32":
        assert r["model_holds_at_save"] == "estimate"
        assert max_diff(r["model_before_save"], r["at_save"]) > 1e-4  # so the test above means something


@pytest.mark.parametrize("name", ["acco_fp32", "dpu_bf16"])
def test_zero_to_fp32_rebuilds_the_master_weights(runs, name, tmp_path):
    """DeepSpeed's zero_to_fp32.py, as copied into the checkpoint folder, rebuilds the committed fp32
    weights exactly (the odd parameter count leaves padding on the last rank)."""
    out, res = runs
    ckpt = out / "ckpt" / name
    script = ckpt / "zero_to_fp32.py"
    assert script.exists(), "DeepSpeed did not copy zero_to_fp32.py into the checkpoint folder"
    proc = subprocess.run(
        [sys.executable, str(script), str(ckpt), str(tmp_path), "-t", "mid"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sd = torch.load(tmp_path / "pytorch_model.bin", weights_only=False)
    model = toy.build()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    rebuilt = toy.flat(sd[n] for n in names)
    assert all(sd[n].dtype == torch.float32 for n in names)
    assert torch.equal(sd["out.weight"], sd["emb.weight"])  # the tie survives
    assert torch.equal(rebuilt, res["first"][0][name]["at_save"])


@pytest.mark.parametrize("name", ["acco_fp32_inside_step", "dpu_fp32_inside_step"])
def test_zero_to_fp32_inside_a_step_gives_the_committed_weights(runs, name):
    """A checkpoint saved between the micro-batches of a step (a job in flight): zero_to_fp32 (DeepSpeed's
    function the script calls) rebuilds the committed weights theta, not those the model computes at."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out, res = runs
    sd = get_fp32_state_dict_from_zero_checkpoint(str(out / "ckpt" / name), tag="mid")
    names = [n for n, p in toy.build().named_parameters() if p.requires_grad]
    assert torch.equal(toy.flat(sd[n] for n in names), res["first"][0][name]["at_save"])


@pytest.mark.parametrize("name", ["acco_fp32", "acco_fp32_int8", "acco_fp32_offload_to_plain"])
def test_other_world_size_resumes_from_the_committed_state(runs, name):
    """A 2-rank ACCO checkpoint loads on 1 rank with the committed weights of the save (the re-sharding
    itself: tests/checkpoint/test_reshard.py); with compressed rounds the residuals are dropped."""
    _, res = runs
    r = res["other_world"][0][name]
    assert r["error"] is None, r["error"]
    assert torch.equal(r["loaded"], res["first"][0][name]["at_save"])


def test_weights_only_load_on_other_world_size(runs):
    """load_optimizer_states=False takes the committed weights (any world size) and trains on."""
    _, res = runs
    r = res["other_world"][0]["acco_fp32"]
    at_save = res["first"][0]["acco_fp32"]["at_save"]
    assert torch.equal(r["weights_only"], at_save)
    assert torch.equal(r["model_weights_only"], at_save)
    assert len(r["trains"]) == 2 and all(torch.isfinite(t).all() for t in r["trains"])
    assert max_diff(r["trains"][-1], at_save) > 1e-4


# -- adaptive accumulation ------------------------------------------------------------------------
def adaptive_runs(res, name):
    first = [res["first"][r][name] for r in range(WORLD)]
    resumed = [res["resume"][r][name] for r in range(WORLD)]
    return first, resumed


@pytest.mark.parametrize("sc", ADAPTIVE, ids=lambda s: s["name"])
def test_adaptive_ranks_agree_at_the_save(runs, sc):
    _, res = runs
    first, _ = adaptive_runs(res, sc["name"])
    assert len({r["round_index_after_save"] for r in first}) == 1
    local = [len(r["micro"]) for r in first]
    assert local[0] > local[1], f"the slow rank should have computed fewer micro-batches: {local}"


@pytest.mark.parametrize("sc", ADAPTIVE, ids=lambda s: s["name"])
def test_adaptive_counts_are_conserved_across_the_save(runs, sc):
    """Every micro-batch computed before or after the save is committed or (at the end) discarded,
    exactly once; the stats continue across the resume."""
    _, res = runs
    first, resumed = adaptive_runs(res, sc["name"])
    for f, r in zip(first, resumed):
        assert r["start_stats"]["micro_batches_local"] == len(f["micro"])
        assert r["stats"]["micro_batches_local"] == len(f["micro"]) + len(r["micro"])
    computed = sum(len(f["micro"]) + len(r["micro"]) for f, r in zip(first, resumed))
    stats = resumed[0]["stats"]
    assert stats["micro_batches_committed"] + stats["micro_batches_discarded"] == computed
    assert stats["skipped_steps"] == 0 and stats["committed_steps"] >= ADAPTIVE_STEPS


@pytest.mark.parametrize("sc", ADAPTIVE, ids=lambda s: s["name"])
def test_adaptive_every_gradient_enters_its_commit_across_the_save(runs, sc):
    """The linear model's micro-batch gradient is its input: each commit's count and gradient norm
    must equal those of exactly the micro-batches of its rounds, before and after the save."""
    _, res = runs
    first, resumed = adaptive_runs(res, sc["name"])
    rounds: dict = {}
    for part in (first, resumed):
        for r in part:
            for rank, index, rnd in r["micro"]:
                rounds.setdefault(rnd, []).append(linear_vector(rank, index))
    jobs = first[0]["jobs"] + resumed[0]["jobs"]
    commits = [j for j in jobs if j[0] == "commit"]
    assert [c[1] for c in commits] == list(range(len(commits))), "a commit lost or applied twice"
    assert len(commits) >= ADAPTIVE_STEPS
    per_round = 2 if sc["config"]["optimizer"]["params"]["mode"] == "acco" else 1
    for _, t, count, norm in commits:
        members = [v for r in range(per_round * t, per_round * (t + 1)) for v in rounds[r]]
        assert count == len(members), f"commit {t}: count {count} != {len(members)} micro-batches"
        expected = torch.stack(members).double().sum(0) / len(members)
        assert norm == pytest.approx(expected.norm().item(), rel=1e-5), f"commit {t}"
