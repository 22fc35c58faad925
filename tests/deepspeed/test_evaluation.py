"""What users measure mid-training is the committed model (docs/ALGORITHM.md, property 9): ``engine.eval()``, the HF-style
``optimizer.eval()``/``train()`` and ``committed_weights()`` evaluate theta, the weights checkpoints and
``safe_get_full_fp32_param`` hold, never acco's estimate or dpu's previous commit, at every point of
the pipeline (prologue, a peek in flight, a commit in flight, twice in a row); and training after an
evaluation ends bit for bit where the run without it does. The module shows, during the evaluation, exactly the
committed fp32 masters cast to its dtype. acco and dpu, fixed and adaptive accumulation, fp32 and bf16, and acco in
fp16 with dynamic loss scaling (an overflow planted in step 2: a skipped step, a halved scale, then a grown one;
after an evaluation the scale and skipped steps of every step are those of the run without it); 2 ranks started as the deepspeed launcher starts them (tests/ranks/launch.py, run_local)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.ranks import toy
from tests.ranks.launch import REPO, run_local

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

STEPS, GAS, LR = 4, 4, 5e-2
# (step, micro) after which to evaluate: the prologue round, the prologue's peek in flight, stage 1
# mid-round, a commit in flight at a boundary (twice in a row), stage 2 with a peek in flight
EVAL_AT = [[0, 0], [0, 1], [1, 0], [1, 3], [1, 3], [2, 1], [3, 2]]
HOWS = ("engine_eval", "optimizer_eval", "context")
CASES = [
    ("acco", "fixed", "fp32"),
    ("acco", "fixed", "bf16"),
    ("dpu", "fixed", "fp32"),
    ("acco", "adaptive", "fp32"),
    ("dpu", "adaptive", "bf16"),
    ("acco", "fixed", "fp16"),
]
# fp16: a first scale of 2**8 growing after every good step, halved at an overflow (planted: [step, micro] on rank 0)
FP16 = {
    "enabled": True,
    "initial_scale_power": 8,
    "loss_scale_window": 1,
    "hysteresis": 1,
    "min_loss_scale": 1,
}
POISON = [[1, 1]]


def config(mode: str, accumulation: str, dtype: str) -> dict:
    params = {"lr": LR, "weight_decay": 0.1, "mode": mode, "accumulation": accumulation}
    if accumulation == "adaptive":  # rounds end exactly at their share: the same rounds in every run
        params["max_micro_batches_per_round"] = GAS // 2 if mode == "acco" else GAS
    return {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "ACCO", "params": params},
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": dtype == "bf16"},
        **({"fp16": FP16} if dtype == "fp16" else {}),
        "steps_per_print": 10**9,
    }


def name_of(case, how) -> str:
    return "_".join(case) + "_" + how


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evaluation")
    scenarios = []
    for case in CASES:
        for how in (*HOWS, "none"):
            scenarios.append(
                {
                    "name": name_of(case, how),
                    "steps": STEPS,
                    "config": config(*case),
                    "how": how,
                    "eval_at": [] if how == "none" else EVAL_AT,
                    "poison": POISON if case[2] == "fp16" else [],
                }
            )
    spec = tmp / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    run_local(REPO / "tests" / "ranks" / "eval_worker.py", 2, ["--scenarios", spec, "--out", tmp])
    return torch.load(tmp / "results.pt", weights_only=False)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("case", CASES, ids=["_".join(c) for c in CASES])
def test_evaluation_measures_the_committed_model(results, case, how):
    evals = results[name_of(case, how)]["evals"]
    assert [tuple(e["at"]) for e in evals] == [tuple(p) for p in EVAL_AT]
    for e in evals:
        assert e["got"] == e["committed"], (
            f"{case} {how} at {e['at']}: {e['got']} vs committed {e['committed']}"
        )
        assert e["restored"], f"{case} {how} at {e['at']}: the training weights were not put back"
        assert torch.equal(e["shown"], e["committed_cast"]), (
            f"{case} {how} at {e['at']}: the module did not show the committed weights in its dtype"
        )
    # the check has teeth: somewhere the weights the model held were not the committed ones
    assert any(e["held"] != e["committed"] for e in evals), case


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("case", CASES, ids=["_".join(c) for c in CASES])
def test_training_is_unperturbed(results, case, how):
    looked, never = results[name_of(case, how)], results[name_of(case, "none")]
    assert torch.equal(looked["final"], never["final"])
    for key in ("committed_steps", "applied_steps", "micro_batches_committed", "rounds", "skipped_steps"):
        assert looked["stats"][key] == never["stats"][key], key
    assert looked["scales"] == never["scales"]


def test_fp16_case_runs_in_fp16_with_an_overflow(results):
    """The fp16 case is what it claims: the model in fp16, the planted overflow skipped a step, the scale moved."""
    res = results[name_of(("acco", "fixed", "fp16"), "none")]
    assert res["model_dtype"] == "torch.float16"
    assert res["stats"]["skipped_steps"] == len(POISON)
    scales = [s for s, _ in res["scales"]]
    assert len(set(scales)) >= 2 and res["scales"][-1][1] >= 1, res["scales"]
