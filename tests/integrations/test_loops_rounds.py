"""Every training loop users train with, against its ZeRO-1 twin (DeepSpeed's own ``"type": "AdamW"`` at ZeRO stage
1, the same loop), with ACCO's rounds per optimizer step: DeepSpeed's bare loop, ``engine.coalesce_grad_reduction()``,
accelerate's ``accumulate()`` (``engine.no_sync()`` between boundaries, or ``sync_each_batch=True``; the
accumulation set in the DeepSpeed config, in ``Accelerator(gradient_accumulation_steps=...)``, in a
``GradientAccumulationPlugin``, or in two of them), the Hugging Face Trainer and PyTorch Lightning's
``DeepSpeedStrategy``. 2 CPU ranks, the tiny Llama of tests/ranks/hf_worker.py, gradient_accumulation_steps 4.

The loops over a data loader of 14 micro-batches per rank make 3 full steps and a short one of 2 (Lightning leaves
the boundaries to DeepSpeed's counter: 16 micro-batches, 4 full steps). In every loop acco runs 2 rounds per full
step (its peek after GAS/2 micro-batches, then the commit) and commits a short step of GAS/2 alone (1 round); dpu
and sync run 1 round per step. sync ends where the twin ends; the bare loop, the coalesced one and every accelerate
variant see the same micro-batches and boundaries, so acco ends bit for bit at the same weights, moments and norms
in all of them. One launch runs the DeepSpeed, accelerate and Trainer loops (tests/ranks/loops_worker.py), one the
Lightning loops."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integrations.trainer_config import AUTO, trainer_ds_config
from tests.ranks.launch import REPO, run_local

WORLD, GAS, MICRO = 2, 4, 2
SAMPLES = 56  # 14 micro-batches per rank: steps of 4, 4, 4 and 2
LIGHTNING_SAMPLES = 64  # 16 micro-batches per rank: 4 steps of 4
SIZES = [4, 4, 4, 2]
LIGHTNING_SIZES = [4, 4, 4, 4]
HYPERS = {"lr": 3e-3, "weight_decay": 0.01}
MODES = ("sync", "dpu", "acco")
# sync against the twin, as tests/deepspeed/test_engine_boundary.py: the weights within 1e-5, the moments within 1e-4
# of their largest value (DeepSpeed reduces in another order), the norms within 1e-5. Measured (2 CPU ranks): 3.1e-7,
# 1.9e-6 (exp_avg), 1.5e-5 (exp_avg_sq), 3.1e-7
WEIGHT_TOL, MOMENT_RTOL, NORM_RTOL = 1e-5, 1e-4, 1e-5
SCRIPT = REPO / "tests" / "ranks" / "loops_worker.py"


def optimizer(name: str) -> dict:
    if name == "adamw":
        return {"type": "AdamW", "params": HYPERS}
    return {"type": "ACCO", "params": {**HYPERS, "mode": name}}


def ds_config(name: str, gas=GAS) -> dict:
    """The DeepSpeed config of the DeepSpeed, accelerate and Lightning loops; ``gas`` None leaves the key out
    (Lightning refuses it: its ``accumulate_grad_batches`` fills it in)."""
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "optimizer": optimizer(name),
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    if gas is None:
        del cfg["gradient_accumulation_steps"]
    return cfg


def run(loop: str, name: str, suffix: str = "", **kw) -> dict:
    return {
        "name": f"{loop}{suffix}_{name}",
        "loop": loop,
        "samples": SAMPLES,
        "config": ds_config(name),
        **kw,
    }


# accelerate's accumulation, set in one place or two; name suffix -> the run's extra fields. accelerate 1.15 takes
# the DeepSpeed config's value when it has one (over the plugin's or the argument's), and fills an "auto" there
# from the Accelerator's
ACCELERATE_VARIANTS = {
    "": {},  # GAS 4 in the DeepSpeed config only, Accelerator(): no_sync() between boundaries
    "_seb": {"gas": "auto", "plugin": {"num_steps": GAS, "sync_each_batch": True}},  # the plugin only
    "_arg": {"gas": "auto", "gas_arg": GAS},  # Accelerator(gradient_accumulation_steps=4) only
    "_both": {"plugin": {"num_steps": 2}},  # the config's 4 and the plugin's 2: the config's wins
}


def accelerate_runs() -> list:
    runs = [run("accelerate", n) for n in ("adamw", *MODES)]
    for suffix, extra in ACCELERATE_VARIANTS.items():
        if suffix:
            extra = dict(extra)
            cfg = ds_config("acco", extra.pop("gas", GAS))
            runs.append({**run("accelerate", "acco", suffix), "config": cfg, **extra})
    return runs


RUNS = (
    [run("bare", n) for n in ("adamw", *MODES)]
    + [run("coalesce", n) for n in ("adamw", "sync", "acco")]
    + accelerate_runs()
    + [
        {
            "name": f"trainer_{n}",
            "loop": "trainer",
            "samples": SAMPLES,
            "config": trainer_ds_config(
                {"type": "AdamW", "params": AUTO}
                if n == "adamw"
                else {"type": "ACCO", "params": {**AUTO, "mode": n}}
            ),
        }
        for n in ("adamw", *MODES)
    ]
)
LIGHTNING_RUNS = [
    {**run("lightning", n), "samples": LIGHTNING_SAMPLES, "config": ds_config(n, gas=None)}
    for n in ("adamw", *MODES)
]
LOOPS = ["bare", "coalesce", "accelerate", "trainer"]
TWINNED = {  # every run with its twin: (run, twin, sizes)
    **{f"{loop}_sync": (f"{loop}_adamw", SIZES) for loop in LOOPS},
    "lightning_sync": ("lightning_adamw", LIGHTNING_SIZES),
}


def launch(tmp, runs: list) -> dict:
    (tmp / "runs.json").write_text(json.dumps(runs))
    args = ["--out", tmp, "--runs", tmp / "runs.json", "--gradient_accumulation_steps", GAS]
    run_local(SCRIPT, WORLD, args)
    return torch.load(tmp / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("loops"), RUNS)


@pytest.fixture(scope="module")
def lightning(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("lightning"), LIGHTNING_RUNS)


def rounds_per_step(res: dict) -> list:
    counts = [0] + [s["rounds"] for s in res["steps"]]
    return [b - a for a, b in zip(counts, counts[1:])]


def expected_rounds(mode: str, sizes: list) -> list:
    """acco: 2 rounds per full step, 1 for a step of at most GAS/2 micro-batches (its commit alone); dpu, sync: 1."""
    return [(2 if size > GAS // 2 else 1) if mode == "acco" else 1 for size in sizes]


def pick(request, name: str) -> dict:
    fixture = "lightning" if name.startswith("lightning") else "results"
    return request.getfixturevalue(fixture)[name]


ACCO_RUNS = [r["name"] for r in RUNS + LIGHTNING_RUNS if not r["name"].endswith("adamw")]


@pytest.mark.launcher
@pytest.mark.parametrize("name", ACCO_RUNS)
def test_rounds_per_step(request, name):
    res = pick(request, name)
    mode = name.rsplit("_", 1)[1]
    sizes = LIGHTNING_SIZES if name.startswith("lightning") else SIZES
    assert res["optimizer_type"] == "ACCOZeroOptimizer" and res["stats"]["mode"] == mode
    assert res["engine_gas"] == GAS and res["global_steps"] == len(sizes)
    got = rounds_per_step(res)
    print(f"{name}: rounds per step {got}, stats {res['stats']}")
    assert got == expected_rounds(mode, sizes), got
    stats = res["stats"]
    assert stats["optimizer_steps"] == len(sizes) and stats["rounds"] == sum(got)
    assert stats["rounds_per_step"] == pytest.approx(sum(got) / len(sizes))
    assert stats["micro_batches_local"] == sum(sizes)
    assert stats["committed_steps"] == len(sizes)


@pytest.mark.launcher
def test_accelerate_holds_the_micro_batches_between_boundaries_in_no_sync(results):
    """accelerate's accumulate() enters engine.no_sync() for the micro-batches before each boundary unless
    sync_each_batch=True; ACCO counts those (micro_batches_held) and still runs acco's two rounds per step."""
    between = sum(size - 1 for size in SIZES)
    for name in ("accelerate_adamw", "accelerate_sync", "accelerate_dpu", "accelerate_acco"):
        assert results[name]["no_sync_batches"] == between, name
    assert results["accelerate_seb_acco"]["no_sync_batches"] == 0
    assert results["accelerate_acco"]["stats"]["micro_batches_held"] == between
    assert results["accelerate_seb_acco"]["stats"]["micro_batches_held"] == 0
    assert results["bare_acco"]["stats"]["micro_batches_held"] == 0
    # coalesce_grad_reduction() holds every micro-batch of its block (its flush ends the step)
    assert results["coalesce_acco"]["stats"]["micro_batches_held"] == sum(SIZES)


