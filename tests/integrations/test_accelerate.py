"""accelerate with a DeepSpeed config ("type": "ACCO") and ``import acco_ds`` as the only change:
``accelerate launch --use_deepspeed --deepspeed_config_file ...`` trains a tiny GPT-2 (tied
embeddings, from a config) with accelerate's loop, ``save_state`` writes DeepSpeed's checkpoint, and a
new launch that ``load_state``s it ends with the parameters of the run never interrupted."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.ranks.launch import REPO, free_port, rank_env

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

STEPS, SAVE = 6, 3
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "ACCO", "params": {"lr": 0.003, "weight_decay": 0.01, "mode": "acco"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.003, "warmup_num_steps": 4},
    },
    "zero_optimization": {"stage": 1},
    "steps_per_print": 10**9,
}


def accelerate_launch(config, out, *extra):
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",  # what the `accelerate launch` command runs
        "--use_deepspeed",
        "--deepspeed_config_file",
        str(config),
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(free_port()),
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(REPO / "tests" / "ranks" / "accelerate_worker.py"),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--save_at",
        str(SAVE),
        *extra,
    ]
    proc = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, (
        f"accelerate launch failed: {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-6000:]}"
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate")
    config = out / "ds_config.json"
    config.write_text(json.dumps(DS_CONFIG))
    accelerate_launch(config, out)
    accelerate_launch(config, out, "--resume")
    return (
        out,
        torch.load(out / "result.pt", weights_only=False),
        torch.load(out / "resumed.pt", weights_only=False),
    )


def test_accelerate_drives_acco(runs):
    _, full, _ = runs
    assert full["optimizer_type"] == "ACCOZeroOptimizer"
    assert full["distributed_type"].endswith("DEEPSPEED") and full["num_processes"] == 2
    assert sorted(full["losses"]) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in full["losses"].values())
    # acco: the first commit finishes during step 2, so DeepSpeed's grad norm exists from step 2 on
    norms = full["norms"]
    assert all(math.isfinite(float(norms[s])) and float(norms[s]) > 0 for s in range(2, STEPS + 1)), norms
    assert full["stats"]["committed_steps"] >= STEPS - 1


def test_save_state_writes_deepspeed_checkpoint(runs):
    out, _, _ = runs
    tag = out / "state" / "pytorch_model"
    assert (tag / "mp_rank_00_model_states.pt").exists()
    assert all((tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").exists() for r in range(2))


def test_load_state_resumes_exactly(runs):
    _, full, resumed = runs
    for name, want in full["committed"].items():
        assert torch.equal(resumed["committed"][name], want), name
    assert {s: full["losses"][s] for s in range(SAVE + 1, STEPS + 1)} == resumed["losses"]
    assert {s: float(full["norms"][s]) for s in range(SAVE + 1, STEPS + 1)} == {
        s: float(v) for s, v in resumed["norms"].items()
    }
