"""An unmodified Hugging Face-style training script (tests/ranks/hf_example.py: HfArgumentParser, TrainingArguments
from the command line, the Trainer, nothing of ACCO) trains with ``"type": "ACCO"`` when its ranks start
through ``python -m acco_ds.run``, under each launcher as a user types it (2 CPU ranks, gloo):

- ``deepspeed --num_gpus 2 --module acco_ds.run hf_example.py --deepspeed cfg.json ...``: mode sync logs
  DeepSpeed ZeRO-1 AdamW's losses and grad norms (the same script and config with ``"type": "AdamW"``);
- ``torchrun --nproc-per-node 2 -m acco_ds.run hf_example.py --deepspeed cfg.json ...``: mode acco trains
  (the loss falls) and saves Trainer checkpoints;
- ``accelerate launch --config_file accelerate.yaml -m acco_ds.run hf_example.py ...`` (the DeepSpeed config
  from the accelerate config's ``deepspeed_config_file``): ``--resume_from_checkpoint`` of the torchrun run's
  checkpoint continues it exactly;
- and the same script started without acco_ds.run stops in ``deepspeed.initialize`` with DeepSpeed's
  unsupported-optimizer error: what the runner fixes.

accelerate cannot count DeepSpeed's ranks on a CPU-only machine (tests/ranks/cpu_accelerate_shim.py); the ranks
apply that shim at start-up (``ACCO_DS_TEST_CPU_ACCELERATE_SHIM``, tests/ranks/cpu_hook), not the script.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from acco_ds.cli import launch as cli_launch
from tests.integrations.trainer_config import AUTO, trainer_ds_config
from tests.ranks.launch import REPO, free_port, rank_env

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

SCRIPT = REPO / "tests" / "ranks" / "hf_example.py"
WORLD, SYNC_STEPS, STEPS, SAVE = 2, 4, 6, 3
# the Trainer settings of tests/ranks/hf_worker.py (trainer_args), as the command line gives them
TRAINER_ARGS = [
    "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--logging_steps", "1",
    "--learning_rate", "3e-3", "--lr_scheduler_type", "linear", "--warmup_steps", "2",
    "--weight_decay", "0.01", "--max_grad_norm", "1.0", "--report_to", "none", "--seed", "0",
    "--dataloader_num_workers", "0", "--disable_tqdm", "true",
]  # fmt: skip
SAMPLES_PER_STEP = WORLD * 2 * 2  # ranks x micro-batch x accumulation (TRAINER_ARGS)
UNSUPPORTED = "ACCO is not a supported DeepSpeed Optimizer"


def ds_config(optimizer: dict, monitor: Path) -> dict:
    """The HF Trainer tests' config with ``optimizer``, and DeepSpeed's CSV monitor in ``monitor`` (ACCO writes
    its own figures there: proof that ACCO trained)."""
    csv = {"enabled": True, "output_path": str(monitor), "job_name": "run"}
    return trainer_ds_config(optimizer, csv_monitor=csv)


def write_config(tmp: Path, name: str, optimizer: dict) -> Path:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(ds_config(optimizer, tmp / f"monitor_{name}")))
    return path


def env() -> dict:
    return rank_env(ACCO_DS_TEST_CPU_ACCELERATE_SHIM=1)


def run(cmd: list, what: str, world: int = WORLD, port: int | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repository root; fails the test with the output's tail when it exits non-zero."""
    cmd = [str(c) for c in cmd]
    try:
        proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    finally:
        if port is not None:
            cli_launch.cleanup_shm(port, world)
    assert proc.returncode == 0, (
        f"{what} failed (rc={proc.returncode}): {' '.join(cmd)}\n" + (proc.stdout + proc.stderr)[-6000:]
    )
    return proc


def script_args(out: Path, steps: int, *extra) -> list:
    return [SCRIPT, "--output_dir", out, "--max_steps", steps, *TRAINER_ARGS, *extra]