@pytest.mark.launcher
@pytest.mark.parametrize("suffix", list(ACCELERATE_VARIANTS))
def test_accelerate_takes_the_deepspeed_configs_accumulation(results, suffix):
    """Wherever the accumulation is set (the DeepSpeed config, the plugin, Accelerator's argument, or the config
    and a plugin that disagree: the config's wins), accelerate steps every GAS micro-batches of the config."""
    res = results[f"accelerate{suffix}_acco"]
    assert res["accelerate_gas"] == GAS and res["engine_gas"] == GAS
    assert res["global_steps"] == len(SIZES)


@pytest.mark.launcher
@pytest.mark.parametrize("name", sorted(TWINNED))
def test_sync_ends_at_its_zero1_twin(request, name):
    """sync under each loop: DeepSpeed's ZeRO-1 AdamW under the same loop, step by step (norms) and at the end
    (weights and both moments)."""
    twin_name, sizes = TWINNED[name]
    ours, theirs = pick(request, name), pick(request, twin_name)
    assert theirs["optimizer_type"] == "DeepSpeedZeroOptimizer" and theirs["global_steps"] == len(sizes)
    assert ours["global_steps"] == len(sizes)
    gaps = {}
    for key in ("committed", "exp_avg", "exp_avg_sq"):
        assert ours[key].keys() == theirs[key].keys()
        gap = max((ours[key][n] - theirs[key][n]).abs().max().item() for n in ours[key])
        scale = max(v.abs().max().item() for v in theirs[key].values())
        gaps[key] = gap if key == "committed" else gap / scale  # the moments: relative to their largest value
        assert gaps[key] <= (WEIGHT_TOL if key == "committed" else MOMENT_RTOL), (key, gap, scale)
    for k, (a, b) in enumerate(zip(ours["steps"], theirs["steps"])):
        assert a["norm"] == pytest.approx(b["norm"], rel=NORM_RTOL), f"step {k + 1}"
    print(f"{name} vs {twin_name}: max |diff| (moments: relative) {gaps}")
    acco = pick(request, name.replace("_sync", "_acco"))["committed"]
    moved = max((theirs["committed"][n] - acco[n]).abs().max().item() for n in acco)
    assert moved > 1e-4  # acco trains another trajectory: the comparison above tells them apart


