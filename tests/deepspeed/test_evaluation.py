"""What users measure mid-training is the committed model (docs/ALGORITHM.md, property 9): ``engine.eval()``, the HF-style
``optimizer.eval()``/``train()`` and ``committed_weights()`` evaluate theta, the weights checkpoints and
``safe_get_full_fp32_param`` hold, never acco's estimate or dpu's previous commit, at every point of
the pipeline (prologue, a peek in flight, a commit in flight, twice in a row); and training after an
evaluation ends bit for bit where the run without it does. acco and dpu, fixed and adaptive
accumulation, fp32 and bf16; 2 ranks started as the deepspeed launcher starts them (tests/ranks/launch.py, run_local)."""

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
]


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
    # the check has teeth: somewhere the weights the model held were not the committed ones
    assert any(e["held"] != e["committed"] for e in evals), case


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("case", CASES, ids=["_".join(c) for c in CASES])
def test_training_is_unperturbed(results, case, how):
    looked, never = results[name_of(case, how)], results[name_of(case, "none")]
    assert torch.equal(looked["final"], never["final"])
    for key in ("committed_steps", "applied_steps", "micro_batches_committed", "rounds"):
        assert looked["stats"][key] == never["stats"][key], key