def steps_logged(out: Path) -> dict:
    """{step: (loss, grad_norm)} of the Trainer's log (trainer_state.json, written by the script)."""
    state = json.loads((out / "trainer_state.json").read_text())
    return {h["step"]: (h["loss"], h.get("grad_norm")) for h in state["log_history"] if "loss" in h}


def monitor_rows(tmp: Path, name: str, event: str) -> list:
    """[(x, value)] of one event of the run with config ``name`` (DeepSpeed's CSV monitor: x = samples)."""
    path = tmp / f"monitor_{name}" / "run" / (event.replace("/", "_") + ".csv")
    if not path.exists():
        return []
    with open(path) as f:
        return [(int(x), float(v)) for x, v in list(csv.reader(f))[1:]]


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    """``deepspeed --module acco_ds.run``: the script with "AdamW" and with "ACCO" mode sync."""
    tmp = tmp_path_factory.mktemp("unmodified_deepspeed")
    configs = {
        "adamw": write_config(tmp, "adamw", {"type": "AdamW", "params": AUTO}),
        "sync": write_config(tmp, "sync", {"type": "ACCO", "params": {**AUTO, "mode": "sync"}}),
    }
    for name, config in configs.items():
        port = free_port()
        args = script_args(tmp / name, SYNC_STEPS, "--deepspeed", config, "--save_strategy", "no")
        cmd = cli_launch.runner_command(WORLD, port, target="acco_ds.run", extra=[str(a) for a in args])
        run(cmd, f"deepspeed --module acco_ds.run ({name})", port=port)
    return SimpleNamespace(tmp=tmp, adamw=steps_logged(tmp / "adamw"), sync=steps_logged(tmp / "sync"))


@pytest.fixture(scope="module")
def acco_runs(tmp_path_factory):
    """``torchrun -m acco_ds.run``: mode acco, checkpoints every SAVE steps; then ``accelerate launch -m
    acco_ds.run`` resumes from the checkpoint at step SAVE, with the same ACCO config from its config file."""
    tmp = tmp_path_factory.mktemp("unmodified_acco")
    config = write_config(tmp, "acco", {"type": "ACCO", "params": {**AUTO, "mode": "acco"}})
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", WORLD]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", port, "-m", "acco_ds.run"]
    saving = ["--save_strategy", "steps", "--save_steps", SAVE]
    run(
        torchrun + script_args(tmp / "torchrun", STEPS, "--deepspeed", config, *saving), "torchrun", port=port
    )

    port = free_port()
    resumed_config = write_config(tmp, "resumed", {"type": "ACCO", "params": {**AUTO, "mode": "acco"}})
    accelerate_config = tmp / "accelerate.yaml"
    accelerate_config.write_text(
        "compute_environment: LOCAL_MACHINE\n"
        "distributed_type: DEEPSPEED\n"
        "deepspeed_config:\n"
        f"  deepspeed_config_file: {resumed_config}\n"
        "  zero3_init_flag: false\n"
        "machine_rank: 0\n"
        "main_process_ip: 127.0.0.1\n"
        f"main_process_port: {port}\n"
        "num_machines: 1\n"
        f"num_processes: {WORLD}\n"
        "rdzv_backend: static\n"
        "same_network: true\n"
        "use_cpu: false\n"
    )
    resume = ["--resume_from_checkpoint", tmp / "torchrun" / f"checkpoint-{SAVE}"]
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", accelerate_config]
    accelerate += ["-m", "acco_ds.run"]
    run(accelerate + script_args(tmp / "accelerate", STEPS, *saving, *resume), "accelerate launch", port=port)
    return SimpleNamespace(
        tmp=tmp, torchrun=steps_logged(tmp / "torchrun"), resumed=steps_logged(tmp / "accelerate")
    )