SAME_MICRO_BATCHES = [  # (run, the bare loop's run): the same micro-batches and boundaries
    *[(f"coalesce_{m}", f"bare_{m}") for m in ("adamw", "sync", "acco")],
    *[(f"accelerate_{m}", f"bare_{m}") for m in ("adamw", *MODES)],
    *[(f"accelerate{s}_acco", "bare_acco") for s in ACCELERATE_VARIANTS if s],
]


@pytest.mark.launcher
@pytest.mark.parametrize(("name", "bare"), SAME_MICRO_BATCHES)
def test_loops_with_the_same_micro_batches_end_bit_for_bit_alike(results, name, bare):
    """coalesce_grad_reduction() and every accelerate variant against DeepSpeed's bare loop: the same weights,
    moments and per-step norms, bit for bit (ACCO and DeepSpeed's own AdamW alike); ACCO with the same rounds."""
    ours, theirs = results[name], results[bare]
    for key in ("committed", "exp_avg", "exp_avg_sq"):
        for n, want in theirs[key].items():
            assert torch.equal(ours[key][n], want), (key, n)
    assert [s["norm"] for s in ours["steps"]] == [s["norm"] for s in theirs["steps"]]
    assert [s["rounds"] for s in ours["steps"]] == [s["rounds"] for s in theirs["steps"]]


def test_accelerate_sets_a_missing_accumulation_to_one():
    """accelerate 1.15's DeepSpeedPlugin writes gradient_accumulation_steps 1 into a DeepSpeed config without the
    key, and at prepare() the config's value replaces the Accelerator's (docs/HF_ACCELERATE.md says so): the
    accumulation belongs in the config, or "auto" there."""
    from accelerate.utils import DeepSpeedPlugin

    cfg = ds_config("acco")
    del cfg["gradient_accumulation_steps"]
    assert DeepSpeedPlugin(hf_ds_config=cfg).deepspeed_config["gradient_accumulation_steps"] == 1
    auto = DeepSpeedPlugin(hf_ds_config=ds_config("acco", gas="auto"))
    assert auto.deepspeed_config["gradient_accumulation_steps"] == "auto"