def test_deepspeed_module_sync_logs_zero1_adamw_losses(deepspeed_runs):
    adamw, sync = deepspeed_runs.adamw, deepspeed_runs.sync
    assert sorted(sync) == sorted(adamw) == list(range(1, SYNC_STEPS + 1))
    for step in adamw:
        (loss, norm), (want_loss, want_norm) = sync[step], adamw[step]
        assert loss == pytest.approx(want_loss, rel=1e-6), f"step {step}: loss {loss} vs AdamW {want_loss}"
        assert norm == pytest.approx(want_norm, rel=1e-6), (
            f"step {step}: grad norm {norm} vs AdamW {want_norm}"
        )


def test_deepspeed_module_trained_with_acco(deepspeed_runs):
    """ACCO's figures in DeepSpeed's monitor: the sync run went through ACCO (one round per step), the AdamW
    run did not (DeepSpeed writes only its own figures)."""
    tmp = deepspeed_runs.tmp
    assert [v for _, v in monitor_rows(tmp, "sync", "ACCO/rounds")] == list(range(1, SYNC_STEPS + 1))
    assert monitor_rows(tmp, "adamw", "ACCO/rounds") == []
    assert len(monitor_rows(tmp, "adamw", "Train/Samples/lr")) == SYNC_STEPS


def test_torchrun_module_trains_with_acco(acco_runs):
    logged = acco_runs.torchrun
    assert sorted(logged) == list(range(1, STEPS + 1))
    losses = [logged[s][0] for s in sorted(logged)]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.1, f"the loss does not fall: {losses}"
    # acco: two rounds per step, the first commit finishes during step 2 (its grad norm is logged from there)
    rounds = [v for _, v in monitor_rows(acco_runs.tmp, "acco", "ACCO/rounds")]
    assert rounds == [2 * k for k in range(1, STEPS + 1)]
    assert all(logged[s][1] is not None and math.isfinite(logged[s][1]) for s in range(2, STEPS + 1))
    checkpoint = acco_runs.tmp / "torchrun" / f"checkpoint-{SAVE}" / f"global_step{SAVE}"
    assert all((checkpoint / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").exists() for r in range(WORLD))


def test_accelerate_launch_module_resumes_and_continues(acco_runs):
    """The accelerate run started at step SAVE + 1 from the checkpoint (DeepSpeed's monitor counts on from the
    checkpoint's samples: a run from scratch would start at 1 step's samples), went through ACCO, and logged
    the losses and grad norms of the torchrun run that was never interrupted."""
    resumed, full = acco_runs.resumed, acco_runs.torchrun
    samples = [x for x, _ in monitor_rows(acco_runs.tmp, "resumed", "Train/Samples/lr")]
    assert samples == [SAMPLES_PER_STEP * k for k in range(SAVE + 1, STEPS + 1)]
    assert len(monitor_rows(acco_runs.tmp, "resumed", "ACCO/rounds")) == STEPS - SAVE
    assert sorted(resumed) == list(range(1, STEPS + 1))  # 1..SAVE: the checkpoint's trainer_state
    for step in range(SAVE + 1, STEPS + 1):  # an exact resume (docs/CHECKPOINTS.md): the same bits
        assert resumed[step] == full[step], f"step {step}: {resumed[step]} vs {full[step]}"


def test_plain_script_stops_at_the_unsupported_optimizer(tmp_path):
    """Without acco_ds.run (one rank, started as ``python hf_example.py``): DeepSpeed refuses "ACCO"."""
    config = write_config(tmp_path, "acco", {"type": "ACCO", "params": {**AUTO, "mode": "acco"}})
    port = free_port()
    ranks = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    cmd = [sys.executable, *script_args(tmp_path / "out", 1, "--deepspeed", config)]
    try:
        proc = subprocess.run(
            [str(c) for c in cmd],
            env={**env(), **ranks},
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO,
        )
    finally:
        cli_launch.cleanup_shm(port, 1)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert UNSUPPORTED in proc.stderr and "deepspeed" in proc.stderr, proc.stderr[-4000:]
